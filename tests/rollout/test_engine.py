import torch

from colonnade.model import sequence_logprobs
from colonnade.protocol.turns import StopMatcher
from colonnade.rollout import Engine, SamplingParams

REPLY = " <information>GX3 binds to PRT21 in the liver.</information> "


def _replies(n_turns):
    def make():
        seen = []

        def respond(text):
            seen.append(text)
            return None if len(seen) >= n_turns else REPLY

        return respond

    return make


def _prompts(tok):
    texts = ["<search>gene GX3", "the quick brown fox", "<answer>", "GX41 binds to PRT"]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def _check_against_teacher_forcing(model, episodes, tol, mean_tol=None):
    diffs = []
    for ep in episodes:
        ref = sequence_logprobs(model, ep.prompt_ids + ep.tokens, len(ep.prompt_ids))
        got = torch.tensor(ep.logprobs)
        mine = torch.tensor(ep.from_model)
        assert mine.any() and (got[~mine] == 0).all()
        diffs.append((ref[mine] - got[mine]).abs())
    diffs = torch.cat(diffs)
    assert diffs.max() < tol
    if mean_tol is not None:
        assert diffs.mean() < mean_tol


def test_multi_turn_logprobs_equal_a_full_recompute_fp32(tiny):
    # The teacher-forced pass recomputes prompt, model turns and replies from
    # scratch; the engine extended one KV cache across turns, with padding.
    model, tok = tiny
    params = SamplingParams(max_turn_tokens=6, max_episode_tokens=120)
    eps = Engine(model, tok).generate(_prompts(tok), [_replies(3)() for _ in range(4)], params)
    assert all(ep.finish == "done" and len(ep.turns) == 3 for ep in eps)
    assert all(sum(not m for m in ep.from_model) > 0 for ep in eps)
    _check_against_teacher_forcing(model, eps, tol=1e-4)


def test_int8_logprobs_equal_teacher_forcing_of_the_int8_model(tiny_int8, tiny):
    # fbgemm quantizes activations with one scale per call (the whole
    # [B, W] block), so what shares a step moves a log-prob slightly. Stated
    # tolerance: max 0.1 nats, mean 0.02 (measured: max 0.04, mean 0.012).
    model, _ = tiny_int8
    tok = tiny[1]
    params = SamplingParams(max_turn_tokens=5, max_episode_tokens=60)
    eps = Engine(model, tok).generate(_prompts(tok), [_replies(2)() for _ in range(4)], params)
    _check_against_teacher_forcing(model, eps, tol=0.1, mean_tol=0.02)


def test_episodes_in_a_batch_match_episodes_run_alone(tiny):
    model, tok = tiny
    engine = Engine(model, tok)
    # Different budgets make rows leave the batch at different steps.
    params = SamplingParams(temperature=0, max_turn_tokens=4, max_episode_tokens=40)
    prompts = _prompts(tok)
    together = engine.generate(prompts, [_replies(k + 1)() for k in range(4)], params)
    alone = [engine.generate([p], [_replies(k + 1)()], params)[0] for k, p in enumerate(prompts)]
    assert len({len(e.tokens) for e in together}) > 1  # rows left at different steps
    for a, b in zip(together, alone, strict=True):
        assert a.tokens == b.tokens and a.from_model == b.from_model
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


def test_same_seed_same_episodes_and_version_recorded(tiny):
    model, tok = tiny
    engine = Engine(model, tok, version=7)
    params = SamplingParams(max_turn_tokens=8, max_episode_tokens=30)
    a = engine.generate(_prompts(tok), [_replies(2)() for _ in range(4)], params, seed=3)
    b = engine.generate(_prompts(tok), [_replies(2)() for _ in range(4)], params, seed=3)
    c = engine.generate(_prompts(tok), [_replies(2)() for _ in range(4)], params, seed=4)
    assert [e.tokens for e in a] == [e.tokens for e in b]
    assert [e.tokens for e in a] != [e.tokens for e in c]
    assert {e.version for e in a} == {7}


def test_episode_token_budget_is_respected(tiny):
    model, tok = tiny
    params = SamplingParams(max_turn_tokens=1000, max_episode_tokens=25)
    eps = Engine(model, tok).generate(_prompts(tok), [_replies(5)() for _ in range(4)], params)
    for ep in eps:
        assert len(ep.tokens) <= 25
        assert ep.finish in {"length", "eos"}


def test_stop_string_split_across_tokens_ends_the_turn(tiny):
    model, tok = tiny
    engine = Engine(model, tok)
    free = SamplingParams(max_turn_tokens=40, max_episode_tokens=40)
    prompts = _prompts(tok)[:1]
    ep = engine.generate(prompts, [lambda t: None], free, seed=5)[0]
    # Choose a stop string that straddles two token boundaries: the end of
    # one token, the whole next one, the start of the one after (tokens that
    # decode alone to printable text, not to part of a UTF-8 character).
    pieces = [tok.decode([t]) for t in ep.tokens]
    j = next(
        j
        for j in range(4, len(pieces) - 1)
        if all(p and p.isascii() and p.isprintable() for p in pieces[j - 1 : j + 2])
    )
    stop = pieces[j - 1][-1:] + pieces[j] + pieces[j + 1][:1]
    assert len(stop) >= 3
    seen = []
    stopped = engine.generate(
        prompts,
        [lambda t: seen.append(t)],
        SamplingParams(max_turn_tokens=40, max_episode_tokens=40, stop=(stop,)),
        seed=5,
    )[0]
    first = tok.decode(ep.tokens).find(stop)
    n_tokens = next(i for i in range(1, 41) if stop in tok.decode(ep.tokens[:i]))
    assert stopped.tokens == ep.tokens[:n_tokens]
    assert seen == [tok.decode(ep.tokens)[: first + len(stop)]]
    assert stopped.finish == "done"


def test_stop_matcher_sees_pieces(tiny):
    _, tok = tiny
    head = tok.encode("</se", add_special_tokens=False)
    ids = head + tok.encode("arch> x", add_special_tokens=False)
    m = StopMatcher(tok, ["</search>"])
    hits = [m.hit(ids[: i + 1]) for i in range(len(ids))]
    assert True in hits and not any(hits[: len(head)])
    assert m.cut("a</search> tail</search>") == "a</search>"
