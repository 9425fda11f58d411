"""Role configs: light to import, every setting documented and a flag, ranges
checked when built, presets in one place."""

import argparse
import dataclasses
import math
import subprocess
import sys
import tomllib

import pytest

from colonnade import choices
from colonnade.cli.main import main
from colonnade.config import (
    RUN_PRESETS,
    TRAINER_PRESETS,
    RunConfig,
    TrainerConfig,
    WorkerConfig,
    add_flags,
    flag_values,
    help_of,
    load_config,
)
from colonnade.config import trainer as trainer_module
from colonnade.config import worker as worker_module

CONFIGS = (TrainerConfig, WorkerConfig, RunConfig)


def test_reading_a_config_imports_neither_torch_nor_transformers():
    code = (
        "import sys, colonnade.config, colonnade.launch.config\n"
        "colonnade.config.load_config(colonnade.config.TrainerConfig)\n"
        # numpy too: config takes its value checks from `untrusted`, which must
        # import numpy only where it measures JSON
        "print(sorted(m for m in ('torch', 'transformers', 'numba', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_setting_is_documented(cls):
    undocumented = [f.name for f in dataclasses.fields(cls) if not help_of(cls, f.name)]
    assert not undocumented


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_scalar_setting_is_a_flag_that_reaches_the_config(cls):
    p = argparse.ArgumentParser()
    dests = add_flags(p, cls)
    dicts = {f.name for f in dataclasses.fields(cls) if f.type in ("dict", dict)}
    assert set(dests) == {f.name for f in dataclasses.fields(cls)} - dicts
    args = p.parse_args([])
    assert flag_values(args, dests) == {}  # nothing given: preset and file values stand


def test_flags_are_typed_and_switches_go_both_ways():
    p = argparse.ArgumentParser()
    dests = add_flags(p, TrainerConfig)
    args = p.parse_args(["--max-grad-norm", "0.5", "--scale-by-std", "--no-resume", "--lr", "3e-4"])
    cfg = load_config(TrainerConfig, **flag_values(args, dests))
    assert (cfg.max_grad_norm, cfg.scale_by_std, cfg.resume, cfg.lr) == (0.5, True, False, 3e-4)
    with pytest.raises(SystemExit):
        p.parse_args(["--max-lag", "two"])


def test_a_bad_range_fails_when_the_config_is_built():
    with pytest.raises(ValueError, match="max_lag >= 0"):
        load_config(TrainerConfig, max_lag=-1)
    with pytest.raises(ValueError, match="poll_seconds"):
        load_config(WorkerConfig, poll_seconds=0.0)
    with pytest.raises(ValueError, match="trainer_ranks"):
        load_config(RunConfig, trainer_ranks=0)


def test_the_light_modules_choices_match_the_heavy_ones():
    from colonnade.model.device import DEVICES
    from colonnade.pulse.hashing import ALGOS

    assert set(choices.HASHES) == set(ALGOS)
    assert set(trainer_module.DEVICES) == set(DEVICES) == set(worker_module.DEVICES)


def test_a_setting_of_the_wrong_type_fails_and_toml_infinity_is_a_float():
    with pytest.raises(ValueError, match=r"max_lag: expected .*int.*, got True"):
        load_config(TrainerConfig, max_lag=True)  # a bool is not a number
    with pytest.raises(ValueError, match=r"lr: expected .*float.*, got '1e-5'"):
        load_config(TrainerConfig, lr="1e-5")
    assert (
        load_config(TrainerConfig, store_outage_seconds=math.inf).store_outage_seconds == math.inf
    )


def test_presets_hold_only_real_settings():
    for preset in TRAINER_PRESETS.values():
        load_config(TrainerConfig, base=preset)  # unknown keys or bad ranges would raise
    for name, preset in RUN_PRESETS.items():
        table = dict(preset.get("trainer", {}))
        assert table.pop("preset", None) in (None, *TRAINER_PRESETS), name
        load_config(RunConfig, base={k: v for k, v in preset.items() if k != "trainer"})


def test_run_takes_any_trainer_and_worker_setting_as_a_flag(capsys):
    argv = ["config", "show", "--preset", "smoke", "--trainer.max-grad-norm", "0.25",
            "--trainer.no-resume", "--worker.poll-seconds", "0.5", "--max-lag", "3"]  # fmt: skip
    assert main(argv) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert shown["trainer"]["max_grad_norm"] == 0.25 and shown["trainer"]["resume"] is False
    assert shown["trainer"]["max_lag"] == 3
    assert shown["trainer"]["lr"] == RUN_PRESETS["smoke"]["trainer"]["lr"]  # the preset stands
    assert shown["worker"]["poll_seconds"] == 0.5


def test_a_bad_flag_value_is_one_line_and_exit_2(capsys):
    assert main(["config", "show", "--trainer.max-grad-norm", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max_grad_norm > 0" in err[0]


def test_a_custom_environment_gets_neutral_settings_not_searchqas():
    from colonnade.launch import resolve_run_config, role_configs

    cfg = resolve_run_config(env="rg:basic_arithmetic", eval_n=0)
    trainer, _ = role_configs(cfg)
    assert cfg.preset == "custom" and trainer.env == "rg:basic_arithmetic"
    neutral = TrainerConfig()
    assert (trainer.lr, trainer.max_turn_tokens) == (neutral.lr, neutral.max_turn_tokens)
    assert resolve_run_config(env="searchqa").preset == "demo"  # made for it
    assert resolve_run_config(env="smoke").preset == "smoke"
    assert resolve_run_config().preset == "demo"  # nothing said: the default


def test_the_smol_preset_is_smollm2_on_searchqa():
    from colonnade.launch import resolve_run_config, role_configs

    trainer, _ = role_configs(resolve_run_config("smol"))
    assert (trainer.model, trainer.env) == ("smollm2-135m", "searchqa")
    assert trainer.max_episode_tokens == TRAINER_PRESETS["searchqa"]["max_episode_tokens"]


def test_docs_configuration_md_is_the_generated_reference():
    from pathlib import Path

    from colonnade.config.reference import reference

    doc = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert doc.read_text() == reference(), "run: colonnade config doc > docs/configuration.md"
    for cls in CONFIGS:
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in doc.read_text()
