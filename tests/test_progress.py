"""Progress of long work: rich's bar on a terminal, else a line every few seconds."""

import io
import time

from rich.console import Console

from colonnade.progress import Tracker, duration, interval


def _lines(out: io.StringIO) -> list[str]:
    return [line for line in out.getvalue().splitlines() if line]


def test_off_a_terminal_a_line_at_the_first_update_then_every_interval():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False)
    with Tracker("warm start", 10, console, every=0.05) as p:
        assert out.getvalue() == ""  # nothing before the work is under way
        p.update(1, "loss 2.000")
        p.update(3, "loss 1.234")
        time.sleep(0.3)  # no update in between: lines keep coming
    lines = _lines(out)
    assert lines[0].startswith("warm start: 1/10 (10%), loss 2.000, 0s elapsed")
    assert 3 <= len(lines) <= 8, lines  # at most one per interval
    assert lines[-1].startswith("warm start: 3/10 (30%), loss 1.234, 0s elapsed, ETA 0s")
    n = len(_lines(out))
    time.sleep(0.15)
    assert len(_lines(out)) == n  # nothing after the work ended


def test_the_line_has_step_total_metric_and_eta():
    p = Tracker("eval before", 200, Console(file=io.StringIO()), every=30)
    p.update(50, "pass@1 0.420")
    assert p.line(now=p._started + 130) == (
        "eval before: 50/200 (25%), pass@1 0.420, 2m10s elapsed, ETA 6m30s"
    )
    unknown = Tracker("waiting for v1", None, Console(file=io.StringIO()))
    unknown.update(0, "2 workers alive")
    assert unknown.line(now=unknown._started + 3700) == (
        "waiting for v1: 2 workers alive, 1h01m elapsed"
    )


def test_on_a_terminal_the_bar_and_no_lines():
    out = io.StringIO()
    with Tracker("eval", 4, Console(file=out, force_terminal=True), every=0.01) as p:
        p.update(2, "pass@1 0.500")
        time.sleep(0.05)
    assert "eval: 0/4" not in out.getvalue()


def test_interval_and_durations(monkeypatch):
    monkeypatch.delenv("COLONNADE_PROGRESS_SECONDS", raising=False)
    assert interval() == 30.0
    monkeypatch.setenv("COLONNADE_PROGRESS_SECONDS", "0.5")
    assert interval() == 0.5
    monkeypatch.setenv("COLONNADE_PROGRESS_SECONDS", "soon")
    assert interval() == 30.0
    assert [duration(s) for s in (0, 59.9, 61, 3599, 7260)] == [
        "0s",
        "59s",
        "1m01s",
        "59m59s",
        "2h01m",
    ]


def test_a_long_transfer_says_how_far_it_is_and_a_small_one_nothing(tmp_path):
    import time

    from colonnade.progress import TRANSFER_QUIET_BYTES, Transfer, folder_bytes

    said: list[str] = []
    total = 4 * TRANSFER_QUIET_BYTES
    with Transfer(said.append, "downloading v3's anchor", total, lambda: folder_bytes(tmp_path),
                  every=0.05):  # fmt: skip
        (tmp_path / "part").write_bytes(b"x" * 1000)
        time.sleep(0.3)
    assert len(said) >= 3
    assert "1.0 KB of 268.4 MB (0%)" in said[0] and said[0].startswith("downloading v3's anchor")
    assert said[-1].startswith("downloading v3's anchor: 268.4 MB in ")  # the end, with a rate
    quiet: list[str] = []
    with Transfer(quiet.append, "a patch", TRANSFER_QUIET_BYTES - 1, every=0.01):
        time.sleep(0.1)
    assert quiet == []
    # Where the bytes cannot be seen (an upload), the time so far.
    up: list[str] = []
    with Transfer(up.append, "uploading", total, every=0.05):
        time.sleep(0.12)
    assert up[0] == "uploading: 268.4 MB, 0s so far"
