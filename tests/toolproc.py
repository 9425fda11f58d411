"""A real tool service process (`colonnade tools serve`), for tests that kill it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent


class ServiceProcess:
    """`colonnade tools serve` in a process of its own, on a fixed port so that
    a restart is found where the run expects it."""

    def __init__(self, env: str, env_args: list[str], key: Path, port: int, timeout: float = 120,
                 flags: tuple[str, ...] = ()):  # fmt: skip
        """`flags`: more of `colonnade tools serve`'s (e.g. --latency-ms 200)."""
        self.args = [sys.executable, "-m", "colonnade", "tools", "serve", "--env", env,
                     "--key", str(key), "--port", str(port), *flags]  # fmt: skip
        for a in env_args:
            self.args += ["--env-arg", a]
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.url = self.key = ""

    def start(self) -> ServiceProcess:
        path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(self.args, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": path})  # fmt: skip
        t0 = time.monotonic()
        lines = []
        while time.monotonic() - t0 < self.timeout:
            line = self.proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            found = re.search(r"service=(\S+) --env-arg service_key=([0-9a-f]{64})", line)
            if found:
                self.url, self.key = found[1], found[2]
                # Read on, so that a full pipe never blocks the service.
                threading.Thread(target=self.proc.stderr.read, daemon=True).start()
                return self
        self.kill()
        raise RuntimeError(f"the tool service did not start: {''.join(lines)[-2000:]}")

    def kill(self) -> None:
        """SIGKILL: no goodbye, as a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()
