"""`colonnade bench serve --json`: the endpoint and the engine side by side."""

import json

import pytest

from colonnade.cli.main import main

pytest.importorskip("openai")


def test_both_paths_run_the_same_episodes(capsys):
    code = main(["bench", "serve", "--json", "--episodes", "6", "--clients", "3",
                 "--tokens", "6", "--repeats", "2"])  # fmt: skip
    (row,) = json.loads(capsys.readouterr().out)
    assert code == 0 and row["model"] == "tiny" and row["episodes"] == 6
    assert row["direct_episodes_s"] > 0 and row["endpoint_episodes_s"] > 0
    assert len(row["rounds"]) == 2 and 0 < row["tokens_per_episode"] <= 6
    # The same draw keys on both paths: most episodes agree token for token
    # (int8 rounding that depends on the batch may move a draw's token).
    assert row["same_episodes"] >= 0.5


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit, match="--models"):
        main(["bench", "serve", "--models", "gpt-4"])
