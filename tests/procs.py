"""Separate processes for the end-to-end tests: a colonnade command (or a
script) started with its output in a log, and a wait that fails as soon as
one of the processes it watches dies."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def spawn(args, log: Path, env, script: str | None = None, append: bool = False):
    """`colonnade ARGS` (or `python SCRIPT ARGS`), stdout and stderr to `log`."""
    cmd = [sys.executable, script] if script else [sys.executable, "-m", "colonnade.cli.main"]
    out = log.open("a" if append else "w")
    return subprocess.Popen([*cmd, *args], stdout=out, stderr=subprocess.STDOUT, env=env)


def wait_until(cond, timeout: float, what: str, procs=()) -> None:
    """Poll `cond` until true; AssertionError after `timeout` s, or as soon
    as one of `procs` exits with an error."""
    t0 = time.monotonic()
    while not cond():
        for p in procs:
            if p.poll() not in (None, 0):
                raise AssertionError(f"{what}: a process exited with {p.returncode}")
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
