"""Which engine a worker runs: --engine auto | torch | mlx, and MLX missing."""

import pytest

from colonnade.cli.main import main
from colonnade.engine import BackendUnavailable, loader

MISSING = "the MLX engine needs the mlx package (No module named 'mlx')"


def test_auto_is_torch_off_apple_silicon_and_mlx_on_it(monkeypatch):
    monkeypatch.setattr(loader, "mlx_missing", lambda: None)
    monkeypatch.setattr(loader, "apple_silicon", lambda: False)
    assert loader.resolve_engine("auto") == "torch"
    assert loader.resolve_engine("mlx") == "mlx"
    monkeypatch.setattr(loader, "apple_silicon", lambda: True)
    assert loader.resolve_engine("auto") == "mlx"
    assert loader.resolve_engine("torch") == "torch"
    with pytest.raises(ValueError, match="unknown engine"):
        loader.resolve_engine("jax")


def test_without_mlx_auto_falls_back_and_mlx_is_refused(monkeypatch, caplog):
    monkeypatch.setattr(loader, "mlx_missing", lambda: MISSING)
    monkeypatch.setattr(loader, "apple_silicon", lambda: True)
    assert loader.resolve_engine("auto") == "torch"
    assert "using the torch engine" in caplog.text
    with pytest.raises(BackendUnavailable, match="needs the mlx package"):
        loader.resolve_engine("mlx")


def test_worker_cli_says_so_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(loader, "mlx_missing", lambda: MISSING)
    code = main(["worker", "--store", str(tmp_path), "--engine", "mlx"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "mlx" in err[0] and err[0].startswith("error:")


def test_an_engine_that_does_not_run_the_architecture_says_which_do(monkeypatch):
    monkeypatch.setattr(loader, "mlx_missing", lambda: None)
    with pytest.raises(loader.UnsupportedArchitecture) as e:
        loader.resolve_engine("mlx", "gpt2")
    msg = str(e.value)
    assert "'gpt2'" in msg and "engines that do: torch" in msg and "\n" not in msg
    assert loader.resolve_engine("mlx", "qwen3_moe") == "mlx"
    with pytest.raises(loader.UnsupportedArchitecture, match="no engine of colonnade"):
        loader.resolve_engine("torch", "not-a-model-type")


def test_auto_picks_an_engine_that_runs_the_architecture(monkeypatch):
    monkeypatch.setattr(loader, "mlx_missing", lambda: None)
    monkeypatch.setattr(loader, "apple_silicon", lambda: True)
    assert loader.resolve_engine("auto", "gpt2") == "torch"
    assert loader.resolve_engine("auto", "gemma3_text") == "mlx"


def test_load_engine_refuses_the_architecture_from_config_json_alone(tmp_path, monkeypatch):
    # No weights in the folder: the refusal comes before anything would load them.
    from transformers import GPT2Config

    monkeypatch.setattr(loader, "mlx_missing", lambda: None)
    GPT2Config(n_layer=1).save_pretrained(tmp_path)
    with pytest.raises(loader.UnsupportedArchitecture, match="'gpt2'"):
        loader.load_engine(str(tmp_path), engine="mlx")


def test_eval_on_an_unsupported_architecture_exits_2_in_one_line(tmp_path, monkeypatch, capsys):
    from transformers import GPT2Config

    monkeypatch.setattr(loader, "mlx_missing", lambda: None)
    GPT2Config(n_layer=1).save_pretrained(tmp_path)
    code = main(["eval", "--model", str(tmp_path), "--env", "smoke", "-n", "1", "--engine", "mlx"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "'gpt2'" in err[0] and "torch" in err[0]


def _run_without_weights(store_dir, tiny_dir, signed_run):
    """A signed run.json and the model's files, no version published yet."""
    from pathlib import Path

    from colonnade.protocol import keys
    from colonnade.protocol.model_files import model_files
    from colonnade.pulse.hashing import digest_bytes
    from colonnade.store import LocalStore

    store = LocalStore(store_dir)
    files = model_files(Path(tiny_dir))
    for name, data in files.items():
        store.put(keys.model_file(name), data)
    hashes = {name: digest_bytes(data, "blake3") for name, data in files.items()}
    signed_run(store, "r", model_files=hashes)
    return store


def test_a_worker_refuses_the_architecture_before_any_weights(
    monkeypatch, tmp_path, tiny_dir, capsys, signed_run
):
    from colonnade.config import WorkerConfig
    from colonnade.rollout.worker import Worker

    store = _run_without_weights(tmp_path, tiny_dir, signed_run)
    monkeypatch.setattr(loader, "mlx_missing", lambda: None)
    monkeypatch.setattr(loader, "ARCHITECTURES", {})  # MLX runs no llama here
    w = Worker(WorkerConfig(store=str(tmp_path), id="w1", engine="mlx"), store)
    with pytest.raises(loader.UnsupportedArchitecture, match=r"'llama'.*engines that do: torch"):
        w.setup()
    assert getattr(w, "weights", None) is None  # no weights were asked for
    auto = Worker(WorkerConfig(store=str(tmp_path), id="w2", engine="auto"), store)
    auto.setup()
    assert auto.engine_kind == "torch"
    capsys.readouterr()
    assert main(["worker", "--store", str(tmp_path), "--engine", "mlx"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'llama'" in err[0] and "torch" in err[0]


def test_the_backends_are_the_engines_a_batch_may_name():
    from colonnade.choices import ENGINES

    assert tuple(loader.BACKENDS) == ENGINES


@pytest.mark.parametrize(
    ("kind", "precision"), [("torch", "int8"), ("torch", "fp32"), ("mlx", "int8")]
)
def test_an_engine_built_on_a_skeleton_runs_as_one_built_on_the_model(kind, precision, tiny_dir):
    # The trainer's spot checks and a worker build their engines from the
    # model's skeleton (no fp32 weights ever made): the same episodes and
    # log-probs as from the whole float model.
    import torch

    from colonnade.engine import SamplingParams, engine_for
    from colonnade.engine.mlx_backend import mlx_missing
    from colonnade.model import int8_state, load_model, skeleton

    if kind == "mlx" and mlx_missing() is not None:
        pytest.skip(mlx_missing())
    model, tok = load_model(tiny_dir)
    state = (
        int8_state(model)
        if precision == "int8"
        else {k: v.clone() for k, v in model.state_dict().items()}
    )
    skel = skeleton(tiny_dir)
    assert all(p.is_meta for p in skel.parameters())
    cpu = torch.device("cpu")
    whole = engine_for(model, tok, state, precision, cpu, kind)
    light = engine_for(skel, tok, state, precision, cpu, kind)
    if kind == "torch":  # every tensor made from the state
        assert not any(t.is_meta for t in light.backend.model.state_dict().values())
    prompts = [tok.encode("Question: what is 2 + 2?", add_special_tokens=False)] * 3
    params = SamplingParams(max_turn_tokens=12, max_episode_tokens=12, ignore_eos=True)
    a = whole.generate(prompts, [lambda t: None] * 3, params, seed=5)
    b = light.generate(prompts, [lambda t: None] * 3, params, seed=5)
    assert [e.tokens for e in a] == [e.tokens for e in b]
    assert [e.logprobs for e in a] == [e.logprobs for e in b]
