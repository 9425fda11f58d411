"""The run's child processes: one trainer and N workers, each its own session.

Children get their own process group so a Ctrl-C in the terminal reaches
only the launcher, which then stops them in order: workers finish the batch
in flight, the trainer finishes its version and checkpoints. Anything still
alive after the grace period is killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def spawn(name: str, args: list[str], log_dir: Path, threads: int, ranks: int = 1) -> Child:
    """`colonnade ARGS` as a child process, its output in log_dir/name.log.

    With `ranks` > 1, under torchrun (one node, a free port): SIGTERM to the
    child reaches torchrun, which passes it to every rank.
    """
    log = log_dir / f"{name}.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    head = [sys.executable, "-m", "colonnade.cli.main"]
    if ranks > 1:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(ranks), "-m", "colonnade"]  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [*head, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    return Child(name, proc, log)


def stop_all(children: list[Child], grace: float = 30.0) -> None:
    """SIGTERM every live child, wait up to `grace` s in all, then SIGKILL."""
    for c in children:
        if c.alive:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def wait_exit(children: list[Child], timeout: float) -> bool:
    """True when every child exited within `timeout` s."""
    deadline = time.monotonic() + timeout
    while any(c.alive for c in children):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within: SIGTERM and SIGHUP on the launcher act as Ctrl-C.

    Left at their defaults they end the launcher at once, and its children,
    each in a session of its own, would train and generate on unwatched.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    caught = (signal.SIGTERM, signal.SIGHUP)

    def interrupt(signum, frame):
        # Once: a second signal must not cut short the stopping of the children.
        for s in caught:
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt

    old = {s: signal.signal(s, interrupt) for s in caught}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


class EarlyStop:
    """Whether the run should end before max_versions: its wall-clock budget is
    spent, or Ctrl-C was pressed once while `catching()`.

    The launcher polls `reason()` while the trainer runs and, on one, tells the
    trainer to stop after the version in flight (SIGTERM: it checkpoints and
    exits), then still exports and evaluates the newest version. Within
    `catching()` the first SIGINT only records the request; a second raises
    KeyboardInterrupt, which aborts as before: every child stopped, no export.
    """

    BUDGET, INTERRUPT = "budget", "interrupt"

    def __init__(self, max_minutes: float | None = None, clock=time.monotonic) -> None:
        self.clock = clock
        self.deadline = None if max_minutes is None else clock() + 60.0 * max_minutes
        self.interrupted = False

    def reason(self) -> str | None:
        """INTERRUPT, BUDGET or None."""
        if self.interrupted:
            return self.INTERRUPT
        if self.deadline is not None and self.clock() >= self.deadline:
            return self.BUDGET
        return None

    def interrupt(self) -> None:
        """A Ctrl-C: the first is a request, the second aborts."""
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True

    @contextlib.contextmanager
    def catching(self) -> Iterator[None]:
        """Within: SIGINT calls `interrupt` (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = signal.signal(signal.SIGINT, lambda signum, frame: self.interrupt())
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, old)
