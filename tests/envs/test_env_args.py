"""Environment arguments: `--env-arg k=v` parsing, and one check on every side.

A value that `config show` and the trainer accept must also be one that
run.json's reader (RunSpec) accepts, and the other way round.
"""

import json
import tomllib

import pytest

from colonnade.cli.main import main
from colonnade.envs import check_env_kwargs, load_environment, parse_env_arg, parse_env_args
from colonnade.envs.args import MAX_DEPTH
from colonnade.launch.config import effective_tables, resolve_run_config, to_toml
from colonnade.protocol.schemas import RunSpec, SchemaError

# run.json's fields after env_kwargs: model files, vocab, precision, group sizes,
# lag, anchors, sampling, trainer key.
SPEC_REST = ({"config.json": "sha256:" + "0" * 64}, 2048, "int8", 4, 2, 1, 10, {}, "0" * 64)

RICH = {
    "size": 50,
    "ratio": 0.25,
    "flag": True,
    "name": "basic",
    "operators": ["+", "-"],
    "composite": [{"name": "chain_sum", "weight": 1, "config": {"min_terms": 2}}],
}


@pytest.mark.parametrize(
    ("text", "key", "value"),
    [
        ("size=50", "size", 50),
        ("ratio=0.5", "ratio", 0.5),
        ("flag=true", "flag", True),
        ('ops=["+", "-"]', "ops", ["+", "-"]),
        ('cfg={"a": [1, 2]}', "cfg", {"a": [1, 2]}),
        ("name=chain_sum", "name", "chain_sum"),  # not JSON: the string
        ('digits="12"', "digits", "12"),  # JSON string: a way to pass a numeral as text
        ("expr=a=b", "expr", "a=b"),  # split at the first =
        ("empty=", "empty", ""),
    ],
)
def test_values_are_json_when_they_parse_else_strings(text, key, value):
    assert parse_env_arg(text) == (key, value)


def test_later_keys_win():
    assert parse_env_args(["size=1", "seed=2", "size=3"]) == {"size": 3, "seed": 2}
    assert parse_env_args(None) == {}


@pytest.mark.parametrize(
    ("items", "match"),
    [
        (["size"], "expected KEY=VALUE"),
        (["=3"], "expected KEY=VALUE"),
        (["bad-key=1"], "not an identifier"),
        (["x=null"], "null"),
        (["x=NaN"], "not a finite number"),
        (["x=[1, null]"], r"x\[1\]: null"),
        (["x=" + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)], "nested more than"),
        (["x=" + json.dumps(list(range(5000)))], "more than 4096 values"),
        (["x=" + json.dumps("a" * (70 << 10))], "bytes as JSON"),
    ],
)
def test_bad_arguments_are_refused_naming_them(items, match):
    with pytest.raises(ValueError, match=match):
        parse_env_args(items)


def test_every_json_type_round_trips_through_run_json():
    spec = RunSpec(
        "r",
        "rg:basic_arithmetic",
        RICH,
        {"config.json": "sha256:" + "0" * 64},
        2048,
        "int8",
        4,
        2,
        1,
        10,
        {},
        "0" * 64,
    )
    assert RunSpec.from_json(spec.to_json()).env_kwargs == RICH


@pytest.mark.parametrize(
    "bad", [{"x": None}, {"x": [1, None]}, {"x": {"y": None}}, {"1x": 1}, {"x": [[[[[[[1]]]]]]]}]
)
def test_run_json_refuses_what_the_other_sides_refuse(bad):
    with pytest.raises(ValueError):
        check_env_kwargs(bad)
    spec = RunSpec(
        "r",
        "smoke",
        bad,
        {"config.json": "sha256:" + "0" * 64},
        2048,
        "int8",
        4,
        2,
        1,
        10,
        {},
        "0" * 64,
    )
    with pytest.raises(SchemaError, match="env_kwargs"):
        RunSpec.from_json(spec.to_json())
    with pytest.raises(ValueError):
        load_environment("smoke", **bad)


def test_run_config_merges_flags_over_the_file_key_by_key(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[trainer]\nenv_kwargs = { size = 10, operators = ["+"], flag = false }\n')
    cfg = resolve_run_config("smoke", f, env_kwargs={"size": 20, "deep": {"k": [1, 2.5]}})
    tables = effective_tables(cfg)
    kwargs = tables["trainer"]["env_kwargs"]
    assert kwargs == {"size": 20, "operators": ["+"], "flag": False, "deep": {"k": [1, 2.5]}}
    # What the run writes for the trainer reads back the same, and run.json takes it.
    assert tomllib.loads(to_toml(tables))["trainer"]["env_kwargs"] == kwargs
    spec = RunSpec(
        "r",
        "smoke",
        kwargs,
        {"config.json": "sha256:" + "0" * 64},
        2048,
        "int8",
        4,
        2,
        1,
        10,
        {},
        "0" * 64,
    )
    assert RunSpec.from_json(spec.to_json()).env_kwargs == kwargs


def test_run_config_refuses_what_run_json_refuses(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[trainer]\nenv_kwargs = { "bad key" = 1 }\n')
    with pytest.raises(ValueError, match="bad key"):
        resolve_run_config("smoke", f)


def test_config_show_takes_env_args_and_refuses_bad_ones_in_one_line(capsys):
    assert main(["config", "show", "--preset", "smoke", "--env-arg", "n_tasks=40",
                 "--env-arg", "seed=3"]) == 0  # fmt: skip
    trainer = tomllib.loads(capsys.readouterr().out)["trainer"]
    assert trainer["env_kwargs"] == {"n_tasks": 40, "seed": 3}
    assert main(["config", "show", "--env-arg", "x=null"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "null" in err[0]


def test_an_argument_the_environment_does_not_take_is_named():
    with pytest.raises(ValueError, match=r"unexpected keyword argument 'size'.*n_tasks, seed"):
        load_environment("smoke", size=3)
    assert len(load_environment("smoke", n_tasks=10).tasks("test")) == 2
