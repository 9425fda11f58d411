"""The run config: preset < file < flags, role tables checked, TOML written back."""

import tomllib

import pytest

from colonnade.launch.config import effective_tables, resolve_run_config, role_configs, to_toml


def test_precedence_and_table_merge(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('workers = 3\neval_n = 7\n[trainer]\nlr = 0.5\n[worker]\ndevice = "cpu"\n')
    cfg = resolve_run_config("smoke", f, eval_n=9, trainer={"max_versions": 4}, out=str(tmp_path))
    assert (cfg.workers, cfg.eval_n, cfg.env) == (3, 9, "smoke")
    trainer, worker = role_configs(cfg, "/some/model")
    # The file's [trainer] key and the flag both land on top of the presets.
    assert (trainer.lr, trainer.max_versions, trainer.group_size) == (0.5, 4, 8)
    assert trainer.model == "/some/model" and trainer.store == str(tmp_path / "store")
    assert worker.store == trainer.store
    # The launcher's trainer key, under the run's out folder; its workers pin its .pub.
    assert trainer.key == str(tmp_path / "trainer-key" / "trainer.key")
    assert worker.trust == str(tmp_path / "trainer-key" / "trainer.pub")
    # A [worker] trust of the operator's own is kept.
    cfg = resolve_run_config("smoke", out=str(tmp_path), worker={"trust": "SHA256:" + "a" * 43})
    assert role_configs(cfg)[1].trust == "SHA256:" + "a" * 43


@pytest.mark.parametrize(
    "text, match",
    [
        ("wokers = 3\n", "unknown RunConfig setting"),
        ("[trainer]\nlearning_rate = 1\n", "unknown TrainerConfig setting"),
        ("[worker]\ngpu = true\n", "unknown WorkerConfig setting"),
        ("workers = 'two'\n", "workers: expected"),
        ("preset = 'huge'\n", "unknown preset"),
        ("[trainer]\npreset = 'nope'\n", "preset 'nope'"),
        ("workers = [\n", "config"),
    ],
)
def test_bad_configs_fail_naming_the_key(tmp_path, text, match):
    f = tmp_path / "run.toml"
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        resolve_run_config(None, f)


def test_effective_config_round_trips_through_toml():
    tables = effective_tables(resolve_run_config("demo"))
    parsed = tomllib.loads(to_toml(tables))
    assert parsed["env"] == "searchqa" and parsed["trainer"]["env"] == "searchqa"
    assert parsed["trainer"]["max_versions"] == tables["trainer"]["max_versions"]
    assert "endpoint_url" not in parsed  # None is left out, not written as a string


def test_stages_make_pipeline_groups_of_the_workers():
    from colonnade.launch.run import _stage_args

    cfg = resolve_run_config("smoke", workers=4, stages=2)
    assert [_stage_args(cfg, i) for i in range(4)] == [
        ["--stage", "1/2", "--stage-group", "w1,w2"],
        ["--stage", "2/2", "--stage-group", "w1,w2"],
        ["--stage", "1/2", "--stage-group", "w3,w4"],
        ["--stage", "2/2", "--stage-group", "w3,w4"],
    ]
    assert _stage_args(resolve_run_config("smoke"), 0) == []  # whole-model workers
    for workers, stages in ((3, 2), (2, 1), (2, -2)):
        with pytest.raises(ValueError, match="stages must be"):
            resolve_run_config("smoke", workers=workers, stages=stages)
