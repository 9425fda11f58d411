"""`colonnade export` and `colonnade eval --model STORE@vN`: a published version
rebuilt from the store as a worker rebuilds it, written as a model folder that
transformers loads, and evaluated without one."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from colonnade.cli.main import main
from colonnade.config import TRAINER_PRESETS, TrainerConfig
from colonnade.model import load_model, publishable_state
from colonnade.operate import export
from colonnade.operate.export import Ref, export_dtype, names_a_run
from colonnade.protocol import Publisher, keys
from colonnade.protocol.model_files import model_files
from colonnade.protocol.turns import run_sampling
from colonnade.pulse import dequantize_state, prepare
from colonnade.pulse.hashing import digest_bytes
from colonnade.store import LocalStore
from signed_runs import _write_signed_run

VERSIONS = 4  # v0..v3; anchors every 2 versions: v3 is the anchor v2 plus one patch


def _publish(root: Path, tiny_dir: str, signed_run, drop_dtype: bool = False):
    """A run of the tiny model with VERSIONS published versions, each a step
    of noise away from the last; (store, the trainer's float states, the
    trainer's float model at the last version)."""
    store = LocalStore(root)
    files = model_files(Path(tiny_dir))
    if drop_dtype:  # a config.json that names no dtype
        config = json.loads(files["config.json"])
        config.pop("dtype", None), config.pop("torch_dtype", None)
        files["config.json"] = json.dumps(config).encode()
    for name, data in files.items():
        store.put(keys.model_file(name), data)
    sampling = asdict(run_sampling(TrainerConfig(**TRAINER_PRESETS["smoke"])))
    sampling["stop"] = list(sampling["stop"])
    signer = signed_run(
        store,
        "r1",
        model_files={name: digest_bytes(data, "blake3") for name, data in files.items()},
        anchor_every=2,
        sampling=sampling,
    )
    model, _ = load_model(tiny_dir)
    publisher = Publisher(store, signer, "int8", anchor_every=2)
    states = []
    gen = torch.Generator().manual_seed(0)
    for v in range(VERSIONS):
        if v:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        state = publishable_state(model)
        states.append({k: t.clone() for k, t in state.items()})
        publisher.publish(state)
    return store, states, model


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_dir):
    """One published run for the module (publishing is most of its cost); a
    test that changes the store puts it back."""
    return _publish(tmp_path_factory.mktemp("run") / "store", tiny_dir, _write_signed_run)


IDS = torch.tensor([[5, 17, 42, 99, 7, 300, 12, 1]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float()


def test_export_of_a_version_loads_in_transformers_as_the_trainers_weights(run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    store, states, trainer = run
    out = tmp_path / "exported"
    assert main(["export", f"{store.root}@v3", "-o", str(out)]) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout.strip() == str(out)
    assert "v3 rebuilt from the anchor v2 and 1 patch(es)" in stderr  # the worker's path
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    assert not list(tmp_path.glob("exported.tmp-*"))
    # The weights are the published int8 codes of v3, dequantized, bit for bit.
    want = dequantize_state(prepare(states[3], "int8"))
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert set(f.keys()) == set(want) and f.metadata()["colonnade_version"] == "3"
        dtype = f.get_tensor(next(iter(want))).dtype
        assert dtype == getattr(torch, json.loads((out / "config.json").read_text())["dtype"])
        for name in want:
            assert torch.equal(f.get_tensor(name), want[name].to(dtype)), name
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    got, v3 = _logits(model.float().eval()), _logits(trainer)
    err = (got - v3).abs().max().item()
    assert err <= 0.05 * v3.abs().max().item(), err  # int8 rows: well within
    # Not some other version: v0's weights are much further away.
    before, _ = load_model(str(out))
    before.load_state_dict(states[0], strict=False)
    assert (got - _logits(before)).abs().max().item() > 5 * err


def test_without_a_dtype_in_config_json_the_folder_holds_bf16(tmp_path, tiny_dir, signed_run):
    from transformers import AutoModelForCausalLM

    store, _, trainer = _publish(tmp_path / "store", tiny_dir, signed_run, drop_dtype=True)
    done = export.export_version(store, None, tmp_path / "out")  # the newest
    assert (done.version, done.dtype) == (VERSIONS - 1, "bfloat16")
    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    v3 = _logits(trainer)
    assert (_logits(model) - v3).abs().max().item() <= 0.05 * v3.abs().max().item()


def test_the_dtype_is_config_jsons_else_bf16():
    assert export_dtype({}) == export_dtype({"dtype": "auto"}) == "bfloat16"
    assert export_dtype({"dtype": "float32"}) == "float32"
    assert export_dtype({"torch_dtype": "float16"}) == "float16"


def test_a_folder_with_something_in_it_is_refused_unless_forced(run, tmp_path, capsys):
    store, _, _ = run
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert main(["export", str(store.root), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not empty" in err[0] and "--force" in err[0]
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    assert main(["export", str(store.root), "-o", str(out), "--force"]) == 0
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing beside it
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(store.root), "-o", str(empty)]) == 0  # an empty folder is fine


def test_a_crash_while_writing_leaves_nothing_at_the_folder(run, tmp_path, monkeypatch):
    store, _, _ = run

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(export, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        export.export_version(store, 1, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "x").write_text("x")
    with pytest.raises(OSError, match="disk full"):
        export.export_version(store, 1, tmp_path / "old", force=True)
    assert [p.name for p in (tmp_path / "old").iterdir()] == ["x"]  # the old one stands


@pytest.mark.parametrize(
    "ref, message",
    [
        ("{store}@v9", "v9 is not published: the newest is v3"),
        ("{store}@v0", "v0 is no longer in the store"),
        ("{tmp}/nowhere", "no such folder"),
        ("{tmp}/empty", "not a run (no run.json)"),
    ],
)
def test_bad_versions_and_stores_are_one_line(run, tmp_path, capsys, ref, message):
    store, _, _ = run
    (tmp_path / "empty").mkdir()
    meta = store.get(keys.meta_key(0))
    store.delete(keys.meta_key(0))  # as retention deletes a version
    args = ["export", ref.format(store=store.root, tmp=tmp_path), "-o", str(tmp_path / "out")]
    try:
        assert main(args) == 2
    finally:
        store.put(keys.meta_key(0), meta)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists() and not (tmp_path / "nowhere").exists()


def test_a_trust_that_is_not_the_runs_key_is_refused(run, tmp_path, capsys):
    store, _, _ = run
    wrong = "SHA256:" + "A" * 43
    assert main(["export", str(store.root), "-o", str(tmp_path / "o"), "--trust", wrong]) == 2
    assert "not the trusted" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_what_names_a_published_version(run, tmp_path, tiny_dir):
    store, _, _ = run
    assert Ref.parse("s3://b/p@v12") == Ref("s3://b/p", 12)
    assert Ref.parse("runs/x") == Ref("runs/x", None)
    assert names_a_run(str(store.root)) and names_a_run(f"{store.root}@v1")
    assert names_a_run(str(store.root.parent))  # a run directory: its store/ holds the run
    assert not names_a_run(str(tmp_path))
    assert names_a_run("s3://bucket/run") and names_a_run("x@v3")
    assert not names_a_run(tiny_dir) and not names_a_run("tiny")
    assert not names_a_run("HuggingFaceTB/SmolLM2-135M")


def test_eval_of_a_published_version_runs_with_the_runs_settings(run, capsys):
    store, _, _ = run
    args = ["eval", "--model", f"{store.root}@v2", "-n", "3", "--no-greedy", "--json"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    figures = json.loads(out)
    assert figures["version"] == 2 and figures["precision"] == "int8" and figures["n"] == 3
    # run.json's limits (the smoke trainer preset's), not those of a run preset.
    smoke = TRAINER_PRESETS["smoke"]
    assert figures["limits"] == {
        "max_turn_tokens": smoke["max_turn_tokens"],
        "max_episode_tokens": smoke["max_episode_tokens"],
    }
    assert "v2 rebuilt from the anchor v2 and 0 patch(es)" in err
    # The version runs at the run's precision, and says so when asked otherwise.
    assert main([*args, "--precision", "fp32"]) == 2
    assert "published precision (int8)" in capsys.readouterr().err
