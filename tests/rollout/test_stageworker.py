"""`colonnade worker --stage K/N --stage-group ...`: the settings a pipeline
group is started with, refused in one line when no group can run them; the
version every step carries; a front's batch numbers and bad replies."""

from __future__ import annotations

import socket
from functools import partial

import numpy as np
import pytest
from transformers import AutoConfig

from colonnade.cli.main import main
from colonnade.config import WorkerConfig
from colonnade.engine import SamplingParams
from colonnade.engine.loop import seeded_keys
from colonnade.engine.stages import build_stage, plan_stages, stage_names, stage_skeleton
from colonnade.model import int8_state
from colonnade.model.loading import skeleton
from colonnade.protocol import keys
from colonnade.protocol.stages import (
    Binding,
    Op,
    Sampled,
    Step,
    pack_sampled,
    pack_step,
    unpack_step,
)
from colonnade.rollout.pipeline import BadReply, Front, Group, GroupError, StageServer
from colonnade.rollout.stagelink import open_link
from colonnade.rollout.stageworker import FrontWorker, StageWorker, group_name, stage_worker
from colonnade.rollout.worker import Worker, worker_for
from colonnade.store import LocalStore
from colonnade.untrusted import SchemaError


def _cfg(**kw) -> WorkerConfig:
    cfg = WorkerConfig(store="/nowhere", **kw)
    cfg.check()
    return cfg


def test_a_group_is_read_from_the_settings():
    assert _cfg().pipeline() is None
    cfg = _cfg(stage="2/3", stage_group="a, b,c", id="b")
    assert cfg.pipeline() == (1, ("a", "b", "c"))


@pytest.mark.parametrize(
    "settings, why",
    [
        ({"stage": "2/2"}, "both"),
        ({"stage_group": "a,b"}, "both"),
        ({"stage": "2", "stage_group": "a,b"}, "K/N"),
        ({"stage": "3/2", "stage_group": "a,b"}, "1 .. N"),
        ({"stage": "1/1", "stage_group": "a"}, "2 stages or more"),
        ({"stage": "1/3", "stage_group": "a,b"}, "2 worker"),
        ({"stage": "1/2", "stage_group": "a,"}, "one id a stage"),
        ({"stage": "1/2", "stage_group": "a,a"}, "twice"),
        ({"stage": "1/2", "stage_group": "a,b", "id": "b"}, "stage 1 of --stage-group is 'a'"),
        ({"stage": "1/2", "stage_group": "a,b", "engine": "mlx"}, "torch"),
        ({"stage": "1/2", "stage_group": "a,b", "stage_in_flight": 0}, "stage_in_flight"),
        ({"stage": "1/2", "stage_group": "a,b", "stage_timeout": 0.0}, "stage_timeout"),
    ],
)
def test_a_group_no_stage_can_run_is_refused(settings, why):
    with pytest.raises(ValueError, match=why):
        _cfg(**settings)


def test_the_hook_picks_the_stage_worker(tmp_path):
    assert type(worker_for(WorkerConfig(store=str(tmp_path), id="w"))) is Worker
    front = worker_for(WorkerConfig(store=str(tmp_path), id="a", stage="1/2", stage_group="a,b"))
    later = worker_for(WorkerConfig(store=str(tmp_path), id="b", stage="2/2", stage_group="a,b"))
    assert type(front) is FrontWorker and type(later) is StageWorker
    assert later.cfg.engine == "torch"  # auto resolves to the stages' engine


def test_a_worker_whose_id_is_not_its_stages_is_refused(tmp_path):
    from colonnade.protocol.signing import new_keypair

    key, _ = new_keypair("b", tmp_path / "keys")  # the id comes from the key
    cfg = WorkerConfig(store=str(tmp_path), key=str(key), stage="1/2", stage_group="a,b")
    with pytest.raises(ValueError, match="pass --id a"):
        stage_worker(cfg)


def test_the_group_name_is_the_list_in_order():
    assert group_name(["a", "b"]) == group_name(("a", "b"))
    assert group_name(["a", "b"]) != group_name(["b", "a"])
    assert len(group_name(["x" * 64] * 32)) < 64


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_the_cli_refuses_a_bad_group_in_one_line(tmp_path, capsys):
    store = tmp_path / "run"
    argv = ["worker", "--store", str(store), "--id", "c"]
    assert main([*argv, "--stage", "2/2", "--stage-group", "a,b"]) == 2
    assert _error_line(capsys) == "error: --id 'c' but stage 2 of --stage-group is 'b'"
    assert main([*argv, "--stage", "2/3", "--stage-group", "a,c"]) == 2
    assert "2 worker(s) for 3 stages" in _error_line(capsys)
    assert not store.exists()  # nothing written


def test_the_cli_refuses_bad_link_settings_in_one_line(tmp_path, capsys):
    argv = ["worker", "--store", str(tmp_path / "run"), "--id", "a", "--stage", "1/2",
            "--stage-group", "a,b", "--stage-link", "tcp"]  # fmt: skip
    assert main([*argv, "--stage-listen", "0.0.0.0"]) == 2
    assert _error_line(capsys).startswith("error: --stage-listen '0.0.0.0': an address is")
    assert main([*argv, "--stage-advertise", "host:0"]) == 2
    assert _error_line(capsys) == "error: --stage-advertise 'host:0': the port is 1 to 65535"
    with pytest.raises(SystemExit) as e:
        main([*argv[:-1], "udp"])
    assert e.value.code == 2 and "invalid choice: 'udp'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_stage_that_cannot_listen_says_so(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        group = Group("r", "g", ("a", "b"))
        with pytest.raises(GroupError, match=f"--stage-listen 127.0.0.1:{port}: cannot listen"):
            open_link(group, 0, LocalStore(tmp_path), listen=f"127.0.0.1:{port}")


def _step(stream: int, version: int, hidden: int) -> bytes:
    return pack_step(Step(Binding("run", "g", 0, 5, stream, 0), 0, [Op("new", 0, -1, 1)],
                          np.zeros((1, 2, hidden), np.float32), np.arange(2)[None],
                          np.ones((1, 2), bool), version=version))  # fmt: skip


def test_a_later_stage_runs_the_version_each_step_names(tiny_dir, tiny, tmp_path):
    config = AutoConfig.from_pretrained(tiny_dir)
    h, plan = config.hidden_size, plan_stages(skeleton(tiny_dir), 3)
    middle = build_stage(config, int8_state(tiny[0]), plan[1])
    store, group = LocalStore(tmp_path), Group("run", "g", ("w0", "w1", "w2"))
    fetched = []
    server = StageServer(middle, store, group, h, version=3, catch_up=fetched.append)
    # Stream 0 runs v3, as the stage does; stream 1 names v5: the stage
    # catches up first; stream 2 then names v4, older than it runs: refused.
    for stream, version in ((0, 3), (1, 5), (2, 4)):
        store.put(keys.stage_key("w0", 5, stream, 0), _step(stream, version, h))
    server.poll_once()
    server.flush()
    assert fetched == [5] and server.version == 5 and server.broken == {2}
    # The version travels on to the next stage with the step.
    for stream, version in ((0, 3), (1, 5)):
        out = store.get(keys.stage_key("w1", 5, stream, 0))
        assert unpack_step(out, Binding("run", "g", 1, 5, stream, 0), h).version == version
    # A stage that follows no versions takes its own alone.
    alone = StageServer(middle, LocalStore(tmp_path / "b"), group, h, version=3)
    alone.store.put(keys.stage_key("w0", 5, 0, 0), _step(0, 4, h))
    alone.poll_once()
    assert alone.broken == {0} and alone.steps == 0


def test_a_step_names_a_version_and_a_bad_one_is_refused():
    b = Binding("run", "g", 0, 5, 0, 0)
    assert unpack_step(_step(0, 7, 8), b, 8).version == 7
    for bad in (-1, 1 << 40):
        with pytest.raises(SchemaError, match="version"):
            unpack_step(_step(0, bad, 8), b, 8)


def _front(tiny_dir, tiny, store, **kw) -> Front:
    config = AutoConfig.from_pretrained(tiny_dir)
    first = build_stage(config, int8_state(tiny[0]), plan_stages(skeleton(tiny_dir), 2)[0])
    group = Group("run", "g", ("w0", "w1"))
    return Front(first, store, group, tiny[1], config.vocab_size, **kw)


def test_a_front_numbers_its_batches_above_the_groups(tiny_dir, tiny, tmp_path):
    # A later stage takes only a batch newer than its last: a front that
    # restarts within the batches' own pace must not number below them.
    store = LocalStore(tmp_path)
    fresh = next(_front(tiny_dir, tiny, store).batches)
    store.put(keys.stage_key("w1", fresh + 500, 0, 3), b"a reply the front left")
    assert next(_front(tiny_dir, tiny, store).batches) == fresh + 501


def test_a_front_on_a_link_numbers_its_batches_above_what_stage_2_holds(tiny_dir, tiny,
                                                                        tmp_path):  # fmt: skip
    group, inbox = Group("run", "g", ("w0", "w1")), LocalStore(tmp_path)
    link = partial(open_link, group, inbox=inbox, listen="127.0.0.1:0", timeout=5)
    front_link, stage2 = link(0), link(1)
    try:
        fresh = next(_front(tiny_dir, tiny, front_link).batches)
        front_link.put(keys.stage_key("w0", fresh + 500, 1, 7), b"a step stage 2 holds")
        front_link.close()  # the front restarts: its own mailbox is empty
        front_link = link(0)
        assert next(_front(tiny_dir, tiny, front_link).batches) == fresh + 501
    finally:
        front_link.close()
        stage2.close()


def test_a_reply_that_does_not_check_gives_the_batch_up(tiny_dir, tiny, tmp_path):
    store = LocalStore(tmp_path)
    front = _front(tiny_dir, tiny, store, timeout=30.0)
    front.batches = iter([42])
    # The last stage's reply, bound to another run: the batch ends at once.
    forged = pack_sampled(Sampled(Binding("another", "g", 1, 42, 0, 0)))
    store.put(keys.stage_key("w1", 42, 0, 0), forged)
    with pytest.raises(BadReply, match="stage 2"):
        front.generate([[1, 2, 3]], [lambda text: None], SamplingParams(), seeded_keys(0, 1))


class _Served:
    """A stage's server as the worker sees it: its version, no steps."""

    def __init__(self, version: int):
        self.version = version

    def poll_once(self) -> int:
        return 0


class _Loader:
    def build(self, state, version):
        return _Served(version)

    def refresh(self, engine, state, changed, version):
        engine.version = version


def test_a_later_stage_fetches_a_newer_version_beside_its_steps(tmp_path, tiny_dir, caplog):
    import torch

    from colonnade.model import load_model, publishable_state
    from colonnade.protocol import Publisher
    from colonnade.rollout.stageweights import StageFollower
    from colonnade.rollout.weights import Weights
    from signed_runs import _write_signed_run

    store = LocalStore(tmp_path / "run")
    signer = _write_signed_run(store, anchor_every=2)
    model, _ = load_model(tiny_dir)
    publisher = Publisher(store, signer, "int8", anchor_every=2)
    for _ in range(5):  # v0..v4
        with torch.no_grad():
            next(model.parameters()).add_(0.01)
        publisher.publish(publishable_state(model))
    config = AutoConfig.from_pretrained(tiny_dir)
    stage = plan_stages(skeleton(tiny_dir), 2)[1]
    names = stage_names(*stage_skeleton(config, stage), stage)
    cfg = WorkerConfig(store=str(tmp_path / "run"), id="b", stage="2/2", stage_group="a,b",
                       poll_seconds=0.01)  # fmt: skip
    worker = StageWorker(cfg, store)
    follower = StageFollower(store, 2, signer.trust, lambda n: names.local(n) is not None)
    worker.weights = Weights(follower, _Loader())
    follower.sync(1)
    worker.weights.load()

    class _Watch:
        latest = None
        polls = 0

        @property
        def newest(self):
            return None if self.latest is None else self.latest.version

        def poll(self):
            self.polls += 1
            return self.latest

    worker.watch = _Watch()

    def names_newest(v: int) -> None:
        worker.watch.latest = type("Latest", (), {"version": v, "meta": None})()
        worker._looked = 0.0
        worker.iteration()
        worker.weights.prefetch.wait()

    # latest.json names v4: fetched in the background while the steps of v1 run on.
    names_newest(4)
    assert follower.version == 4 and worker.running_version == 1
    caplog.set_level("INFO", logger="colonnade.worker")
    # A step of v3 (the front began its batch before v4): the stage runs v3.
    worker.catch_up(3)
    assert follower.version == 3 and worker.running_version == 3
    assert "fetched now" in caplog.text
    # Then v4 again, fetched beside; its first step waits for the load alone.
    names_newest(4)
    assert follower.version == 4 and worker.running_version == 3
    worker.catch_up(4)
    assert worker.running_version == 4 and "fetched beside the steps" in caplog.text
    # A step of a version latest.json has not named (a hostile front's): one
    # more look at latest.json, then refused, nothing fetched.
    polls = worker.watch.polls
    with pytest.raises(ValueError, match=r"latest\.json names v4"):
        worker.catch_up(9)
    assert worker.watch.polls == polls + 1
    assert follower.version == 4 and worker.running_version == 4
