"""Shared-prefix groups and continuous batching: same episodes, fuller batches."""

import pytest
import torch

from colonnade.model import sequence_logprobs
from colonnade.rollout import Engine, SamplingParams
from colonnade.rollout import engine as engine_module
from colonnade.rollout.engine import Layout, units

REPLY = " <information>GX3 binds to PRT21 in the liver.</information> "


def _responders(n, turns_of):
    """One responder per row; row i ends after turns_of(i) turns."""

    def make(limit):
        seen = []

        def respond(text):
            seen.append(text)
            return None if len(seen) >= limit else REPLY

        return respond

    return [make(turns_of(i)) for i in range(n)]


def _groups(tok, group_size):
    texts = ["<search>gene GX3", "the quick brown fox", "<answer>", "GX41 binds to PRT"]
    return [tok.encode(t, add_special_tokens=False) for t in texts for _ in range(group_size)]


class _Counting:
    """Records the rows of every forward step an engine's sessions take."""

    def __init__(self, engine):
        self.steps: list[int] = []
        self.by_session: list[list[int]] = []
        make = engine._session

        def session(batch):
            s = make(batch)
            step, mine = s.step, []
            self.by_session.append(mine)

            def counted(chunks):
                self.steps.append(len(chunks))
                mine.append(len(chunks))
                return step(chunks)

            s.step = counted
            return s

        engine._session = session


def _teacher_gap(model, episodes):
    gaps = []
    for ep in episodes:
        ref = sequence_logprobs(model, ep.prompt_ids + ep.tokens, len(ep.prompt_ids))
        mine = torch.tensor(ep.from_model)
        assert mine.any() and (torch.tensor(ep.logprobs)[~mine] == 0).all()
        gaps.append((ref[mine] - torch.tensor(ep.logprobs)[mine]).abs())
    return torch.cat(gaps)


def test_greedy_episodes_are_the_same_on_every_path(tiny):
    model, tok = tiny
    prompts = _groups(tok, 3)
    params = SamplingParams(temperature=0, max_turn_tokens=5, max_episode_tokens=80)
    turns = lambda i: 1 + i % 3  # noqa: E731 - rows of a group end at different turns
    paths = [("today", False, False, 0), ("split", False, True, 0), ("shared", True, True, 0),
             ("refill", True, True, 4)]  # fmt: skip
    runs = {
        label: Engine(model, tok).generate(
            prompts,
            _responders(len(prompts), turns),
            params,
            max_rows=rows,
            share_prefix=share,
            split_replies=split,
        )
        for label, share, split, rows in paths
    }
    for label in ("split", "shared", "refill"):
        for a, b in zip(runs["today"], runs[label], strict=True):
            assert a.tokens == b.tokens and a.from_model == b.from_model, label
            assert a.turns == b.turns and a.finish == b.finish
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("compact_min", [32, 0])
def test_shared_and_refilled_logprobs_equal_teacher_forcing(
    tiny, tiny_int8, compact_min, monkeypatch
):
    # Sampled episodes (row order and batch make-up differ from today's
    # path); the recorded log-probs must still be the model's own: fp32 to
    # 1e-4, int8 within the int8 engine's stated tolerance (max 0.1, mean 0.02).
    # compact_min 0: the cache is compacted whenever a quarter of it is pads.
    monkeypatch.setattr(engine_module, "_COMPACT_MIN", compact_min)
    tok = tiny[1]
    prompts = _groups(tok, 4)
    params = SamplingParams(max_turn_tokens=5, max_episode_tokens=70)
    for model, tol, mean_tol in ((tiny[0], 1e-4, 1e-4), (tiny_int8[0], 0.1, 0.02)):
        eps = Engine(model, tok).generate(
            prompts, _responders(len(prompts), lambda i: 1 + i % 3), params, seed=3, max_rows=6
        )
        gap = _teacher_gap(model, eps)
        assert gap.max() < tol and gap.mean() < mean_tol


@pytest.mark.parametrize("max_rows", [8, 6])
def test_a_group_is_prefilled_once_and_the_batch_refills(tiny, max_rows):
    model, tok = tiny
    prompts = _groups(tok, 4)  # 4 groups of 4
    params = SamplingParams(max_turn_tokens=4, max_episode_tokens=60)
    engine = Engine(model, tok)
    seen = _Counting(engine)
    # (Replies fed on their own rows would add one-step sessions of their own.)
    eps = engine.generate(prompts, _responders(16, lambda i: 1 + i % 4), params, max_rows=max_rows,
                          split_replies=False)  # fmt: skip
    assert len(eps) == 16 and all(ep.tokens for ep in eps)
    # Prefills run one row per distinct prompt, once: never 4 copies of a
    # prompt, and a group admitted in parts (6 rows: a group and a half)
    # copies its prefilled prompt instead of prefilling it again. A prefill
    # session steps once; the running batch is a copy of its rows.
    prefills = [steps for steps in seen.by_session if len(steps) == 1]
    assert seen.steps[0] == 2  # the first admission's two prompts
    assert sum(steps[0] for steps in prefills) == 4
    # Decode steps never exceed max_rows, and waiting rows joined the batch
    # still running: it ran at full width for longer than its
    # first-finishing row lived (one step a token at most), which a batch
    # that only shrinks cannot do.
    assert max(seen.steps) <= max_rows
    main = max(seen.by_session, key=len)
    assert sum(n == max_rows for n in main) > min(len(ep.tokens) for ep in eps[:max_rows])
    today = Engine(model, tok)
    base = _Counting(today)
    today.generate(prompts, _responders(16, lambda i: 1 + i % 4), params, share_prefix=False)
    assert base.steps[0] == 16  # today's path: every row prefills its own prompt


def test_a_tool_reply_is_fed_to_its_own_row_not_padded_into_every_row(tiny):
    model, tok = tiny
    long = engine_module._SPLIT_MIN
    assert len(tok.encode(REPLY, add_special_tokens=False)) >= long
    prompts = _groups(tok, 3)
    params = SamplingParams(max_turn_tokens=4, max_episode_tokens=60)
    steps = {}
    for split in (False, True):
        engine = Engine(model, tok)
        seen, make = [], engine._session

        def session(batch, make=make, seen=seen):
            s = make(batch)
            step = s.step

            def counted(chunks):
                seen.append(sorted(len(c) for c in chunks))
                return step(chunks)

            s.step = counted
            return s

        engine._session = session
        # Refilled rows run out of phase: some reach a reply while others decode.
        eps = engine.generate(prompts, _responders(12, lambda i: 1 + i % 3), params, seed=1,
                              max_rows=5, split_replies=split)  # fmt: skip
        assert sum(not m for ep in eps for m in ep.from_model) > 0  # replies were fed
        steps[split] = seen

    def mixed(lens):  # a step that pads rows fed a token to a reply's width
        return lens[0] == 1 and lens[-1] >= long

    assert any(mixed(lens) for lens in steps[False])
    assert not any(mixed(lens) for lens in steps[True])
    # The replies ran on their own rows: steps of long chunks only.
    assert any(lens[0] >= long - 1 for lens in steps[True])


def test_units_keep_groups_whole_up_to_max_rows():
    p = [[1, 2], [1, 2], [1, 2], [3, 4], [5, 6], [5, 6]]
    assert units(p, 0) == [[0, 1, 2], [3], [4, 5]]
    assert units(p, 2) == [[0, 1], [2], [3], [4, 5]]


def test_layout_extend_aligns_rows_and_trim_drops_unused_columns():
    a, b = Layout(2, torch.device("cpu")), Layout(1, torch.device("cpu"))
    a.block([[1, 2, 3], [4, 5, 6]], 0)
    b.block([[7]], 0)
    assert a.extend(b) == (0, 2)  # b's single column right-aligned under a's three
    assert a.real.tolist() == [[True] * 3, [True] * 3, [False, False, True]]
    assert a.pos.tolist() == [3, 3, 1] and a.padded
    _, _, mask = a.block([[8], [9], [10]], 0)
    assert mask[2, 0, 0].tolist() == [False, False, True, True]  # never sees the pads
    a.keep([2])
    assert a.trim() == 2 and a.real.tolist() == [[True, True]]


@pytest.mark.parametrize("bad", [-1])
def test_max_rows_must_not_be_negative(tiny, bad):
    model, tok = tiny
    with pytest.raises(ValueError, match="max_rows"):
        Engine(model, tok).generate([[1, 2]], [lambda t: None], SamplingParams(), max_rows=bad)


def _widths(monkeypatch) -> tuple[list[int], list[int]]:
    """(cache width at every step, new width at every compaction), as they happen."""
    widths, compacted = [], []
    block, compact = Layout.block, Layout.compact

    def counted_block(self, chunks, pad_id):
        out = block(self, chunks, pad_id)
        widths.append(self.real.shape[1])
        return out

    def counted_compact(self):
        index = compact(self)
        if index is not None:
            compacted.append(index.shape[1])
        return index

    monkeypatch.setattr(Layout, "block", counted_block)
    monkeypatch.setattr(Layout, "compact", counted_compact)
    return widths, compacted


def test_compaction_keeps_episodes_and_log_probs_and_narrows_the_cache(tiny, monkeypatch):
    # Tool replies pad every other row by their length, refills keep one
    # batch going: greedy episodes with and without compaction are the same
    # tokens with the same log-probs (fp32), on a narrower cache.
    model, tok = tiny
    prompts = _groups(tok, 3)
    params = SamplingParams(temperature=0, max_turn_tokens=5, max_episode_tokens=120)
    widths, compacted = _widths(monkeypatch)

    def run(compact_min):
        monkeypatch.setattr(engine_module, "_COMPACT_MIN", compact_min)
        widths.clear(), compacted.clear()
        eps = Engine(model, tok).generate(
            prompts, _responders(len(prompts), lambda i: 1 + i % 4), params, max_rows=5
        )
        return eps, max(widths), len(compacted)

    plain, plain_width, none = run(10**9)
    eps, width, times = run(0)
    assert none == 0 and times > 0 and width < plain_width
    for a, b in zip(plain, eps, strict=True):
        assert a.tokens == b.tokens and a.from_model == b.from_model and a.finish == b.finish
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


def test_layout_compact_right_aligns_each_rows_real_columns_in_order(monkeypatch):
    lay = Layout(2, torch.device("cpu"))
    t, f = True, False
    lay.real = torch.tensor([[t, f, f, t, t, f, t], [f, f, f, f, t, f, t]])
    lay.padded = True
    assert lay.compact() is None  # 3 pad columns of 7: below the 32-column floor
    monkeypatch.setattr(engine_module, "_COMPACT_MIN", 0)
    index = lay.compact()
    assert index.tolist() == [[0, 3, 4, 6], [3, 5, 4, 6]]
    assert lay.real.tolist() == [[t, t, t, t], [f, f, t, t]] and lay.padded
    assert lay.compact() is None  # nothing more to drop
    lay.real = torch.tensor([[t, f, t], [t, t, f]])
    assert lay.compact().tolist() == [[0, 2], [0, 1]] and not lay.padded  # back to dense


def test_cache_layer_grows_in_place_and_holds_what_concatenation_would():
    layer = engine_module._growing_layer()()
    ref_k = ref_v = None
    gen = torch.Generator().manual_seed(0)

    def add(width, batch=3):
        nonlocal ref_k, ref_v
        k = torch.randn(batch, 2, width, 4, generator=gen)
        v = torch.randn(batch, 2, width, 4, generator=gen)
        ref_k = k if ref_k is None else torch.cat([ref_k, k], dim=2)
        ref_v = v if ref_v is None else torch.cat([ref_v, v], dim=2)
        keys, values = layer.update(k, v)
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
        assert layer.get_seq_length() == ref_k.shape[2]

    add(7)
    buffer = layer.keys.data_ptr()
    add(1)
    assert layer.keys.data_ptr() == buffer  # written in place, nothing copied
    for _ in range(3 * engine_module._ROOM):  # past the room: the buffer grows
        add(1)
    add(50)
    layer.batch_select_indices(torch.tensor([2, 0, 0]))
    ref_k, ref_v = ref_k[[2, 0, 0]], ref_v[[2, 0, 0]]
    add(1)
    layer.drop_front(5)
    ref_k, ref_v = ref_k[:, :, 5:], ref_v[:, :, 5:]
    add(2)
    index = torch.tensor([[0, 3, 9], [1, 2, 3], [4, 5, 6]])
    layer.gather(index)
    at = index[:, None, :, None].expand(-1, 2, -1, 4)
    ref_k, ref_v = ref_k.gather(2, at), ref_v.gather(2, at)
    add(1)
    other = torch.randn(3, 2, 4, 4, generator=gen)
    layer.assign(other, other + 1)
    ref_k, ref_v = other, other + 1
    add(3)
