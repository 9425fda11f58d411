"""The endpoint against the engine it serves, through the standard `openai` client.

On each backend (torch int8, MLX int8): greedy episodes from the endpoint
are the engine's own, a seed's choices are `generate`'s rows of that seed,
concurrent requests share the running batch and still get the tokens they
get alone, and every returned log-prob is within the backend's tolerance
of a teacher-forced pass. Then what a client gets wrong: OpenAI's error
shape, with the status the client raises on.
"""

from __future__ import annotations

import http.client
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from colonnade.engine import Engine, SamplingParams, engine_for
from colonnade.engine.session import Session
from colonnade.model import int8_state, load_model, sequence_logprobs
from colonnade.protocol.turns import chat_prompt
from colonnade.serve import Bounds, Served, Server

openai = pytest.importorskip("openai")
CPU = torch.device("cpu")
TOKENS = 24
QUESTIONS = ["gene GX3", "the quick brown fox", "<answer>", "GX41 binds to PRT"]


@dataclass
class Backend:
    engine: Engine
    teacher: object  # (ids, start) -> log-probs [len(ids) - start]
    tol: float  # max |returned - teacher|
    mean_tol: float


def _torch_int8(tiny_dir) -> Backend:
    model, tok = load_model(tiny_dir)
    engine = engine_for(model, tok, int8_state(model), "int8", CPU, "torch", version=4)
    net = engine.backend.model
    return Backend(engine, lambda ids, start: sequence_logprobs(net, ids, start), 0.1, 0.02)


def _mlx_int8(tiny_dir) -> Backend:
    from colonnade.engine.mlx_backend import mlx_missing

    if reason := mlx_missing():
        pytest.skip(reason)
    model, tok = load_model(tiny_dir)
    engine = engine_for(model, tok, int8_state(model), "int8", CPU, "mlx", version=4)
    return Backend(engine, engine.backend.model.sequence_logprobs, 1e-4, 1e-4)


@pytest.fixture(scope="module", params=["torch-int8", "mlx-int8"])
def backend(request, tiny_dir) -> Backend:
    return {"torch-int8": _torch_int8, "mlx-int8": _mlx_int8}[request.param](tiny_dir)


def _served(temperature: float) -> Served:
    return Served("tiny", SamplingParams(temperature=temperature), Bounds(max_tokens=64))


def _client(server: Server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _limits(temperature: float, max_tokens: int = TOKENS, **more) -> SamplingParams:
    """What a request of `max_tokens` runs with (`serve.requests`)."""
    return SamplingParams(temperature=temperature, max_turn_tokens=max_tokens + 1,
                          max_episode_tokens=max_tokens, **more)  # fmt: skip


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def _alone(engine: Engine, prompt, params, **kw):
    return engine.generate([prompt], [lambda t: None], params, **kw)[0]


def test_greedy_chat_episodes_are_the_engines_own(backend):
    engine, tok = backend.engine, backend.engine.tokenizer
    params = _limits(0.0)
    expected = [_alone(engine, chat_prompt(tok, _chat(q)), params) for q in QUESTIONS]
    with Server(engine, _served(0.0), port=0) as server:
        client = _client(server)
        ask = dict(model="tiny", max_tokens=TOKENS, logprobs=True, temperature=0,
                   extra_body={"return_token_ids": True})  # fmt: skip
        got = [client.chat.completions.create(messages=_chat(q), **ask) for q in QUESTIONS]
    for q, r, ep in zip(QUESTIONS, got, expected, strict=True):
        choice = r.choices[0]
        assert r.prompt_token_ids == chat_prompt(tok, _chat(q)) == ep.prompt_ids
        assert choice.token_ids == ep.tokens
        assert choice.message.content == tok.decode(ep.tokens, skip_special_tokens=True)
        assert choice.finish_reason == {"eos": "stop", "length": "length"}[ep.finish]
        returned = [t.logprob for t in choice.logprobs.content]
        assert returned == pytest.approx(ep.logprobs, abs=1e-5)
        assert [t.token for t in choice.logprobs.content] == [tok.decode([t]) for t in ep.tokens]
        assert r.usage.completion_tokens == len(ep.tokens)
        assert r.usage.prompt_tokens == len(ep.prompt_ids)


def test_a_seeds_choices_are_generates_rows_of_that_seed(backend):
    engine, tok = backend.engine, backend.engine.tokenizer
    prompt = tok.encode("<search>gene GX3", add_special_tokens=False)
    expected = engine.generate([prompt] * 3, [lambda t: None] * 3, _limits(1.0), seed=5)
    with Server(engine, _served(1.0), port=0) as server:
        client = _client(server)
        ask = dict(model="tiny", prompt=prompt, max_tokens=TOKENS, n=3, seed=5, logprobs=0,
                   extra_body={"return_token_ids": True})  # fmt: skip
        first, again = client.completions.create(**ask), client.completions.create(**ask)
    for choice, ep in zip(first.choices, expected, strict=True):
        assert choice.prompt_token_ids == prompt and choice.token_ids == ep.tokens
        assert choice.logprobs.token_logprobs == pytest.approx(ep.logprobs, abs=1e-5)
        assert choice.text == tok.decode(ep.tokens, skip_special_tokens=True)
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in first.choices]
    assert len({tuple(c.token_ids) for c in first.choices}) > 1  # three draws, not one


def _questions(n: int) -> list[str]:
    return [f"{QUESTIONS[i % 4]} {i}" for i in range(n)]


def _concurrently(server: Server, questions: list[str], **ask) -> list:
    client = _client(server)

    def one(q):
        return client.chat.completions.create(
            model="tiny", messages=_chat(q), max_tokens=TOKENS,
            extra_body={"return_token_ids": True}, **ask,
        )  # fmt: skip

    with ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(one, questions))


class _Widths:
    """The rows of every step the engine runs (its own thread included)."""

    def __init__(self, monkeypatch):
        self.seen: list[int] = []
        step = Session.step
        monkeypatch.setattr(Session, "step", lambda s, c: self.seen.append(len(c)) or step(s, c))


def test_concurrent_requests_share_the_batch_and_get_their_episodes_alone(backend, monkeypatch):
    engine, tok = backend.engine, backend.engine.tokenizer
    questions = _questions(16)
    params = _limits(0.0)
    expected = [_alone(engine, chat_prompt(tok, _chat(q)), params) for q in questions]
    widths = _Widths(monkeypatch)
    with Server(engine, _served(0.0), max_rows=16, port=0) as server:
        got = _concurrently(server, questions)
    assert max(widths.seen) > 4  # requests ran side by side in one batch
    for r, ep in zip(got, expected, strict=True):
        assert r.choices[0].token_ids == ep.tokens


def test_returned_logprobs_are_the_teacher_forced_ones(backend):
    # Sampled at the server's temperature, 16 at once: μ as the trainer
    # recomputes it from the token ids alone.
    with Server(backend.engine, _served(1.0), max_rows=16, port=0) as server:
        got = _concurrently(server, _questions(16), logprobs=True)
    gaps = []
    for r in got:
        prompt, tokens = r.prompt_token_ids, r.choices[0].token_ids
        ref = backend.teacher(prompt + tokens, len(prompt))
        mine = torch.tensor([t.logprob for t in r.choices[0].logprobs.content])
        gaps.append((ref - mine).abs())
    gap = torch.cat(gaps)
    assert len(gap) > 16 and gap.max() < backend.tol and gap.mean() < backend.mean_tol


@pytest.fixture(scope="module")
def torch_engine(tiny_dir) -> Engine:
    return _torch_int8(tiny_dir).engine


def test_a_stop_string_ends_the_choice_and_is_left_out_of_its_text(torch_engine):
    tok = torch_engine.tokenizer
    prompt = tok.encode("<search>gene GX3", add_special_tokens=False)
    free = _alone(torch_engine, prompt, _limits(1.0, 40), seed=3)
    stop = tok.decode(free.tokens, skip_special_tokens=True)[10:12]  # what it would sample
    assert len(stop.strip()) == 2
    ep = _alone(torch_engine, prompt, _limits(1.0, 40, stop=(stop,)), seed=3)
    assert ep.finish == "done" and len(ep.tokens) < len(free.tokens)  # the stop ended it
    with Server(torch_engine, _served(1.0), port=0) as server:
        r = _client(server).completions.create(
            model="tiny", prompt=prompt, max_tokens=40, stop=[stop], seed=3,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
    choice = r.choices[0]
    full = tok.decode(ep.tokens, skip_special_tokens=True)
    assert choice.token_ids == ep.tokens and choice.finish_reason == "stop"
    assert choice.text == full[: full.index(stop)]


def test_models_lists_the_served_name(torch_engine):
    with Server(torch_engine, _served(1.0), port=0) as server:
        assert [m.id for m in _client(server).models.list()] == ["tiny"]


def test_the_client_sees_refusals_in_openais_shape(torch_engine):
    with Server(torch_engine, _served(1.0), port=0) as server:
        client = _client(server)
        with pytest.raises(openai.BadRequestError, match="temperature is the server's") as e:
            client.chat.completions.create(model="tiny", messages=_chat("x"), temperature=0.2)
        assert e.value.body["param"] == "temperature"
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.chat.completions.create(model="gpt-4o", messages=_chat("x"))
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.completions.create(model="tiny", prompt="x", max_tokens=65)
        assert _post(server, "/v1/completions", b"{not json")[0] == 400
        assert _post(server, "/v1/completions", b"[" * 40 + b"]" * 40)[0] == 400
        status, body = _post(server, "/v1/embeddings", b"{}")
        assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
        # Refused on its Content-Length, before a byte of the body is read.
        assert _post(server, "/v1/completions", b"", length=(4 << 20) + 1)[0] == 413
        assert _post(server, "/v1/completions", b"", length=None)[0] == 411


def _post(server: Server, path: str, data: bytes, length: int | None = -1) -> tuple[int, dict]:
    """(status, JSON body) of a POST; `length`: the Content-Length sent (-1:
    the body's, None: none)."""
    host, port = server.endpoint.httpd.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.putrequest("POST", path)
        if length is not None:
            conn.putheader("Content-Length", str(len(data) if length == -1 else length))
        conn.endheaders(data or None)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_an_engine_failure_fails_its_requests_and_the_server_goes_on(torch_engine, monkeypatch):
    step, failures = Session.step, [RuntimeError("the backend broke")]

    def flaky(session, chunks):
        if failures:
            raise failures.pop()
        return step(session, chunks)

    monkeypatch.setattr(Session, "step", flaky)
    with Server(torch_engine, _served(0.0), port=0) as server:
        client = _client(server)
        with pytest.raises(openai.InternalServerError, match="RuntimeError"):
            client.completions.create(model="tiny", prompt="gene", max_tokens=4)
        r = client.completions.create(model="tiny", prompt="gene", max_tokens=4)
    expected = _alone(torch_engine, torch_engine.tokenizer.encode("gene"), _limits(0.0, 4))
    assert r.choices[0].text == torch_engine.tokenizer.decode(expected.tokens,
                                                              skip_special_tokens=True)  # fmt: skip
