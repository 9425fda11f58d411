"""A served environment end to end: the engine's episodes call a real tool
service, the batch carries its signed replies, the trainer's collector
checks them instead of replaying the tool.

The service runs as its own process (`colonnade tools serve`) where a test
kills it: killed mid-run it is retried until it is back, and no group is
lost or trained on a reward the outage decided; killed for good, the
episodes that needed it end (`tool`) and their groups are counted out,
while the batch and the worker go on. A reply the worker altered, moved or
dropped is refused under its own reason.
"""

import copy
import threading

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade.engine import Engine, SamplingParams
from colonnade.engine.torch_backend import TorchBackend
from colonnade.envs import load_environment
from colonnade.protocol import EpisodeRecord, GroupRecord, RolloutBatch, encode_batch, keys
from colonnade.protocol.draws import draw_key
from colonnade.protocol.signing import new_keypair
from colonnade.protocol.turns import episode_stops
from colonnade.rollout import run_episodes
from colonnade.store import LocalStore
from colonnade.tools.client import Retry, ToolClient
from colonnade.tools.service import ToolService
from colonnade.train.collect import Collector
from colonnade.train.samples import rebuild_group
from ports import free_port
from toolproc import ServiceProcess

RUN, WORKER, VERSION, SLOT, GROUP = "run7", "w1", 2, 5, 2
PARAMS = SamplingParams(max_turn_tokens=8, max_episode_tokens=200)


def _rollout(tiny, env, n_tasks=4, retry=None):
    """What a worker makes for its claim: the tasks, a group each, as a batch."""
    model, tok = tiny
    chosen = list(env.tasks("train")[:n_tasks])
    tasks = [t for t in chosen for _ in range(GROUP)]
    draws = [draw_key(RUN, VERSION, WORKER, SLOT, t.id, r) for t in chosen for r in range(GROUP)]
    results = run_episodes(Engine(TorchBackend(model), tok), env, tasks, PARAMS, keys=draws,
                           run_id=RUN, retry=retry)  # fmt: skip
    groups = []
    for i, task in enumerate(chosen):
        rs = results[i * GROUP : (i + 1) * GROUP]
        eps = [EpisodeRecord(r.episode.tokens, r.episode.from_model, r.episode.logprobs,
                             r.episode.finish, r.episode.below, r.tools) for r in rs]  # fmt: skip
        groups.append(GroupRecord(task.id, eps))
    return results, RolloutBatch(WORKER, VERSION, 0, groups, {}, "torch", SLOT)


def _collect(tmp_path, tok, env, *batches):
    """The trainer's collector over these batches: (its groups, its counts)."""
    inbox = LocalStore(tmp_path / "inbox")
    for seq, b in enumerate(batches):
        b = copy.deepcopy(b)
        b.seq = seq
        inbox.put(keys.rollout_key(VERSION, WORKER, seq), encode_batch(b))
    train_ids = {t.id for t in env.tasks("train")}
    stop = episode_stops(PARAMS.stop, env)
    c = Collector(inbox, RUN, lambda g, v: rebuild_group(tok, env, g, v, stop, 4096, train_ids),
                  vocab=len(tok), max_tokens=PARAMS.max_episode_tokens + PARAMS.max_turn_tokens,
                  max_lag=0, poll_seconds=0.01)  # fmt: skip
    return c.collect(VERSION, need=1 << 10, timeout=0.3).groups, c.counts


def _kill_at(monkeypatch, svc: ServiceProcess, call: int, back_after: float | None):
    """SIGKILL the service as the `call`-th call is made; start it again (same
    port) `back_after` seconds later, or never."""
    made = [0]
    real = ToolClient.call

    def call_then(self, c):
        made[0] += 1
        if made[0] == call:
            svc.kill()
            if back_after is not None:
                threading.Timer(back_after, svc.start).start()
        return real(self, c)

    monkeypatch.setattr(ToolClient, "call", call_then)
    return made


@pytest.fixture
def service(tmp_path):
    key, _ = new_keypair("tools", tmp_path / "keys")
    svc = ServiceProcess("served_env", ["max_turns=3"], key, free_port())
    yield svc.start()
    svc.kill()


@pytest.mark.procs
def test_a_service_killed_mid_run_is_waited_for_and_nothing_is_lost(
    tiny, tmp_path, service, monkeypatch, caplog
):
    env = load_environment("served_env", service=service.url, service_key=service.key)
    made = _kill_at(monkeypatch, service, call=3, back_after=1.0)
    retry = Retry(tries=40, timeout=2.0, first_wait=0.05, max_wait=0.25)
    with caplog.at_level("WARNING", logger="colonnade.tools"):
        results, batch = _rollout(tiny, env, retry=retry)
    assert any("again in" in r.getMessage() for r in caplog.records)  # it did back off
    assert made[0] >= 3 and all(not r.tool_failed for r in results)
    # Every served turn shows its signed reply (EOS can end an episode early).
    assert sum(len(r.tools) for r in results) > 3
    assert all(len(r.tools) == sum(1 for t in r.episode.turns[:-1]) for r in results)
    groups, counts = _collect(tmp_path, tiny[1], env, batch)
    assert len(groups) == 4 and counts["groups_rejected"] == 0 and counts["batches_rejected"] == 0
    # Trained right: each reward is what the tool itself would have made of the turns.
    local = load_environment("served_env")
    for g in groups:
        for s, r in zip(g, [r for r in results if r.task.id == g[0].task_id], strict=True):
            assert s.score == local.score(r.task, r.episode.turns) == r.score


@pytest.mark.procs
def test_a_service_that_stays_down_ends_those_episodes_not_the_batch(
    tiny, tmp_path, service, monkeypatch
):
    env = load_environment("served_env", service=service.url, service_key=service.key)
    _kill_at(monkeypatch, service, call=3, back_after=None)
    results, batch = _rollout(tiny, env, retry=Retry(tries=3, timeout=1.0, first_wait=0.01))
    failed = {r.task.id for r in results if r.tool_failed}
    assert failed and all(r.tool_failed == "unavailable" for r in results if r.tool_failed)
    assert all(r.episode.finish == "tool" for r in results if r.tool_failed)
    groups, counts = _collect(tmp_path, tiny[1], env, batch)
    # The groups the outage touched are counted out, never trained; the rest train.
    assert counts["groups_rejected_tool_failed"] == counts["groups_rejected"] == len(failed)
    assert {g[0].task_id for g in groups} == {g.task_id for g in batch.groups} - failed


@pytest.fixture
def honest(tiny):
    """A batch made against a service in this process, and its environment."""
    private = Ed25519PrivateKey.generate()
    svc = ToolService(load_environment("served_env").tool_result, private).start()
    env = load_environment("served_env", service=svc.url, service_key=svc.public_hex)
    _, batch = _rollout(tiny, env, n_tasks=3)
    svc.close()
    replies = [(gi, ei) for gi, g in enumerate(batch.groups) for ei, e in enumerate(g.episodes)
               if len(e.tools) >= 1]  # fmt: skip
    assert len(replies) >= 3, "too few episodes with a served turn to tamper with"
    return env, batch, replies


def _env_span(ep: EpisodeRecord, k: int) -> tuple[int, int]:
    """Where the k-th reply's tokens are."""
    mask = ep.from_model
    start = [i for i in range(1, len(mask)) if mask[i - 1] and not mask[i]][k]
    end = next((i for i in range(start, len(ep.from_model)) if ep.from_model[i]), len(ep.tokens))
    return start, end


def test_a_reply_altered_by_the_worker_is_refused_with_its_own_reason(tiny, tmp_path, honest):
    env, batch, replies = honest
    _, tok = tiny
    gi, ei = replies[0]
    forged = copy.deepcopy(batch)
    ep = forged.groups[gi].episodes[ei]
    reply = ep.tools[0]
    # The worker changes the result and, to match, the reply's tokens.
    fake = {"length": reply.result["length"], "vowels": reply.result["vowels"] + 1}
    ep.tools[0] = type(reply)(reply.call, fake, reply.signature)
    start, end = _env_span(ep, 0)
    turns = [""] * reply.call.turn
    ids = tok.encode(env.tool_reply(None, turns, fake), add_special_tokens=False)
    ep.tokens[start:end], ep.from_model[start:end] = ids, [False] * len(ids)
    ep.logprobs[start:end], ep.below[start:end] = [0.0] * len(ids), [0.0] * len(ids)
    groups, counts = _collect(tmp_path, tok, env, forged)
    assert counts["groups_rejected_tool_reply"] == 1 == counts["groups_rejected"]
    assert len(groups) == len(batch.groups) - 1
    # The signed reply kept, its tokens changed: refused under the same reason.
    retext = copy.deepcopy(batch)
    ep = retext.groups[gi].episodes[ei]
    start, end = _env_span(ep, 0)
    ep.tokens[start] = (ep.tokens[start] + 1) % len(tok)
    _, counts = _collect(tmp_path / "2", tok, env, retext)
    assert counts["groups_rejected_tool_reply"] == 1


def test_replies_moved_or_dropped_are_refused(tiny, tmp_path, honest):
    env, batch, replies = honest
    _, tok = tiny
    (ga, ea), (gb, eb) = replies[0], replies[1]
    moved = copy.deepcopy(batch)
    a, b = moved.groups[ga].episodes[ea], moved.groups[gb].episodes[eb]
    a.tools[0], b.tools[0] = b.tools[0], a.tools[0]  # each signed for the other's row
    groups, counts = _collect(tmp_path, tok, env, moved)
    assert groups == [] and counts["rejected_tool_reply"] == 1
    dropped = copy.deepcopy(batch)
    dropped.groups[ga].episodes[ea].tools.pop()
    _, counts = _collect(tmp_path / "2", tok, env, dropped)
    assert counts["groups_rejected_tool_reply"] == 1
    # The honest batch itself trains whole.
    groups, counts = _collect(tmp_path / "3", tok, env, batch)
    assert len(groups) == len(batch.groups) and counts["groups_rejected"] == 0


def test_a_workers_row_counts_the_episodes_its_tool_service_failed(honest):
    from colonnade.protocol.metrics import WorkerRow
    from colonnade.rollout.tally import Tally

    _, batch, _ = honest
    tally = Tally()
    tally.counts["tool_failures"] += 2
    row = tally.row(batch, 1.0, None)
    assert WorkerRow.from_dict(row.to_dict()).tool_failures == 2
    assert tally.row(batch, 1.0, None).tool_failures == 0  # since the previous row


@pytest.mark.procs
def test_rows_that_wait_beside_the_batch_make_the_episodes_the_batch_waiting_makes(tiny, tmp_path):
    """A slow service's calls (a share of them 40x slower, so replies come
    back out of order) leave the episodes exactly as when the batch waits
    for every call: parking a row changes when it decodes, never what."""
    key, _ = new_keypair("tools", tmp_path / "keys")
    flags = ("--latency-ms", "10", "--tail-ms", "400", "--tail-share", "0.3")
    with ServiceProcess("served_env", ["max_turns=3"], key, free_port(), flags=flags) as svc:
        env = load_environment("served_env", service=svc.url, service_key=svc.key)
        model, tok = tiny
        tasks = list(env.tasks("train")[:6])
        runs = [
            run_episodes(
                Engine(TorchBackend(model), tok),
                env,
                tasks,
                PARAMS,
                seed=3,
                run_id=RUN,
                async_tools=parked,
            )
            for parked in (False, True)
        ]
    assert sum(len(r.tools) for r in runs[0]) >= 4  # the service was asked, more than once
    for waited, parked in zip(*runs, strict=True):
        assert parked.episode.tokens == waited.episode.tokens
        assert parked.episode.logprobs == pytest.approx(waited.episode.logprobs, abs=1e-6)
        assert parked.tools == waited.tools and parked.score == waited.score
        assert not parked.tool_failed and not waited.tool_failed
