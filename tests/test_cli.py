"""The `colonnade` command: help everywhere, pulse diff/apply, clean errors."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from colonnade.cli.main import main
from colonnade.pulse import prepare
from pulse_helpers import bits_equal

SUBCOMMANDS = [
    [],
    ["run"],
    ["pulse"],
    ["pulse", "diff"],
    ["pulse", "apply"],
    ["bench"],
    ["bench", "pulse"],
    ["bench", "trainer"],
    ["trainer"],
    ["worker"],
]


@pytest.mark.parametrize("words", SUBCOMMANDS, ids=lambda w: " ".join(w) or "top")
def test_help_everywhere(words, capsys):
    with pytest.raises(SystemExit) as e:
        main([*words, "--help"])
    assert e.value.code == 0
    assert "usage: colonnade" in capsys.readouterr().out


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "colonnade.cli.main", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.startswith("colonnade ")


@pytest.fixture
def checkpoints(tmp_path):
    gen = torch.Generator().manual_seed(0)
    old = {
        "a.weight": torch.randn(32, 16, generator=gen).to(torch.bfloat16),
        "a.bias": torch.zeros(32, dtype=torch.bfloat16),
    }
    new = {
        k: (v.float() + 1e-2 * torch.randn(v.shape, generator=gen)).to(torch.bfloat16)
        for k, v in old.items()
    }
    save_file(old, tmp_path / "old.safetensors")
    save_file(new, tmp_path / "new.safetensors")
    return tmp_path, old, new


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_diff_then_apply_rebuilds_exactly(checkpoints, capsys, precision):
    d, _old, new = checkpoints
    rc = main(
        [
            "pulse",
            "diff",
            str(d / "old.safetensors"),
            str(d / "new.safetensors"),
            "-o",
            str(d / "p.pulse"),
            "--json",
            "--precision",
            precision,
        ]
    )
    assert rc == 0
    stats = json.loads(capsys.readouterr().out)
    for key in (
        "elements",
        "changed",
        "density",
        "patch_bytes",
        "full_bytes",
        "ratio",
        "bits_per_changed",
    ):
        assert key in stats
    scales = 32 if precision == "int8" else 0  # one row scale per output row
    assert stats["elements"] == 32 * 16 + 32 + scales and stats["changed"] > 0
    assert stats["patch_bytes"] == (d / "p.pulse").stat().st_size
    assert (
        main(
            [
                "pulse",
                "apply",
                str(d / "old.safetensors"),
                str(d / "p.pulse"),
                "-o",
                str(d / "out.safetensors"),
            ]
        )
        == 0
    )
    assert bits_equal(load_file(d / "out.safetensors"), prepare(new, precision))


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert "Traceback" not in err[0]
    return err[0]


def test_apply_corrupt_patch_exits_2_and_writes_nothing(checkpoints, capsys):
    d, _, _ = checkpoints
    main(
        [
            "pulse",
            "diff",
            str(d / "old.safetensors"),
            str(d / "new.safetensors"),
            "-o",
            str(d / "p.pulse"),
        ]
    )
    data = bytearray((d / "p.pulse").read_bytes())
    data[len(data) // 2] ^= 0x10
    (d / "bad.pulse").write_bytes(bytes(data))
    capsys.readouterr()
    rc = main(
        [
            "pulse",
            "apply",
            str(d / "old.safetensors"),
            str(d / "bad.pulse"),
            "-o",
            str(d / "out.safetensors"),
        ]
    )
    assert rc == 2
    assert "corrupt" in _error_line(capsys)
    assert not (d / "out.safetensors").exists()
    assert not [p for p in d.iterdir() if p.name.startswith(".out")]


def test_apply_to_wrong_base_exits_2(checkpoints, capsys):
    d, _, _ = checkpoints
    main(
        [
            "pulse",
            "diff",
            str(d / "old.safetensors"),
            str(d / "new.safetensors"),
            "-o",
            str(d / "p.pulse"),
        ]
    )
    capsys.readouterr()
    rc = main(
        [
            "pulse",
            "apply",
            str(d / "new.safetensors"),
            str(d / "p.pulse"),
            "-o",
            str(d / "out.safetensors"),
        ]
    )
    assert rc == 2 and "wrong base" in _error_line(capsys)


def test_missing_and_non_safetensors_inputs(checkpoints, capsys):
    d, _, _ = checkpoints
    rc = main(
        [
            "pulse",
            "diff",
            str(d / "nope.safetensors"),
            str(d / "new.safetensors"),
            "-o",
            str(d / "p.pulse"),
        ]
    )
    assert rc == 2 and "no such file" in _error_line(capsys)
    (d / "junk.safetensors").write_bytes(b"not a checkpoint")
    rc = main(
        [
            "pulse",
            "diff",
            str(d / "junk.safetensors"),
            str(d / "new.safetensors"),
            "-o",
            str(d / "p.pulse"),
        ]
    )
    assert rc == 2 and "safetensors" in _error_line(capsys)
    assert not (d / "p.pulse").exists()


def test_run_rejects_bad_settings_in_one_line(tmp_path, capsys):
    assert main(["run", "--preset", "huge"]) == 2
    assert "unknown preset 'huge'" in _error_line(capsys)
    bad = tmp_path / "run.toml"
    bad.write_text("[trainer]\nlearnig_rate = 1\n")
    assert main(["run", "--config", str(bad)]) == 2
    assert "learnig_rate" in _error_line(capsys)
    assert main(["config", "show", "--preset", "smoke", "--workers", "5"]) == 0
    out = capsys.readouterr().out
    assert "workers = 5" in out and "[trainer]" in out and "[worker]" in out
