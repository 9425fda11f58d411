"""`colonnade worker --threads N`: the torch threads a worker computes with."""

import signal

import pytest
import torch

from colonnade.cli.main import main


@pytest.fixture
def keep_threads_and_signals():
    """A worker run in-process sets torch's threads and its signal handlers: put them back."""
    threads = torch.get_num_threads()
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield threads
    torch.set_num_threads(threads)
    for s, handler in saved.items():
        signal.signal(s, handler)


def _worker(store, *flags):
    return main(["worker", "--store", str(store), "--id", "w1", "--engine", "torch",
                 "--join-timeout", "0.2", "--poll-seconds", "0.05", *flags])  # fmt: skip


def test_threads_sets_torchs_threads_and_zero_leaves_them(
    tmp_path, capsys, keep_threads_and_signals
):
    before = keep_threads_and_signals
    target = 1 if before != 1 else 2
    # No run.json: the worker stops after its join timeout, its threads set.
    assert _worker(tmp_path / "run", "--threads", str(target)) == 2
    assert "no run.json" in capsys.readouterr().err
    assert torch.get_num_threads() == target
    torch.set_num_threads(before)
    assert _worker(tmp_path / "run") == 2  # the default: torch's own, unchanged
    assert torch.get_num_threads() == before


def test_negative_threads_are_refused_in_one_line(tmp_path, capsys):
    assert _worker(tmp_path / "run", "--threads", "-1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: threads must be >= 0"]
