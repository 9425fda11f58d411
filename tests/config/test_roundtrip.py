"""`colonnade config show` prints a run file that loads back: into `colonnade run`,
and into `colonnade trainer` and `colonnade worker`, each taking its own table;
an unknown environment or model is refused when the config is built."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

from colonnade.cli.main import main
from colonnade.config import RUN_PRESETS, TrainerConfig, WorkerConfig, load_config
from colonnade.config.names import BUILTIN_ENVS, ENV_FAMILIES, MODEL_PRESETS
from colonnade.launch.config import effective_tables, resolve_run_config, role_configs


def _show(capsys, *args: str) -> str:
    assert main(["config", "show", *args]) == 0
    return capsys.readouterr().out


class _Started(Exception):
    """Raised by the stand-in roles: the CLI built a config and started the role."""


@pytest.fixture
def started(monkeypatch):
    """The configs `colonnade trainer` and `colonnade worker` start their role
    with, the roles themselves stood in for."""
    from colonnade.rollout import worker
    from colonnade.train import trainer

    seen: dict = {}

    def stand_in(role):
        def build(cfg, *_a, **_k):
            seen[role] = cfg
            raise _Started

        return build

    monkeypatch.setattr(trainer, "Trainer", stand_in("trainer"))
    monkeypatch.setattr(worker, "Worker", stand_in("worker"))
    return seen


@pytest.mark.parametrize("preset", list(RUN_PRESETS))
@pytest.mark.parametrize("out", [None, "runs/x"])
def test_what_config_show_prints_loads_back_for_run_trainer_and_worker(
    preset, out, tmp_path, capsys, started
):
    flags = ["--preset", preset] + (["--out", out] if out else [])
    text = _show(capsys, *flags)
    shown = tomllib.loads(text)
    f = tmp_path / "run.toml"
    f.write_text(text)
    # `colonnade run --config`: the same run, every table the same.
    again = resolve_run_config(None, f)
    assert effective_tables(again) == effective_tables(resolve_run_config(preset, out=out))
    assert _show(capsys, "--config", str(f)) == text
    # The roles take their own table: the settings the run would start them with.
    trainer, worker = role_configs(again)
    assert load_config(TrainerConfig, f) == trainer
    assert load_config(WorkerConfig, f) == worker
    # ...through the CLI as well (a store given where the run's folder is not known).
    store = [] if out else ["--store", str(tmp_path / "store")]
    with pytest.raises(_Started):
        main(["trainer", "--config", str(f), *store])
    with pytest.raises(_Started):
        main(["worker", "--config", str(f), *store])
    assert started["trainer"].env == shown["env"] and started["trainer"].lr == trainer.lr
    assert started["worker"].store == (store[1] if store else "runs/x/store")
    # No placeholder: a path under the run's folder only once the folder is known.
    paths = (shown["trainer"]["store"], shown["trainer"]["key"], shown["worker"]["trust"])
    if out:
        assert paths == ("runs/x/store", "runs/x/trainer-key/trainer.key",
                         "runs/x/trainer-key/trainer.pub")  # fmt: skip
    else:
        assert paths == ("", "", "")


def test_a_run_file_with_a_partial_table_takes_the_runs_env_and_model(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('env = "smoke"\nmodel = "tiny"\nworkers = 3\n[trainer]\nlr = 0.5\n')
    cfg = load_config(TrainerConfig, f)
    assert (cfg.env, cfg.model, cfg.lr) == ("smoke", "tiny", 0.5)
    assert load_config(WorkerConfig, f) == WorkerConfig()  # no [worker]: its defaults
    f.write_text('[trainer]\npreset = "smoke"\n')
    with pytest.raises(ValueError, match=r"setting\(s\) in \[trainer\] of .*: preset"):
        load_config(TrainerConfig, f)


def test_a_plain_role_file_still_loads(tmp_path):
    f = tmp_path / "trainer.toml"
    f.write_text('lr = 0.25\nenv = "smoke"\n')
    assert load_config(TrainerConfig, f).lr == 0.25
    f.write_text("lr = 0.25\nworkers = 3\n")
    with pytest.raises(ValueError, match="unknown TrainerConfig setting"):
        load_config(TrainerConfig, f)


@pytest.mark.parametrize(
    "table, message",
    [
        ('[trainer]\nenv = "smoke"\n', r"\[trainer\] env = 'smoke' differs from the run's"),
        ('[trainer]\nmodel = "smollm2-135m"\n', r"\[trainer\] model"),
        ('[worker]\nstore = "elsewhere"\n', r"\[worker\] store"),
        ("[trainer]\nmetrics_port = 9000\n", r"\[trainer\] metrics_port"),
    ],
)
def test_a_run_table_may_not_contradict_what_the_run_decides(tmp_path, table, message):
    f = tmp_path / "run.toml"
    f.write_text('env = "searchqa"\n' + table)
    with pytest.raises(ValueError, match=message):
        resolve_run_config(None, f, out=str(tmp_path))


def test_a_run_table_repeating_the_run_is_taken_and_the_warm_model_stands(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text(
        f'env = "smoke"\nout = "{tmp_path}"\n[trainer]\nenv = "smoke"\nmodel = "tiny"\n'
        f'store = "{tmp_path / "store"}"\nkey = ""\n'
    )
    trainer, worker = role_configs(resolve_run_config(None, f), "/warm/model")
    assert trainer.model == "/warm/model"  # not the table's "tiny": the warm start's
    assert trainer.key == str(tmp_path / "trainer-key" / "trainer.key")  # empty: the run's
    assert worker.trust == str(tmp_path / "trainer-key" / "trainer.pub")


@pytest.mark.parametrize(
    "args, message",
    [
        (["config", "show", "--env", "nope"], "unknown environment 'nope'"),
        (["config", "show", "--model", "nope"], "unknown model 'nope'"),
        (["config", "show", "--env", "rg:"], "name the dataset after rg:"),
        (["trainer", "--store", "s", "--env", "nowhere.at_all"], "unknown environment"),
        (["trainer", "--store", "s", "--model", "nope"], "unknown model 'nope'"),
    ],
)
def test_unknown_environments_and_models_are_refused_in_one_line(args, message, capsys, started):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert "trainer" not in started  # refused before any role started


def test_a_model_folder_must_hold_config_json(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_config(TrainerConfig, model=str(tmp_path / "m"))
    (tmp_path / "m" / "config.json").write_text("{}")
    assert load_config(TrainerConfig, model=str(tmp_path / "m")).model == str(tmp_path / "m")
    assert load_config(TrainerConfig, model="org/model", env="json").env == "json"


def test_the_known_names_are_the_loaders():
    from colonnade.envs import BUILTINS, PREFIXES
    from colonnade.model import PRESETS

    assert tuple(BUILTINS) == BUILTIN_ENVS and tuple(PREFIXES) == ENV_FAMILIES
    assert tuple(PRESETS) == MODEL_PRESETS


def test_every_role_table_of_a_run_file_is_a_role_config():
    assert (TrainerConfig.TABLE, WorkerConfig.TABLE) == ("trainer", "worker")
    assert "TABLE" not in {f.name for f in dataclasses.fields(TrainerConfig)}
