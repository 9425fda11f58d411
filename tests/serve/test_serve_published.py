"""`colonnade serve --model STORE@vN`: a published version, rebuilt as a worker rebuilds it."""

from __future__ import annotations

import argparse

import pytest

from colonnade.cli.main import CliError, build_parser
from colonnade.cli.serve import _engine
from operate.test_export import _publish
from signed_runs import _write_signed_run


def _args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *flags])


def test_a_published_version_is_served_at_its_runs_precision(tmp_path, tiny_dir, capsys):
    store, _, _ = _publish(tmp_path / "store", tiny_dir, _write_signed_run)
    engine = _engine(_args("--model", f"{store.root}@v3"))
    assert engine.version == 3 and engine.backend.precision == "int8"
    assert "v3 rebuilt from the anchor v2 and 1 patch(es)" in capsys.readouterr().err
    with pytest.raises(CliError, match="published precision"):
        _engine(_args("--model", f"{store.root}@v3", "--precision", "fp32"))
