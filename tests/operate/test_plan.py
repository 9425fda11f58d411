"""`colonnade plan`: the counts against models instantiated for real, the
arithmetic on a hand-computed case, the shapes against their published
sizes, and the command's edges."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from colonnade.cli.main import main
from colonnade.model.int8 import Int8Linear, int8_state, load_int8, tied_aliases
from colonnade.model.loading import cache_root
from colonnade.model.presets import build_tiny
from colonnade.model.shapes import QWEN3, model_config, shape_config, tiny_config
from colonnade.operate import plan
from colonnade.operate.plan import Counts, Setting
from colonnade.train.demand import LEASE_FACTOR, MAX_LEASE_FACTOR


def _real(config) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("tied", [True, False])
def test_counts_on_meta_are_those_of_the_real_model(tied):
    config = tiny_config()
    config.tie_word_embeddings = tied
    model = _real(config)
    c = plan.count(config)
    assert c == plan.counts_of(model)
    assert c.params == sum(p.numel() for p in model.parameters())
    assert c.tied is tied
    # The int8 state the trainer publishes, byte for byte.
    assert plan.int8_bytes(c) == _bytes(int8_state(model).values())
    # A CPU engine over it: the linears' own codes and scales (what a decode
    # step streams), the table's codes (a tied head's) and scales, and every
    # other parameter in fp32, and the bf16 form a kernel may pack of each
    # linear's codes at its first call.
    aliases = tied_aliases(model)
    load_int8(model, int8_state(model), aliases, fuse=False)
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert plan.streamed_bytes(c) == sum(_bytes([m.codes, m.scale]) for m in linears)
    table = model.get_submodule("model.embed_tokens")
    shared = model.lm_head.codes.data_ptr() == table.codes.data_ptr()
    assert shared is tied
    held = _bytes([table.scale] + ([] if shared else [table.codes]))
    packs = 2 * sum(m.codes.numel() for m in linears)
    engine = plan.streamed_bytes(c) + packs + held + _bytes(model.parameters())
    assert plan.engine_bytes(c) == engine


def test_lora_params_are_rank_times_in_plus_out_of_the_seven_projections():
    config = tiny_config()
    c = plan.count(config)
    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = (h + h) + (h + kv) + (h + kv) + (h + h) + (h + i) + (h + i) + (i + h)
    assert len(c.lora_targets) == 7 * config.num_hidden_layers
    assert plan.lora_params(c, 16) == 16 * per_layer * config.num_hidden_layers


def test_a_built_tiny_counts_as_its_folder_says(tmp_path):
    texts = ["where is the quick brown fox? the fox is in the den."] * 60
    build_tiny(tmp_path, texts)
    config, source = model_config(str(tmp_path))
    assert source.endswith("config.json")
    shape = tiny_config()
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "tie_word_embeddings",
    ):
        assert getattr(config, name) == getattr(shape, name), name
    assert config.vocab_size <= shape.vocab_size  # the tokenizer learns at most that many
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    c = plan.count(config)
    assert c.params == sum(p.numel() for p in model.parameters())
    assert plan.int8_bytes(c) == _bytes(int8_state(model).values())


def test_smollm2_shape_is_the_presets():
    c = plan.count(shape_config("smollm2-135m"))
    assert c.params == 134_515_008  # SmolLM2-135M's published count
    assert c.tied and c.vocab == 49152
    # 30 layers' norms and the final one stay bf16; every other tensor is
    # int8 with a scale per row: the embedding's 49,152 and 5,184 a layer.
    assert c.other_bytes == 2 * (30 * 2 * 576 + 576)
    assert c.rows == 49152 + 30 * 5184
    assert plan.int8_bytes(c) == 135_368_832
    built = cache_root() / "models" / "smollm2-135m"
    if (built / "config.json").is_file():  # the preset itself, where it was built here
        assert plan.count(model_config(str(built))[0]) == c


@pytest.mark.parametrize(
    "name, params, non_embedding",
    [
        ("qwen3-0.6b", 596_049_920, 0.44),
        ("qwen3-1.7b", 1_720_574_976, 1.4),
        ("qwen3-8b", 8_190_735_360, 6.95),
    ],
)
def test_qwen3_shapes_have_their_published_sizes(name, params, non_embedding):
    c = plan.count(shape_config(name))
    shape = QWEN3[name]
    assert c.params == params
    assert c.tied is shape.tied
    embeddings = shape.vocab * shape.hidden * (1 if shape.tied else 2)
    digits = len(str(non_embedding).split(".")[1])
    assert round((c.params - embeddings) / 1e9, digits) == non_embedding
    # An untied embedding is gathered, not streamed, by a decode step.
    assert c.streamed == c.quantized - (0 if shape.tied else shape.vocab * shape.hidden)
    assert c.streamed_rows == c.rows - (0 if shape.tied else shape.vocab)


# -- the arithmetic on a case computed by hand ---------------------------------------------

HAND = Counts(
    architecture="Hand",
    params=1000,
    tensors=10,
    quantized=900,
    rows=30,
    other_bytes=200,  # int8 state: 900 + 4 x 30 + 200 = 1220
    streamed=800,
    streamed_rows=20,  # streamed: 800 + 80 = 880
    dense=200,  # engine: 880 + 2 x 800 + 4 x 50 (the tied table's scales) + 4 x 100 = 3080
    table=100,
    root=300,
    layer=350,
    vocab=50,
    tied=True,
    lora_targets=((10, 20), (20, 10)),
)


def _values(section) -> dict[str, float]:
    return {f.key: f.value for f in section.figures}


def test_full_memory_by_hand():
    sharded = _values(plan.full_memory(HAND, Setting(ranks=2, logit_chunk_tokens=8)))
    assert sharded == {
        "masters": 2000,
        "grads": 2000,
        "adam": 4000,
        "compute": 6 * (300 + 2 * 350),  # bf16 units with fp32 grads
        "logits": 3 * 4 * 8 * 50,
        "total": 2000 + 2000 + 4000 + 6000 + 4800,
    }
    alone = _values(plan.full_memory(HAND, Setting(ranks=1, logit_chunk_tokens=8)))
    assert alone["masters"] == 4000 and alone["compute"] == 2000  # autocast's bf16 copy
    fsdp = _values(plan.full_memory(HAND, Setting(ranks=1, fsdp=True, logit_chunk_tokens=8)))
    assert fsdp["compute"] == 6000


def test_lora_memory_and_checkpoint_by_hand():
    s = Setting(ranks=2, lora_rank=4, logit_chunk_tokens=8)
    assert plan.lora_params(HAND, 4) == 4 * (30 + 30)
    assert _values(plan.lora_memory(HAND, s)) == {
        "base": 1000,
        "adapters": 16 * 120,
        "compute": 2 * 1000,
        "logits": 4800,
        "total": 1000 + 1920 + 2000 + 4800,
    }
    ckpt = _values(plan.checkpoint(HAND, s))
    assert ckpt["size"] == 12 * 240 + 4 * 2 * 2  # adapters, moments, a step per tensor
    assert ckpt["shard"] == 1448
    assert _values(plan.worker(HAND, s))["adapter"] == 2 * 240
    assert "publication" not in " ".join(sec.title for sec in plan.plan(HAND, s))


def test_publication_checkpoint_and_worker_by_hand():
    s = Setting(ranks=2, max_lag=2)
    assert _values(plan.publication_peak(HAND, s)) == {
        "snapshot": 2000 + 4 * 300,  # its bf16 copy, one fp32 tensor gathered at a time
        "publishing": 2000 + 2 * 1220,
        "spot": 2 * 1220 + 3 * 3080,  # engines built on skeletons: no fp32 copy
        "total": 3200 + 4440 + 11680,
    }
    assert _values(plan.publication_peak(HAND, dataclasses.replace(s, spot=False)))["total"] == (
        3200 + 4440
    )
    ckpt = _values(plan.checkpoint(HAND, s))
    assert ckpt == {
        "size": 12040,
        "shard": 6020,
        "store": 3 * 12040,
        "staging": 12040,
        "anchor_file": 1220,
    }
    worker = _values(plan.worker(HAND, s))
    assert worker["int8"] == worker["staging"] == 1220
    assert worker["memory"] == worker["join"] == 1220 + 3080  # a skeleton: no fp32 copy
    assert worker["patch_lr_1e_5"] == round(3.3e-4 * 1220)


def test_timing_by_hand():
    # 880 bytes a token at 880 bytes/s: one token a second.
    s = Setting(bandwidth_gbs=880e-9, group_size=2, groups_per_batch=1, max_episode_tokens=100)
    t = _values(plan.timing(HAND, s))
    assert t["tokens_per_s"] == pytest.approx(1.0)
    assert t["batch_tokens"] == 200 and t["batch_s"] == pytest.approx(200)
    assert t["claim_seconds"] == 600  # 3 x the batch
    assert t["slowest_batch_s"] == pytest.approx(20 * 600 / 3)
    assert t["heartbeat_timeout"] == 60  # a worker beats on its own clock
    assert t["collective_timeout"] == 900 + 1800
    assert t["upload_mbs"] == pytest.approx(12040 / 3600 / 1e6)
    # A fast batch keeps the defaults.
    quick = _values(plan.timing(HAND, dataclasses.replace(s, max_episode_tokens=5)))
    assert quick["claim_seconds"] == 120 and quick["heartbeat_timeout"] == 60


def test_the_lease_rule_is_the_demands():
    s = Setting()
    assert (s.lease_factor, s.max_lease) == (LEASE_FACTOR, MAX_LEASE_FACTOR)


def test_patch_shares_give_back_the_measured_patches():
    # docs/benchmarks.md's PULSE table, "int8 ours" on SmolLM2-135M.
    q = plan.int8_bytes(plan.count(shape_config("smollm2-135m")))
    for lr, measured in (("lr 1e-6", 3_246), ("lr 1e-5", 44_327)):
        assert plan.PATCH_SHARES[lr] * q == pytest.approx(measured, rel=0.02)


# -- the command ---------------------------------------------------------------------------


def test_plan_json_is_one_document(capsys):
    assert main(["plan", "--model", "qwen3-0.6b", "--lora-rank", "16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["params"] == 596_049_920
    counts = plan.count(shape_config("qwen3-0.6b"))
    assert doc["model"]["lora_params"] == plan.lora_params(counts, 16)
    figures = {f["key"]: f for sec in doc["sections"] for f in sec["figures"]}
    assert figures["adapter"]["unit"] == "bytes" and figures["adapter"]["basis"]
    assert doc["setting"]["lora_rank"] == 16


def test_plan_text_states_each_basis_once(capsys):
    assert main(["plan", "--model", "tiny", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("LlamaForCausalLM from preset tiny: ")
    notes = out.split("what each line rests on:")[1].strip().splitlines()
    assert len(notes) == len(set(notes)) and notes[0].startswith("[1] ")
    assert "FSDP2 gathers the root unit" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "qwen3-9b"],
        ["--model", "tiny", "--ranks", "0"],
        ["--model", "tiny", "--bandwidth-gbs", "0"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, capsys):
    assert main(["plan", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: ") and err.count("\n") == 1
