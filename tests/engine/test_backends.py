"""The contract every backend meets, run against each: the same episodes, the
recorded log-probs against a teacher-forced pass of the backend's own
weights, rows that end, refill and share a prefill, tool replies fed to
their own rows, compaction, and the session's cuts on the cache.

A new backend joins by adding a case to `CASES` (and its module to
`engine.loader.BACKENDS`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import pytest
import torch

from colonnade.engine import Engine, SamplingParams, engine_for, layout
from colonnade.engine.loop import SPLIT_MIN, Admission, seeded_keys
from colonnade.engine.session import Session
from colonnade.engine.torch_backend import TorchBackend
from colonnade.model import int8_state, load_model, sequence_logprobs

REPLY = " <information>GX3 binds to PRT21 in the liver.</information> "
CPU = torch.device("cpu")


@dataclass
class Case:
    engine: Engine
    # log-probs of ids[start:] under the backend's own weights, one teacher-forced pass
    teacher: Callable[[list[int], int], torch.Tensor]
    tol: float  # max |recorded - teacher| of any token
    mean_tol: float


def _torch_fp32(tiny_dir) -> Case:
    model, tok = load_model(tiny_dir)
    return Case(
        Engine(TorchBackend(model.eval()), tok, version=3),
        lambda ids, start: sequence_logprobs(model, ids, start),
        1e-4,
        1e-4,
    )


def _torch_int8(tiny_dir) -> Case:
    # The int8 kernel rounds activations to bf16 inside the matmul, so what
    # shares a step moves a log-prob slightly.
    model, tok = load_model(tiny_dir)
    engine = engine_for(model, tok, int8_state(model), "int8", CPU, "torch", version=3)
    net = engine.backend.model
    return Case(engine, lambda ids, start: sequence_logprobs(net, ids, start), 0.1, 0.02)


def _torch_int8_compiled(tiny_dir) -> Case:
    # The same int8 engine with its step compiled (torch_compile.py): one
    # graph around the int8 and cached-attention operators.
    model, tok = load_model(tiny_dir)
    engine = engine_for(
        model, tok, int8_state(model), "int8", CPU, "torch", version=3, compile="on"
    )
    assert engine.backend.prepare(), "the compiled step did not compile"
    net = engine.backend.model
    return Case(engine, lambda ids, start: sequence_logprobs(net, ids, start), 0.1, 0.02)


def _mlx_int8(tiny_dir) -> Case:
    from colonnade.engine.mlx_backend import mlx_missing

    reason = mlx_missing()
    if reason:
        pytest.skip(reason)
    model, tok = load_model(tiny_dir)
    engine = engine_for(model, tok, int8_state(model), "int8", CPU, "mlx", version=3)
    return Case(engine, engine.backend.model.sequence_logprobs, 1e-4, 1e-4)


CASES = {
    "torch-fp32": _torch_fp32,
    "torch-int8": _torch_int8,
    "torch-int8-compiled": _torch_int8_compiled,
    "mlx-int8": _mlx_int8,
}


# Cases that compile first (tens of seconds on 2 cores): in the full suite only.
SLOW = {"torch-int8-compiled"}


@pytest.fixture(
    scope="module",
    params=[pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES],
)
def case(request, tiny_dir) -> Case:
    return CASES[request.param](tiny_dir)


def _replies(n_turns):
    seen = []

    def respond(text):
        seen.append(text)
        return None if len(seen) >= n_turns else REPLY

    return respond


def _prompts(tok):
    texts = ["<search>gene GX3", "the quick brown fox", "<answer>", "GX41 binds to PRT"]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def _groups(tok, group_size):
    return [p for p in _prompts(tok) for _ in range(group_size)]


def _responders(n, turns_of):
    """One responder per row; row i ends after turns_of(i) turns."""
    return [_replies(turns_of(i)) for i in range(n)]


def _gaps(case: Case, episodes) -> torch.Tensor:
    gaps = []
    for ep in episodes:
        ref = case.teacher(ep.prompt_ids + ep.tokens, len(ep.prompt_ids))
        got, mine = torch.tensor(ep.logprobs), torch.tensor(ep.from_model)
        assert mine.any() and (got[~mine] == 0).all()  # env tokens: masked, no log-prob
        gaps.append((ref[mine] - got[mine]).abs())
    return torch.cat(gaps)


def _within(case: Case, episodes) -> None:
    gap = _gaps(case, episodes)
    assert gap.max() < case.tol and gap.mean() < case.mean_tol


class _Counting:
    """Records the rows of every forward step, per session (copies included)."""

    def __init__(self, monkeypatch):
        self.steps: list[int] = []
        self.by_session: list[list[int]] = []
        step = Session.step

        def counted(session, chunks):
            if "_steps" not in vars(session):
                session._steps = []
                self.by_session.append(session._steps)
            self.steps.append(len(chunks))
            session._steps.append(len(chunks))
            return step(session, chunks)

        monkeypatch.setattr(Session, "step", counted)


def test_multi_turn_logprobs_equal_a_teacher_forced_pass(case):
    # The teacher-forced pass recomputes prompt, model turns and replies from
    # scratch; the engine extended one cache across turns, with padding.
    tok = case.engine.tokenizer
    params = SamplingParams(max_turn_tokens=6, max_episode_tokens=120)
    eps = case.engine.generate(_prompts(tok), [_replies(3) for _ in range(4)], params, seed=1)
    assert all(ep.finish == "done" and len(ep.turns) == 3 and ep.version == 3 for ep in eps)
    _within(case, eps)


def test_episodes_in_a_batch_match_episodes_run_alone(case):
    engine = case.engine
    # Different budgets make rows leave the batch at different steps.
    params = SamplingParams(temperature=0, max_turn_tokens=4, max_episode_tokens=40)
    prompts = _prompts(engine.tokenizer)
    together = engine.generate(prompts, [_replies(k + 1) for k in range(4)], params)
    alone = [engine.generate([p], [_replies(k + 1)], params)[0] for k, p in enumerate(prompts)]
    assert len({len(e.tokens) for e in together}) > 1
    for p, a, b in zip(prompts, together, alone, strict=True):
        # The same tokens up to the first the two runs chose differently, if
        # any; there greedy met a near-tie: int8 kernels round by how many rows
        # share a step, so the two candidates must stand within that rounding
        # under teacher forcing (a layout bug moves log-probs far more).
        pairs = zip(a.tokens, b.tokens, strict=False)
        n = next((i for i, (x, y) in enumerate(pairs) if x != y), None)
        same = min(len(a.tokens), len(b.tokens)) if n is None else n
        assert a.from_model[:same] == b.from_model[:same]
        both = zip(a.logprobs[:same], b.logprobs[:same], strict=True)
        gap = max((abs(x - y) for x, y in both), default=0.0)
        assert gap < case.tol
        if n is None:
            assert a.tokens == b.tokens
            continue
        assert a.from_model[n] and b.from_model[n]  # only sampled tokens can part
        head = [*p, *a.tokens[:n]]
        lp_a = float(case.teacher([*head, a.tokens[n]], len(head))[0])
        lp_b = float(case.teacher([*head, b.tokens[n]], len(head))[0])
        assert abs(lp_a - lp_b) < case.tol, (n, lp_a, lp_b)


def test_same_seed_same_episodes(case):
    engine, tok = case.engine, case.engine.tokenizer
    params = SamplingParams(max_turn_tokens=8, max_episode_tokens=30)
    a, b, c = (
        engine.generate(_prompts(tok), [_replies(2) for _ in range(4)], params, seed=seed)
        for seed in (3, 3, 4)
    )
    assert [e.tokens for e in a] == [e.tokens for e in b]
    assert [e.tokens for e in a] != [e.tokens for e in c]


def test_stop_strings_and_budgets_hold(case):
    engine = case.engine
    params = SamplingParams(max_turn_tokens=50, max_episode_tokens=30, stop=("</search>",))
    eps = engine.generate(_prompts(engine.tokenizer), [_replies(5) for _ in range(4)], params)
    for ep in eps:
        assert len(ep.tokens) <= 30 and ep.finish in {"done", "eos", "length", "overflow"}
        assert all("</search>" not in t[: -len("</search>")] for t in ep.turns)


def test_a_stop_string_split_across_tokens_ends_the_turn(case):
    engine, tok = case.engine, case.engine.tokenizer
    free = SamplingParams(max_turn_tokens=40, max_episode_tokens=40)
    prompts = _prompts(tok)[:1]

    def straddled(ep):
        # Where a stop string can straddle two token boundaries: the end of
        # one token, the whole next one, the start of the one after.
        pieces = [tok.decode([t]) for t in ep.tokens]
        return next(
            (
                j
                for j in range(4, len(pieces) - 1)
                if all(p and p.isascii() and p.isprintable() for p in pieces[j - 1 : j + 2])
            ),
            None,
        )

    seed, ep = next(
        (seed, ep)
        for seed in range(5, 60)
        for ep in engine.generate(prompts, [lambda t: None], free, seed=seed)
        if straddled(ep) is not None
    )
    j = straddled(ep)
    pieces = [tok.decode([t]) for t in ep.tokens]
    stop = pieces[j - 1][-1:] + pieces[j] + pieces[j + 1][:1]
    seen = []
    stopped = engine.generate(
        prompts,
        [lambda t: seen.append(t)],
        SamplingParams(max_turn_tokens=40, max_episode_tokens=40, stop=(stop,)),
        seed=seed,
    )[0]
    first = tok.decode(ep.tokens).find(stop)
    n_tokens = next(i for i in range(1, 41) if stop in tok.decode(ep.tokens[:i]))
    assert stopped.tokens == ep.tokens[:n_tokens]
    assert seen == [tok.decode(ep.tokens)[: first + len(stop)]]
    assert stopped.finish == "done"


def test_greedy_episodes_are_the_same_on_every_path(case):
    # One episode at a time in a batch of rows, shared prefills, replies fed
    # on their own rows, refills: the same tokens, turns and log-probs.
    engine = case.engine
    prompts = _groups(engine.tokenizer, 3)
    params = SamplingParams(temperature=0, max_turn_tokens=5, max_episode_tokens=80)
    paths = {"plain": (False, False, 0), "split": (False, True, 0), "shared": (True, True, 0),
             "refill": (True, True, 4)}  # fmt: skip
    runs = {
        label: engine.generate(
            prompts,
            _responders(len(prompts), lambda i: 1 + i % 3),
            params,
            max_rows=rows,
            share_prefix=share,
            split_replies=split,
        )
        for label, (share, split, rows) in paths.items()
    }
    for label in ("split", "shared", "refill"):
        for a, b in zip(runs["plain"], runs[label], strict=True):
            assert a.tokens == b.tokens and a.from_model == b.from_model, label
            assert a.turns == b.turns and a.finish == b.finish
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < case.tol


@pytest.mark.parametrize("compact_min", [32, 0])
def test_shared_refilled_and_fed_rows_record_the_teacher_forced_pass(
    case, compact_min, monkeypatch
):
    # Sampled episodes whose rows were prefilled once per group, placed into
    # ended rows, fed their replies on their own, and (compact_min 0)
    # compacted whenever a quarter of the cache is pads.
    monkeypatch.setattr(layout, "COMPACT_MIN", compact_min)
    placed, fed = [], []
    place, feed = Session.place, Session.feed

    def recorded_place(self, slots, other):
        ok = place(self, slots, other)
        placed.append((ok, other.layout.width))
        return ok

    monkeypatch.setattr(Session, "place", recorded_place)
    monkeypatch.setattr(Session, "feed", lambda s, rows, c: fed.append(rows) or feed(s, rows, c))
    prompts = _groups(case.engine.tokenizer, 4)
    params = SamplingParams(max_turn_tokens=5, max_episode_tokens=70)
    eps = case.engine.generate(
        prompts, _responders(len(prompts), lambda i: 1 + i % 3), params, seed=3, max_rows=6
    )
    assert any(ok and width for ok, width in placed) and fed
    _within(case, eps)


@pytest.mark.parametrize("max_rows", [8, 6])
def test_a_group_is_prefilled_once_and_the_batch_refills(case, max_rows, monkeypatch):
    engine = case.engine
    prompts = _groups(engine.tokenizer, 4)  # 4 groups of 4
    params = SamplingParams(max_turn_tokens=4, max_episode_tokens=60)
    seen = _Counting(monkeypatch)
    # (Replies fed on their own rows would add one-step sessions of their own.)
    eps = engine.generate(prompts, _responders(16, lambda i: 1 + i % 4), params,
                          max_rows=max_rows, split_replies=False)  # fmt: skip
    assert len(eps) == 16 and all(ep.tokens for ep in eps)
    # Prefills run one row per distinct prompt, once: a group admitted in
    # parts (6 rows: a group and a half) copies its prefilled prompt.
    prefills = [steps for steps in seen.by_session if len(steps) == 1]
    assert seen.steps[0] == 2  # the first admission's two prompts
    assert sum(steps[0] for steps in prefills) == 4
    # Waiting rows joined the running batch: it ran at full width for longer
    # than its first-finishing row lived, which a shrinking batch cannot.
    assert max(seen.steps) <= max_rows
    main = max(seen.by_session, key=len)
    assert sum(n == max_rows for n in main) > min(len(ep.tokens) for ep in eps[:max_rows])
    seen.steps.clear()
    engine.generate(prompts, _responders(16, lambda i: 1 + i % 4), params, share_prefix=False)
    assert seen.steps[0] == 16  # without sharing, every row prefills its own prompt


def test_a_tool_reply_is_fed_to_its_own_row_not_padded_into_every_row(case, monkeypatch):
    engine, tok = case.engine, case.engine.tokenizer
    assert len(tok.encode(REPLY, add_special_tokens=False)) >= SPLIT_MIN
    prompts = _groups(tok, 3)
    params = SamplingParams(max_turn_tokens=4, max_episode_tokens=60)
    widths = {}
    step = Session.step
    for split in (False, True):
        seen = []
        monkeypatch.setattr(
            Session, "step", lambda s, c, seen=seen: seen.append(sorted(map(len, c))) or step(s, c)
        )
        # Refilled rows run out of phase: some reach a reply while others decode.
        eps = engine.generate(prompts, _responders(12, lambda i: 1 + i % 3), params, seed=1,
                              max_rows=5, split_replies=split)  # fmt: skip
        monkeypatch.setattr(Session, "step", step)
        assert sum(not m for ep in eps for m in ep.from_model) > 0  # replies were fed
        widths[split] = seen

    def mixed(lens):  # a step that pads rows fed a token to a reply's width
        return lens[0] == 1 and lens[-1] >= SPLIT_MIN

    assert any(mixed(lens) for lens in widths[False])
    assert not any(mixed(lens) for lens in widths[True])
    assert any(lens[0] >= SPLIT_MIN - 1 for lens in widths[True])  # replies on their own rows


def test_compaction_keeps_greedy_episodes_and_narrows_the_cache(case, monkeypatch):
    engine = case.engine
    prompts = _groups(engine.tokenizer, 3)
    params = SamplingParams(temperature=0, max_turn_tokens=5, max_episode_tokens=120)
    widths: list[int] = []
    step = Session.step
    monkeypatch.setattr(Session, "step", lambda s, c: widths.append(s.layout.width) or step(s, c))

    def run(compact_min):
        monkeypatch.setattr(layout, "COMPACT_MIN", compact_min)
        widths.clear()
        eps = engine.generate(
            prompts, _responders(len(prompts), lambda i: 1 + i % 4), params, max_rows=5
        )
        return eps, max(widths)

    plain, plain_width = run(10**9)
    eps, width = run(0)
    assert width < plain_width
    for a, b in zip(plain, eps, strict=True):
        assert a.tokens == b.tokens and a.from_model == b.from_model and a.finish == b.finish
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < case.tol


def _alone(engine: Engine, *chunks) -> torch.Tensor:
    """Next-token logits [V] of one row fed these chunks in order, in a session of its own."""
    session = engine._session(1)
    for chunk in chunks:
        logits = session.step([list(chunk)])
    return logits[0].float()


def test_sessions_copy_rows_write_them_in_place_and_join(case):
    engine = case.engine
    a, b, c = _prompts(engine.tokenizer)[:3]
    assert len({len(a), len(b), len(c)}) == 3  # rows padded inside the cache
    close = dict(atol=2e-2 if case.tol > 1e-3 else 1e-4, rtol=0)
    session = engine._session(3)
    session.step([a, b, c])
    session.step([[7], [8], [9]])
    # Copies (a row twice): each goes on as the row it was copied from.
    copy = session.take([2, 0, 2])
    got = copy.step([[5], [6], [5]]).float()
    assert torch.allclose(got[0], _alone(engine, c, [9], [5]), **close)
    assert torch.allclose(got[1], _alone(engine, a, [7], [6]), **close)
    assert torch.equal(got[0], got[2])
    # Another session's row written over rows 0 and 2, right-aligned on this
    # session's wider cache: those rows are now that prompt's; row 1 goes on.
    other = engine._session(1)
    other.step([b[:-1]])
    assert session.place([0, 2], other.take([0, 0]))
    got = session.step([[b[-1]], [4], [b[-1]]]).float()
    assert torch.allclose(got[0], _alone(engine, b[:-1], b[-1:]), **close)
    assert torch.equal(got[0], got[2])
    assert torch.allclose(got[1], _alone(engine, b, [8], [4]), **close)
    # The copy taken before kept its own rows.
    assert torch.allclose(
        copy.step([[3]] * 3)[1].float(), _alone(engine, a, [7], [6], [3]), **close
    )
    # Rows with more columns than the session holds do not fit: nothing done.
    width = other.layout.width
    assert not other.place([0], session.take([1]))
    assert other.layout.width == width
    # Joined: the shorter side is left-padded, and both go on as they were.
    session.keep([1])
    session.extend(other)
    got = session.step([[2], [3]]).float()
    assert torch.allclose(got[0], _alone(engine, b, [8], [4], [2]), **close)
    assert torch.allclose(got[1], _alone(engine, b[:-1], [3]), **close)


class _Arriving:
    """A source whose episodes arrive at given steps (by how often it was asked),
    as requests reach a server while others run."""

    def __init__(self, at: dict[int, list[Admission]]):
        self.at, self.asked = dict(at), 0
        self.waiting: list[Admission] = []
        self.joined = 0  # episodes handed over while others ran

    def admit(self, room, idle):
        if idle and not self.waiting and self.at:  # nothing runs: the next ones come now
            self.asked = min(self.at)
        self.waiting += self.at.pop(self.asked, [])
        self.asked += 1
        take = len(self.waiting) if room is None else room
        out, self.waiting = self.waiting[:take], self.waiting[take:]
        self.joined += 0 if idle else len(out)
        return out

    def upcoming(self):
        return {tuple(a.prompt) for a in self.waiting}


def _streamed_params(case: Case, **limits) -> SamplingParams:
    # Sampled where a row's neighbours leave its log-probs as they are;
    # greedy on torch int8, where they move them (a sampled token near a
    # boundary could change).
    return SamplingParams(temperature=1.0 if case.tol < 1e-3 else 0.0, **limits)


def _same(a, b, tol) -> None:
    assert a.tokens == b.tokens and a.from_model == b.from_model
    assert a.turns == b.turns and a.finish == b.finish
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < tol


def test_episodes_arriving_while_others_run_get_the_tokens_they_get_alone(case):
    engine = case.engine
    prompts = _prompts(engine.tokenizer)
    keys = seeded_keys(11, len(prompts))
    params = _streamed_params(case, max_turn_tokens=5, max_episode_tokens=50)
    ended = []

    def admission(i):
        return Admission(prompts[i], _replies(2), keys[i], done=ended.append)

    # Two start together; the others arrive while they run (tool replies
    # included), the last one waiting for a free row (max_rows 3).
    source = _Arriving({0: [admission(0), admission(1)], 3: [admission(2)], 6: [admission(3)]})
    engine.run(source, params, max_rows=3)
    assert source.joined == 2 and len(ended) == 4
    by_prompt = {tuple(ep.prompt_ids): ep for ep in ended}
    for p, k in zip(prompts, keys, strict=True):
        alone = engine.generate([p], [_replies(2)], params, keys=[k])[0]
        _same(by_prompt[tuple(p)], alone, case.tol)


def test_each_streamed_episode_keeps_its_own_limits(case):
    engine = case.engine
    prompts = _prompts(engine.tokenizer)[:3]
    keys = seeded_keys(12, 3)
    base = _streamed_params(case, max_turn_tokens=40, max_episode_tokens=40)
    limits = [
        replace(base, max_turn_tokens=6, max_episode_tokens=5),
        replace(base, stop=("</search>", "o")),
        replace(base, ignore_eos=True, max_turn_tokens=41, max_episode_tokens=12),
    ]
    ended = {}
    episodes = [
        Admission(p, lambda t: None, k, lim, done=lambda ep, i=i: ended.__setitem__(i, ep))
        for i, (p, k, lim) in enumerate(zip(prompts, keys, limits, strict=True))
    ]
    engine.run(_Arriving({0: episodes[:2], 2: episodes[2:]}), base)
    for i, (p, k, lim) in enumerate(zip(prompts, keys, limits, strict=True)):
        alone = engine.generate([p], [lambda t: None], lim, keys=[k])[0]
        _same(ended[i], alone, case.tol)
    assert len(ended[0].tokens) <= 5 and len(ended[2].tokens) == 12
    # The distribution is the run's: an episode cannot bring its own.
    other = replace(base, temperature=base.temperature + 0.5)
    with pytest.raises(ValueError, match="distribution"):
        engine.run(_Arriving({0: [Admission(prompts[0], lambda t: None, keys[0], other)]}), base)


def _late(respond, pool, delay):
    """`respond`, its replies handed back as Futures that come after `delay` s."""

    def late(text):
        return pool.submit(lambda: (time.sleep(delay), respond(text))[1])

    return late


@pytest.mark.parametrize("max_rows", [0, 5])
def test_replies_that_come_late_give_the_episodes_of_replies_at_once(case, max_rows):
    # Rows park while their reply is on its way, the others decode, and each
    # rejoins when its reply comes, in whatever order: the same episodes.
    engine = case.engine
    prompts = _groups(engine.tokenizer, 2)
    keys = seeded_keys(5, len(prompts))
    params = _streamed_params(case, max_turn_tokens=5, max_episode_tokens=60)
    turns = lambda i: 1 + i % 3  # noqa: E731
    at_once = engine.generate(prompts, _responders(len(prompts), turns), params,
                              max_rows=max_rows, keys=keys)  # fmt: skip
    with ThreadPoolExecutor(8) as pool:
        responders = [
            _late(r, pool, 0.002 * (i % 4)) for i, r in enumerate(_responders(len(prompts), turns))
        ]
        late = engine.generate(prompts, responders, params, max_rows=max_rows, keys=keys)
    assert sum(not m for ep in late for m in ep.from_model) > 0  # replies were shown
    for a, b in zip(at_once, late, strict=True):
        _same(a, b, case.tol)


def test_rows_keep_decoding_while_one_waits_for_its_reply(case, monkeypatch):
    # Row 0's first reply comes only once every other episode has ended: a
    # loop that waited for it in place would never end.
    engine = case.engine
    prompts = _prompts(engine.tokenizer)
    keys = seeded_keys(6, len(prompts))
    params = _streamed_params(case, max_turn_tokens=5, max_episode_tokens=60, ignore_eos=True)
    gate: Future = Future()
    others_done = []
    rows = []
    sample = Session.sample

    def counted(session, chunks, p, d):
        rows.append(len(chunks))
        return sample(session, chunks, p, d)

    monkeypatch.setattr(Session, "sample", counted)

    def first_row():
        seen = []

        def respond(text):
            seen.append(text)
            return gate if len(seen) == 1 else None

        return respond

    def other_row():
        inner = _replies(2)

        def respond(text):
            reply = inner(text)
            if reply is None:
                others_done.append(1)
                if len(others_done) == len(prompts) - 1:
                    gate.set_result(REPLY)
            return reply

        return respond

    responders = [first_row()] + [other_row() for _ in prompts[1:]]
    eps = engine.generate(prompts, responders, params, keys=keys)
    # The others ran on, and ended, while row 0 waited out of the batch.
    assert gate.done() and 1 in rows and rows[0] == len(prompts)
    assert eps[0].finish == "done" and len(eps[0].turns) == 2
    waited = engine.generate(prompts[:1], [_replies(2)], params, keys=keys[:1])[0]
    _same(eps[0], waited, case.tol)
    for ep, p, k in zip(eps[1:], prompts[1:], keys[1:], strict=True):
        _same(ep, engine.generate([p], [_replies(2)], params, keys=[k])[0], case.tol)


def test_a_late_reply_that_ends_or_overflows_the_episode_ends_it(case):
    engine = case.engine
    prompts = _prompts(engine.tokenizer)[:2]
    keys = seeded_keys(7, 2)
    params = _streamed_params(case, max_turn_tokens=5, max_episode_tokens=12, ignore_eos=True)
    with ThreadPoolExecutor(2) as pool:
        ends = _late(lambda t: None, pool, 0.01)
        floods = _late(lambda t: REPLY * 4, pool, 0.01)
        done, flooded = engine.generate(prompts, [ends, floods], params, keys=keys)
    assert (done.finish, flooded.finish) == ("done", "overflow")
    assert all(done.from_model) and all(flooded.from_model) and len(flooded.turns) == 1


def test_a_reply_that_comes_within_the_grace_is_taken_in_place(case, monkeypatch):
    # A service fast beside a step: its Futures are done by the time the
    # turn ends, so no row leaves the batch (each park and rejoin copies the
    # cache) and the replies are fed together, as when each is given at once.
    engine = case.engine
    prompts = _groups(engine.tokenizer, 2)
    keys = seeded_keys(8, len(prompts))
    params = _streamed_params(case, max_turn_tokens=5, max_episode_tokens=60)
    turns = lambda i: 1 + i % 3  # noqa: E731
    parked = []
    awaited = type(engine)._awaited

    def counted(self, live, waiting, grace):
        still = awaited(self, live, waiting, grace)
        parked.extend(still)
        return still

    monkeypatch.setattr(type(engine), "_awaited", counted)

    def done_at_once(respond):
        def reply(text):
            f = Future()
            f.set_result(respond(text))
            return f

        return reply

    at_once = engine.generate(prompts, _responders(len(prompts), turns), params, keys=keys)
    futures = [done_at_once(r) for r in _responders(len(prompts), turns)]
    came = engine.generate(prompts, futures, params, keys=keys)
    assert parked == [] and sum(not m for ep in came for m in ep.from_model) > 0
    for a, b in zip(at_once, came, strict=True):
        _same(a, b, case.tol)
