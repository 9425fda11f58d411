"""The torch backend's compiled step: the eager step's episodes, one graph for
every shape, eager again wherever the compiler fails, and `auto` measured
once per machine and model. (The backend suite runs it too, as a case.)"""

import json

import pytest
import torch

from colonnade.engine import Engine, SamplingParams, engine_for, refresh, torch_compile
from colonnade.engine.torch_backend import TorchBackend
from colonnade.model import int8_state, load_model

REPLY = " <information>GX3 binds to PRT21 in the liver.</information> "
CPU = torch.device("cpu")

pytestmark = pytest.mark.slow  # compiles a model (tens of seconds on 2 cores)


@pytest.fixture(scope="module")
def engines(tiny_dir):
    """(eager int8 engine, compiled engine over the same model)."""
    model, tok = load_model(tiny_dir)
    eager = engine_for(model, tok, int8_state(model), "int8", CPU, "torch")
    b = eager.backend
    compiled = Engine(TorchBackend(b.model, b.precision, b.aliases, compile="on"), tok)
    assert compiled.backend.prepare() and compiled.backend.compiled
    return eager, compiled


def _responders(n):
    def replies(turns):
        seen = []
        return lambda text: seen.append(text) or (None if len(seen) >= turns else REPLY)

    return [replies(1 + i % 3) for i in range(n)]


def test_compiled_episodes_equal_eager_ones_on_every_path(engines):
    # Multi-turn rows of different lengths, refilled, sharing prefills and
    # fed replies on their own rows: padded masks, prefills, decode steps.
    eager, compiled = engines
    tok = eager.tokenizer
    texts = ["<search>gene GX3", "the quick brown fox", "<answer>", "GX41 binds to PRT"]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts for _ in range(3)]
    params = SamplingParams(temperature=0, max_turn_tokens=5, max_episode_tokens=80)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for max_rows in (0, 5):
        want = eager.generate(prompts, _responders(12), params, max_rows=max_rows)
        got = compiled.generate(prompts, _responders(12), params, max_rows=max_rows)
        assert sum(not m for ep in got for m in ep.from_model) > 0  # replies were fed
        for a, b in zip(want, got, strict=True):
            assert a.tokens == b.tokens and a.from_model == b.from_model and a.turns == b.turns
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-2
    # Every batch size, block width and cache width ran on the graph compiled
    # when the backend was prepared.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert compiled.backend.compiled


def test_a_newer_state_reaches_the_compiled_step(engines, tiny_dir):
    # A patch rewrites weights in place (codes, norms, embeddings): the graph
    # reads them as they are at each call, nothing is compiled again.
    eager, compiled = engines
    tok = eager.tokenizer
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("<answer>", "GX41 binds")]
    params = SamplingParams(temperature=0, max_turn_tokens=12, max_episode_tokens=12)
    before = compiled.generate(prompts, [lambda t: None] * 2, params)
    newer, _ = load_model(tiny_dir)
    with torch.no_grad():
        for p in newer.parameters():
            p.mul_(-1.5)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    try:
        refresh(compiled, int8_state(newer), None, version=1)
        got = compiled.generate(prompts, [lambda t: None] * 2, params)
        want = eager.generate(prompts, [lambda t: None] * 2, params)
    finally:
        original, _ = load_model(tiny_dir)
        refresh(compiled, int8_state(original), None, version=0)
    assert [e.tokens for e in got] == [e.tokens for e in want]
    assert [e.tokens for e in got] != [e.tokens for e in before]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_auto_measures_the_step_both_ways(engines):
    _, compiled = engines
    backend = compiled.backend
    timings = torch_compile.measure(backend, backend._step)
    want = {f"{k}@{r}" for r in torch_compile.ROWS for k in ("eager", "compiled")}
    assert set(timings) == want and all(t > 0 for t in timings.values())


def test_auto_keeps_the_measured_choice_per_machine_and_model(engines, tmp_path, monkeypatch):
    monkeypatch.setenv("COLONNADE_CACHE", str(tmp_path))
    eager, _ = engines
    b = eager.backend
    measured = []

    def measure(backend, step, compiled_ms=2.0):
        measured.append(torch_compile.signature(backend))
        return {f"{k}@{r}": (compiled_ms if k == "compiled" else 1.0) * 1e-3
                for r in torch_compile.ROWS for k in ("eager", "compiled")}  # fmt: skip

    monkeypatch.setattr(torch_compile, "measure", measure)
    slower = TorchBackend(b.model, b.precision, b.aliases, compile="auto")
    assert not slower.prepare() and not slower.compiled
    doc = json.loads(torch_compile.choices_path().read_text())
    key = torch_compile.signature(b)
    assert doc["choices"] == {key: "eager"} and doc["timings_ms"][key]["compiled@1"] == 2.0
    # Another backend of the same model on this machine reads the choice.
    again = TorchBackend(b.model, b.precision, b.aliases, compile="auto")
    assert not again.prepare() and measured == [key]
    # Where compiled measured faster, steps run compiled.
    path = torch_compile.choices_path()
    path.write_text(json.dumps({**doc, "choices": {key: "compiled"}}))
    faster = TorchBackend(b.model, b.precision, b.aliases, compile="auto")
    assert faster.prepare() and faster.compiled and measured == [key]


def test_a_model_the_compiler_cannot_take_steps_eagerly_with_one_log_line(
    engines, monkeypatch, caplog
):
    eager, _ = engines
    b = eager.backend

    def unsupported(*args, **kwargs):
        raise NotImplementedError("softcap")

    monkeypatch.setattr(torch_compile, "_attention", unsupported)
    backend = TorchBackend(b.model, b.precision, b.aliases, compile="on")
    with caplog.at_level("WARNING", logger="colonnade.engine"):
        assert not backend.prepare()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "colonnade.engine"]
    assert "stepping eagerly" in line and "softcap" in line
    prompts = [eager.tokenizer.encode("the quick brown fox", add_special_tokens=False)]
    params = SamplingParams(temperature=0, max_turn_tokens=8, max_episode_tokens=8)
    want = eager.generate(prompts, [lambda t: None], params)
    got = Engine(backend, eager.tokenizer).generate(prompts, [lambda t: None], params)
    assert got[0].tokens == want[0].tokens and got[0].logprobs == want[0].logprobs


def test_a_compiler_failure_at_a_later_step_steps_eagerly_from_then_on(
    engines, monkeypatch, caplog
):
    eager, compiled = engines
    b = eager.backend
    backend = TorchBackend(b.model, b.precision, b.aliases, compile="on")
    backend._step, backend._prepared = compiled.backend._step, True  # already compiled
    calls = []

    def fails(*args):
        calls.append(args)
        raise torch._dynamo.exc.TorchDynamoException("recompiling failed")

    monkeypatch.setattr(backend._step, "fn", fails)
    prompts = [eager.tokenizer.encode("<answer>", add_special_tokens=False)]
    params = SamplingParams(temperature=0, max_turn_tokens=8, max_episode_tokens=8)
    with caplog.at_level("WARNING", logger="colonnade.engine"):
        got = Engine(backend, eager.tokenizer).generate(prompts, [lambda t: None], params)
    assert len(calls) == 1 and not backend.compiled  # tried once, then eager
    assert [r.getMessage() for r in caplog.records if "stepping eagerly" in r.getMessage()]
    assert got[0].tokens == eager.generate(prompts, [lambda t: None], params)[0].tokens


def test_the_mode_is_the_argument_else_the_environment_else_off(monkeypatch):
    monkeypatch.delenv(torch_compile.MODE_ENV, raising=False)
    assert torch_compile.mode_from(None) == "off"
    monkeypatch.setenv(torch_compile.MODE_ENV, "auto")
    assert torch_compile.mode_from(None) == "auto"
    assert torch_compile.mode_from("on") == "on"
    with pytest.raises(ValueError, match="choose one of"):
        torch_compile.mode_from("sometimes")
