"""`colonnade export` of a version trained with LoRA: a plain model folder
with the adapters merged in (by default), or the adapters alone as a PEFT
adapter folder (`--adapter`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from colonnade.cli.main import main
from colonnade.launch.evaluation import version_engine
from colonnade.model import load_model, publishable_state, sequence_logprobs
from colonnade.model.lora import A_SUFFIX, B_SUFFIX, TARGETS, merge, targets_in
from colonnade.protocol import Publisher, keys
from colonnade.protocol.model_files import model_files
from colonnade.pulse import dequantize_state, prepare
from colonnade.pulse.hashing import digest_bytes
from colonnade.store import LocalStore
from signed_runs import _write_signed_run

RANK = 4
IDS = [5, 17, 42, 99, 7, 300, 12, 1, 64, 8]


def _adapters(model, seed: int) -> dict[str, torch.Tensor]:
    """Random nonzero A and B' (scale folded) for every target linear."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in targets_in(model, TARGETS):
        m = model.get_submodule(name)
        out[name + A_SUFFIX] = torch.randn(RANK, m.in_features, generator=gen) * 0.1
        out[name + B_SUFFIX] = torch.randn(m.out_features, RANK, generator=gen) * 0.1
    return out


def _publish(root: Path, tiny_dir: str, lora: bool, versions: int = 3):
    """A run of the tiny model whose versions change only their adapters (as
    a LoRA trainer publishes), or one version of the base alone; (store, the
    float states published)."""
    store = LocalStore(root)
    files = model_files(Path(tiny_dir))
    for name, data in files.items():
        store.put(keys.model_file(name), data)
    hashes = {name: digest_bytes(data, "blake3") for name, data in files.items()}
    signer = _write_signed_run(store, "r1", model_files=hashes, anchor_every=2)
    publisher = Publisher(store, signer, "int8", anchor_every=2)
    model, _ = load_model(tiny_dir)
    base = publishable_state(model)
    states = []
    for v in range(versions if lora else 1):
        states.append({**base, **(_adapters(model, v) if lora else {})})
        publisher.publish(states[-1])
    return store, states


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_dir):
    return _publish(tmp_path_factory.mktemp("lora") / "store", tiny_dir, lora=True)


def _reference(tiny_dir, state):
    """The float model the engines' log-probs stand for: the published int8
    base dequantized with the adapters merged in."""
    model, _ = load_model(tiny_dir)
    model.load_state_dict(merge(dequantize_state(prepare(state, "int8"))), strict=False)
    return model.eval()


def test_a_lora_version_exports_as_a_plain_model_with_its_adapters_merged(
    lora_run, tiny_dir, tmp_path, capsys
):
    from transformers import AutoModelForCausalLM

    store, states = lora_run
    out = tmp_path / "merged"
    assert main(["export", f"{store.root}@v2", "-o", str(out)]) == 0
    assert "LoRA adapters merged in" in capsys.readouterr().err
    reference = _reference(tiny_dir, states[2]).state_dict()
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert not [k for k in f.keys() if "lora" in k]  # noqa: SIM118
        for name in f.keys():  # noqa: SIM118
            # tiny's config.json names float32: the merge's own values, bit for bit
            assert torch.equal(f.get_tensor(name), reference[name]), name
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # What the workers ran for v2 (its adapters unmerged on the int8 engine).
    engine = version_engine(store, 2)
    with torch.no_grad():
        got = sequence_logprobs(model.float().eval(), IDS, 1)
        ran = sequence_logprobs(engine.backend.model, IDS, 1)
        base = sequence_logprobs(_reference(tiny_dir, states[0]), IDS, 1)
    gap = (got - ran).abs()
    assert gap.max() < 0.1 and gap.mean() < 0.02  # the int8 kernel's bf16 activations
    assert (got - base).abs().mean() > 10 * max(gap.mean(), 1e-4)  # v2's adapters, not v0's


def test_adapter_writes_a_peft_adapter_folder(lora_run, tmp_path, capsys):
    store, states = lora_run
    out, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", f"{store.root}@v1", "-o", str(out), "--adapter"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == config["lora_alpha"] == RANK and config["use_rslora"] is False
    assert config["target_modules"] == sorted(TARGETS)
    assert config["bias"] == "none" and config["lora_dropout"] == 0
    assert "base_model_name_or_path" in config
    published = prepare(states[1], "int8")
    with safe_open(out / "adapter_model.safetensors", framework="pt") as f:
        assert f.metadata()["colonnade_version"] == "1"
        names = set(f.keys())
        want = {"base_model.model." + k for k in published if "lora" in k}
        assert names == want
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
        adapters = {k.removeprefix("base_model.model."): f.get_tensor(k) for k in names}
    assert all(torch.equal(t, published[k]) for k, t in adapters.items())  # bf16 as published
    # PEFT's merge, W + (alpha / r) · B A, over the base gives the merged export.
    assert main(["export", f"{store.root}@v1", "-o", str(merged)]) == 0
    scale = config["lora_alpha"] / config["r"]
    scaled = {k: t * scale if k.endswith(B_SUFFIX) else t for k, t in adapters.items()}
    base = {k: t for k, t in dequantize_state(published).items() if "lora" not in k}
    peft = merge({**base, **scaled})
    with safe_open(merged / "model.safetensors", framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            assert torch.equal(f.get_tensor(name), peft[name]), name


def test_adapter_of_a_version_without_adapters_is_one_line_and_writes_nothing(
    tmp_path, tiny_dir, capsys
):
    store, _ = _publish(tmp_path / "store", tiny_dir, lora=False)
    out = tmp_path / "runs" / "adapter"
    capsys.readouterr()  # the model's loading, above
    assert main(["export", str(store.root), "-o", str(out), "--adapter"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "no LoRA adapters" in err[0], err
    assert not (tmp_path / "runs").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
