"""bench fleet: a small fleet (8 workers, 6 versions, churn) through the real
trainer and the real worker loop; what the views count is what the store saw."""

import json

import pytest

from colonnade.bench.fleet.analysis import per_version, summarize, trained_by_source
from colonnade.bench.fleet.costs import cost_model
from colonnade.bench.fleet.options import FleetOptions
from colonnade.bench.fleet.simulation import run_fleet
from colonnade.bench.fleet.wan import Link, Tally, WanStore
from colonnade.cli.main import main
from colonnade.store import LocalStore
from colonnade.store.counting import Counting

KEYS = (
    "follower_anchor_downloads", "requests_per_worker_per_version", "waste_fraction",
    "objects_after_warmup", "objects_peak", "objects_end", "trainer_wait_fraction",
    "joiner_bytes", "joiner_seconds",
)  # fmt: skip


def test_a_small_fleet_counts_add_up(tiny_dir, tmp_path):
    opts = FleetOptions(workers=8, versions=6, latency_ms=5.0, bandwidth_mbit=200.0,
                        churn=0.25, gen_seconds=0.05, groups_per_step=8, anchor_every=3,
                        model=tiny_dir)  # fmt: skip
    below: list[Counting] = []
    res = run_fleet(opts, tmp_path, wrap=lambda s: below.append(Counting(s)) or below[0])
    s = summarize(res)
    assert set(KEYS) <= set(s) and s["worker_errors"] == 0 and not s["stopped_early"]

    # Every request a view counted reached the store once (deletes aside: the
    # views count S3's 1,000-key batches, the counter underneath single keys).
    seen = Counting(LocalStore(tmp_path / "x")).counts
    for counts in res.tally.snapshot()["requests"].values():
        seen.update(counts)
    for verb in ("get", "put", "put_if_absent", "list", "put_file", "get_file"):
        assert seen[verb] == below[0].counts[verb], verb

    # Followers never read an anchor; each worker read one, when it joined.
    anchors = res.tally.snapshot()["anchors"]
    workers = [c for c in anchors if c.startswith("sim-")]
    assert s["follower_anchor_downloads"] == 0
    assert all(anchors[c] == 1 for c in workers)
    rows = per_version(res)
    assert [r["version"] for r in rows] == list(range(1, 7))
    joined = sum(r["joined"] for r in rows)
    assert joined >= 5 and len(res.tally.requests) >= 8 + joined  # churn brought new ids

    # The trainer took each step's groups; waste is what it never took.
    assert (
        s["groups_trained"]
        == 6 * 8
        == sum(r["groups_trained"] for r in rows)
        + sum(n for v, n in trained_by_source(res.rows).items() if v == 0)
    )
    assert s["groups_uploaded"] >= s["groups_trained"]
    assert s["waste_fraction"] == pytest.approx(1 - 48 / s["groups_uploaded"], abs=1e-4)
    assert 0 <= s["trainer_wait_fraction"] <= 1
    polls = s["latest_polls_per_worker_per_version"]
    assert 0 < polls <= s["requests_per_worker_per_version_by_verb"]["get"]

    # The joiner came from nothing: run.json, model files, one anchor, patches.
    j = s["joiner"]
    assert j["version"] == 6 and j["anchors"] == 1 and j["patches"] == 0  # v6 is an anchor
    assert s["joiner_bytes"] > s["joiner_weight_bytes"] >= s["full_bytes"] > 0
    assert s["objects_peak"] >= s["objects_after_warmup"] > 0 and s["objects_end"] > 0

    cost = cost_model(s, opts)
    assert cost["r2"]["egress"] == 0 and cost["s3"]["total"] > cost["s3"]["egress"] > 0


def test_a_view_adds_its_round_trip_and_bandwidth(tmp_path):
    tally = Tally()
    store = WanStore(LocalStore(tmp_path), "w", tally, Link(0.0, 8.0))  # 1 MB/s
    store.put("a/b", b"x" * 1000)
    assert store.get("a/b") == b"x" * 1000 and store.list("a/") == ["a/b"]
    snap = tally.snapshot()
    assert dict(snap["requests"]["w"]) == {"put": 1, "get": 1, "list": 1}
    store.put("weights/latest.json", b"{}")
    store.get("weights/latest.json")
    assert tally.snapshot()["polls"]["w"] == 1  # latest.json reads, among the gets
    assert snap["down"]["w"] == snap["up"]["w"] == 1000
    link = Link(0.05, 8.0)
    assert link.delay(0) == pytest.approx(0.05)
    assert link.delay(500_000) == pytest.approx(0.55, abs=0.01)
    # A second transfer on the same line queues behind the first.
    assert link.delay(500_000) == pytest.approx(1.05, abs=0.01)


def test_bad_input_is_one_line_and_exit_2(capsys):
    assert main(["bench", "fleet", "--workers", "0", "--churn", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: out of range: --workers >= 1; --churn in [0, 1]"]


def test_the_summary_is_the_last_line(tiny_dir, tmp_path, capsys):
    rc = main(["bench", "fleet", "--workers", "2", "--versions", "2", "--latency-ms", "0",
               "--gen-seconds", "0", "--groups-per-step", "2", "--baseline-workers", "0",
               "--model", tiny_dir, "--out", str(tmp_path), "--json"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert set(KEYS) <= set(summary) and summary["versions"] == 2
    assert "cost_per_1000_versions" in summary and "targets" in summary
