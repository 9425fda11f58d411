"""The MLX engine keeps the torch engine's contract: same records, same rules."""

import pytest
import torch

from colonnade.model import int8_state, load_int8, load_model, tied_aliases
from colonnade.rollout import Engine, SamplingParams
from rollout.test_engine import _prompts, _replies


@pytest.fixture(scope="module")
def engines(mlx_ready, tiny_dir):
    """(MLX int8 engine, torch int8 engine) over the same published codes."""
    from colonnade.rollout.mlx_engine import MlxEngine

    model, tok = load_model(tiny_dir)
    aliases = tied_aliases(model)
    state = int8_state(model)
    mlx = MlxEngine.from_state(model, tok, state, "int8", version=3)
    return mlx, Engine(load_int8(model, state, aliases), tok, 3)


def test_multi_turn_logprobs_equal_a_teacher_forced_mlx_pass(engines):
    mlx, _ = engines
    tok = mlx.tokenizer
    params = SamplingParams(max_turn_tokens=6, max_episode_tokens=120)
    eps = mlx.generate(_prompts(tok), [_replies(3)() for _ in range(4)], params, seed=1)
    assert all(ep.finish == "done" and len(ep.turns) == 3 and ep.version == 3 for ep in eps)
    diffs = []
    for ep in eps:
        ref = mlx.model.sequence_logprobs(ep.prompt_ids + ep.tokens, len(ep.prompt_ids))
        mine = torch.tensor(ep.from_model)
        got = torch.tensor(ep.logprobs)
        assert (~mine).any() and (got[~mine] == 0).all()  # env tokens: masked, no log-prob
        diffs.append((ref[mine] - got[mine]).abs())
    assert torch.cat(diffs).max() < 1e-4


# Two engines that differ only in rounding may pick different greedy tokens
# where the best two are this close; anywhere else they must agree.
NEAR_TIE = 0.05


def test_greedy_mlx_and_torch_episodes_agree_and_logprobs_are_close(engines):
    # The cross-engine mismatch the DPPO gate must absorb: same int8 codes,
    # the torch kernel rounds activations to bf16, MLX keeps float32.
    mlx, torch_engine = engines
    tok = mlx.tokenizer
    params = SamplingParams(temperature=0, max_turn_tokens=5, max_episode_tokens=60)
    a = mlx.generate(_prompts(tok), [_replies(2)() for _ in range(4)], params)
    b = torch_engine.generate(_prompts(tok), [_replies(2)() for _ in range(4)], params)
    agreed = 0
    for x, y in zip(a, b, strict=True):
        ids = x.prompt_ids + x.tokens
        with torch.no_grad():
            logits = torch_engine.model(input_ids=torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits[len(x.prompt_ids) - 1 : -1], -1)
        mine = torch.tensor(x.from_model)
        chosen = lp.gather(-1, torch.tensor(x.tokens)[:, None]).squeeze(-1)
        # Every greedy MLX token is torch's greedy token or a near tie of it.
        assert (lp.max(-1).values - chosen)[mine].max() < NEAR_TIE
        assert (chosen[mine] - torch.tensor(x.logprobs)[mine]).abs().max() < 0.05
        agreed += x.tokens == y.tokens and x.turns == y.turns
    assert agreed >= 1  # and whole episodes come out the same where no tie is met


def test_batch_rows_match_rows_run_alone(engines):
    mlx, _ = engines
    params = SamplingParams(temperature=0, max_turn_tokens=4, max_episode_tokens=40)
    prompts = _prompts(mlx.tokenizer)
    together = mlx.generate(prompts, [_replies(k + 1)() for k in range(4)], params)
    alone = [mlx.generate([p], [_replies(k + 1)()], params)[0] for k, p in enumerate(prompts)]
    assert len({len(e.tokens) for e in together}) > 1  # rows left at different steps
    for x, y in zip(together, alone, strict=True):
        assert x.tokens == y.tokens
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4)


def test_stop_strings_and_budgets_hold(engines):
    mlx, _ = engines
    params = SamplingParams(max_turn_tokens=50, max_episode_tokens=30, stop=("</search>",))
    eps = mlx.generate(_prompts(mlx.tokenizer), [_replies(5)() for _ in range(4)], params)
    for ep in eps:
        assert len(ep.tokens) <= 30 and ep.finish in {"done", "eos", "length"}
        assert all("</search>" not in t[: -len("</search>")] for t in ep.turns)


def test_shared_prefix_and_refill_keep_mlx_log_probs(engines, monkeypatch):
    # The MLX session takes joining groups too (left-padded caches): what
    # it records is still the teacher-forced MLX pass, within 1e-4.
    from rollout.test_continuous import _groups, _responders

    mlx, _ = engines
    tok = mlx.tokenizer
    prompts = _groups(tok, 3)
    params = SamplingParams(max_turn_tokens=5, max_episode_tokens=60)
    placed = _placements(monkeypatch)
    from colonnade.rollout.mlx_engine import _MlxSession

    fed, feed = [], _MlxSession.feed
    monkeypatch.setattr(
        _MlxSession, "feed", lambda s, rows, c: fed.append(rows) or feed(s, rows, c)
    )
    eps = mlx.generate(
        prompts, _responders(len(prompts), lambda i: 1 + i % 3), params, seed=2, max_rows=4
    )
    # The refills went through `place` (rows written into ended rows in
    # place), not only through re-joining the cache; tool replies reaching
    # rows out of phase with the others were fed to their own rows (`feed`).
    assert any(ok and theirs for ok, theirs in placed)
    assert fed
    diffs = []
    for ep in eps:
        ref = mlx.model.sequence_logprobs(ep.prompt_ids + ep.tokens, len(ep.prompt_ids))
        mine = torch.tensor(ep.from_model)
        diffs.append((ref[mine] - torch.tensor(ep.logprobs)[mine]).abs())
    assert torch.cat(diffs).max() < 1e-4


def _placements(monkeypatch) -> list[tuple[bool, int]]:
    """(what `place` returned, columns placed) for every MLX `place` call."""
    from colonnade.rollout.mlx_engine import _MlxSession

    calls, place = [], _MlxSession.place

    def recorded(self, slots, other):
        ok = place(self, slots, other)
        calls.append((ok, other.layout.real.shape[1]))
        return ok

    monkeypatch.setattr(_MlxSession, "place", recorded)
    return calls


def _alone(mlx, *chunks):
    """Next-token logits [V] of one row fed these chunks in order, in a session of its own."""
    session = mlx._session(1)
    for chunk in chunks:
        logits = session.step([list(chunk)])
    return logits[0]


def test_mlx_sessions_copy_rows_and_write_them_in_place(engines):
    from colonnade.rollout.engine import Reusing

    mlx, _ = engines
    a, b, c = _prompts(mlx.tokenizer)[:3]
    assert len({len(a), len(b), len(c)}) == 3  # rows padded inside the cache
    session = mlx._session(3)
    assert isinstance(session, Reusing)
    session.step([a, b, c])
    session.step([[7], [8], [9]])
    # Copies (a row twice): each goes on as the row it was copied from.
    copy = session.take([2, 0, 2])
    got = copy.step([[5], [6], [5]])
    assert torch.allclose(got[0], _alone(mlx, c, [9], [5]), atol=1e-4)
    assert torch.allclose(got[1], _alone(mlx, a, [7], [6]), atol=1e-4)
    assert torch.equal(got[0], got[2])
    # Another session's row written over rows 0 and 2, right-aligned on
    # this session's wider cache: those rows are now that prompt's; row 1 goes on.
    other = mlx._session(1)
    other.step([b[:-1]])
    assert session.place([0, 2], other.take([0, 0]))
    got = session.step([[b[-1]], [4], [b[-1]]])
    assert torch.allclose(got[0], _alone(mlx, b[:-1], b[-1:]), atol=1e-4)
    assert torch.equal(got[0], got[2])
    assert torch.allclose(got[1], _alone(mlx, b, [8], [4]), atol=1e-4)
    # The copy taken before kept its own rows.
    assert torch.allclose(copy.step([[3]] * 3)[1], _alone(mlx, a, [7], [6], [3]), atol=1e-4)
    # Rows with more columns than the session holds do not fit: nothing done.
    width = other.layout.real.shape[1]
    assert not other.place([0], session.take([1]))
    assert other.layout.real.shape[1] == width


@pytest.mark.parametrize("max_rows", [8, 6])
def test_an_mlx_group_is_prefilled_once_and_the_batch_refills(engines, max_rows, monkeypatch):
    # The torch test (test_continuous) on the MLX engine: a group's prompt
    # is prefilled once, its rows copies of it, and rows that free up are
    # refilled in place.
    from colonnade.rollout.mlx_engine import MlxEngine
    from rollout.test_continuous import _Counting, _groups, _responders

    mlx, _ = engines
    tok = mlx.tokenizer
    engine = MlxEngine(mlx.model, tok, mlx.version)  # the shared engine stays unwrapped
    prompts = _groups(tok, 4)  # 4 groups of 4
    params = SamplingParams(max_turn_tokens=4, max_episode_tokens=60)
    seen = _Counting(engine)
    placed = _placements(monkeypatch)
    # (Replies fed on their own rows would add one-step sessions of their own.)
    eps = engine.generate(prompts, _responders(16, lambda i: 1 + i % 4), params, max_rows=max_rows,
                          split_replies=False)  # fmt: skip
    assert len(eps) == 16 and all(ep.tokens for ep in eps)
    # One prefill row per distinct prompt, once (6 rows: the second group
    # is admitted in parts and its later rows copy the kept prefix).
    prefills = [steps for steps in seen.by_session if len(steps) == 1]
    assert seen.steps[0] == 2
    assert sum(steps[0] for steps in prefills) == 4
    assert max(seen.steps) <= max_rows
    main = max(seen.by_session, key=len)
    assert sum(n == max_rows for n in main) > min(len(ep.tokens) for ep in eps[:max_rows])
    assert any(ok and theirs for ok, theirs in placed)
