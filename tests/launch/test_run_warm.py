"""The run's starting model: warm start only where the environment has demonstrations,
and a preset name resolved on every path (never looked up on the hub)."""

import io

import pytest
from rich.console import Console

from colonnade.config import RunConfig
from colonnade.launch import run as launch_run
from colonnade.launch.config import role_configs


@pytest.fixture
def resolved(monkeypatch):
    calls = []

    def fake(name, texts=None, **_):
        texts = texts() if callable(texts) else texts  # read only for the tiny preset
        calls.append((name, len(list(texts or ()))))
        return f"/models/{name}"

    monkeypatch.setattr(launch_run, "resolve_model", fake)
    return calls


def _warm(cfg: RunConfig) -> tuple[str, str]:
    out = io.StringIO()
    trainer, _ = role_configs(cfg)
    path = launch_run._warm(cfg, trainer, Console(file=out, width=200))
    return path, out.getvalue()


def test_no_warm_start_resolves_the_preset_name(resolved):
    path, said = _warm(RunConfig(env="smoke", model="smollm2-135m", warmstart=False))
    assert path == "/models/smollm2-135m" and resolved[0][0] == "smollm2-135m"
    assert said == ""


def test_an_environment_without_demonstrations_skips_the_warm_start(resolved):
    pytest.importorskip("reasoning_gym")
    cfg = RunConfig(env="rg:basic_arithmetic", model="tiny", trainer={"env_kwargs": {"size": 20}})
    path, said = _warm(cfg)
    assert path == "/models/tiny" and resolved[0][1] > 0  # the tiny tokenizer got the env's text
    assert said.count("\n") == 1 and "warm start: skipped" in said and "no demonstrations" in said
