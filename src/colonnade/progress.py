"""Progress of long work: the warm start, the evaluations, the wait for the
first version, and large transfers (`Transfer`: anchors and checkpoint shards,
a line every 30 s while one runs).

Used by `colonnade run`, `colonnade eval` and `colonnade warmstart`. On a
terminal it is rich's bar. Anywhere else (output to a file, `--no-live`
under nohup, CI) a bar prints nothing until it ends, so lines are printed
instead: one at the first update (the work is under way, and how long it
is), then one every `every` seconds (default 30, `COLONNADE_PROGRESS_SECONDS`
sets it) from a background thread, whether or not a step ended in between
(one eval batch can take minutes on a loaded machine). Nothing is printed
before the work starts, so an error that stops it stays the only line:

    warm start: 120/800 (15%), loss 1.234, 2m10s elapsed, ETA 12m17s
"""

from __future__ import annotations

import os
import threading
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

EVERY_S = 30.0
EVERY_ENV = "COLONNADE_PROGRESS_SECONDS"


def interval() -> float:
    """Seconds between progress lines: COLONNADE_PROGRESS_SECONDS, else 30."""
    try:
        value = float(os.environ.get(EVERY_ENV, EVERY_S))
    except ValueError:
        return EVERY_S
    return value if value > 0 else EVERY_S


def progress_bar(console: Console) -> Progress:
    """The bar of long steps on a terminal: count, ETA and a free `info` field."""
    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        "{task.fields[info]}",
        console=console,
        transient=True,
    )


def duration(seconds: float) -> str:
    """`45s`, `2m10s`, `1h05m`."""
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Tracker:
    """`with Tracker("eval", 200) as p: ... p.update(50, "pass@1 0.420")`.

    `total` None: work of unknown length (no percentage, no ETA). `console`:
    where it goes (default stderr); lines when it is not a terminal.
    """

    def __init__(
        self,
        description: str,
        total: int | None,
        console: Console | None = None,
        every: float | None = None,
    ) -> None:
        self.description, self.total = description, total
        self.console = console or Console(stderr=True)
        self.every = interval() if every is None else every
        self.done, self.info = 0, ""
        self._bar: Progress | None = None
        self._task = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = time.monotonic()
        self._updated = False

    def update(self, done: int, info: str = "") -> None:
        self.done, self.info = done, info
        if self._bar is not None:
            self._bar.update(self._task, completed=done, info=info)
        elif not self._updated and self._thread is not None:
            self._print()
        self._updated = True

    def line(self, now: float | None = None) -> str:
        """`description: done/total (pct%), info, elapsed, ETA`."""
        elapsed = (time.monotonic() if now is None else now) - self._started
        parts = []  # no count when the length is unknown
        if self.total:
            parts = [f"{self.done}/{self.total} ({100 * self.done / self.total:.0f}%)"]
        if self.info:
            parts.append(self.info)
        parts.append(f"{duration(elapsed)} elapsed")
        if self.total and self.done > 0:
            parts.append(f"ETA {duration(elapsed * (self.total - self.done) / self.done)}")
        return f"{self.description}: " + ", ".join(parts)

    def __enter__(self) -> Tracker:
        self._started = time.monotonic()
        if self.console.is_terminal:
            self._bar = progress_bar(self.console)
            self._task = self._bar.add_task(self.description, total=self.total, info=self.info)
            self._bar.start()
        else:
            self._thread = threading.Thread(target=self._beat, daemon=True, name="progress")
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the bar or the lines; again is a no-op."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            self._print()

    def _print(self) -> None:
        out = self.console.file
        out.write(self.line() + "\n")
        out.flush()


# Transfers shorter than this say nothing: a patch, a small model's anchor.
TRANSFER_QUIET_BYTES = 64 << 20


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} GB"


def transfer_line(what: str, total: int, done: int | None, elapsed: float) -> str:
    """One line of a transfer under way: bytes so far where they can be seen."""
    if done is None:
        return f"{what}: {_size(total)}, {duration(elapsed)} so far"
    share = done / total if total else 0.0
    rate = done / elapsed if elapsed > 0 else 0.0
    return (
        f"{what}: {_size(done)} of {_size(total)} ({share:.0%}), {_size(rate)}/s, "
        f"{duration(elapsed)} elapsed"
    )


class Transfer:
    """A line every `interval()` seconds while a large download or upload runs
    (a worker fetching a multi-GB anchor otherwise says nothing for minutes),
    from a background thread, to `say` (a logger's info), and one when it
    ends; nothing for transfers under TRANSFER_QUIET_BYTES. `done()` gives
    the bytes so far where the caller can see them (a download's folder)."""

    def __init__(self, say, what: str, total: int, done=None, every: float | None = None):
        self.say, self.what, self.total, self.done = say, what, total, done
        self.every = every or interval()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def __enter__(self) -> Transfer:
        self._t0 = time.monotonic()
        if self.total >= TRANSFER_QUIET_BYTES:
            self._thread = threading.Thread(target=self._beat, daemon=True, name="transfer")
            self._thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if exc_type is None:
                elapsed = time.monotonic() - self._t0
                rate = self.total / elapsed if elapsed > 0 else 0.0
                self.say(f"{self.what}: {_size(self.total)} in {duration(elapsed)} "
                         f"({_size(rate)}/s)")  # fmt: skip

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            done = None
            if self.done is not None:
                try:
                    done = int(self.done())
                except OSError:  # the folder changed under us: say what is known
                    done = None
            self.say(transfer_line(self.what, self.total, done, time.monotonic() - self._t0))


def folder_bytes(folder) -> int:
    """Bytes of the files in `folder` (a download's own folder: what has arrived)."""
    from pathlib import Path

    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file())
