"""`colonnade bench batches --quick --json`: one row per format, each with its
bytes and times, and every format decoding to the same content and digests."""

import json

from colonnade.cli.main import main


def test_quick_batches_bench_prints_a_row_per_format(capsys):
    assert main(["bench", "batches", "--quick", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["format"] for r in rows] == ["json", "binary", "binary-raw"]
    for r in rows:
        assert r["bytes"] > 0 and r["raw_bytes"] >= r["bytes"]
        assert r["tokens"] == 2 * 4 * 64 and r["episodes"] == 8
        assert r["encode_ms"] >= 0 and r["decode_ms"] >= 0  # no timing assertions beyond that
        assert r["same_content"] and r["same_digests"]
    old, binary, raw = rows
    assert binary["raw_bytes"] == raw["bytes"] and old["bound_bytes"] > 0
    # the wire format is bounded by what the trainer sets for such a batch
    assert binary["raw_bytes"] <= binary["bound_bytes"]


def test_the_table_names_every_format(capsys):
    assert main(["bench", "batches", "--quick"]) == 0
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name in ("json", "binary", "binary-raw"))
