"""`colonnade bench pipeline --json`: stage-workers against one whole worker."""

import json

import pytest

from colonnade.bench.pipeline import predicted_steps_s
from colonnade.cli.main import main


def test_rows_per_stages_latency_and_in_flight(capsys):
    code = main(["bench", "pipeline", "--json", "--latency-ms", "0,5", "--in-flight", "1,2",
                 "--episodes", "4", "--tokens", "3", "--cores", "2"])  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [(r["stages"], r["latency_ms"], r["in_flight"]) for r in rows] == [
        (2, 0, 1), (2, 0, 2), (2, 5, 1), (2, 5, 2)
    ]  # fmt: skip
    for r in rows:
        assert r["episodes_s"] > 0 and r["single_episodes_s"] > 0
        assert r["predicted_episodes_s"] > 0 and r["cores"] == 2
        assert r["layers"][0][0] == 0 and r["layers"][0][1] == r["layers"][1][0]
        assert len(r["stage_rss_mb"]) == 1 and r["stage_rss_mb"][0] > 0


@pytest.mark.parametrize(
    "argv, why",
    [(["--stages", "1"], "--stages"), (["--in-flight", "0"], "--in-flight"),
     (["--latency-ms", "x"], "--latency-ms"), (["--episodes", "0"], "--episodes"),
     (["--cores", "0"], "--cores")],
)  # fmt: skip
def test_bad_arguments_are_refused(argv, why):
    with pytest.raises(SystemExit, match=why):
        main(["bench", "pipeline", *argv])


SHARES = [0.6, 0.4]  # two stages, the first with the larger share


@pytest.mark.parametrize("in_flight", [1, 2, 4, 8])
def test_one_core_lets_no_stage_compute_overlap(in_flight):
    # No hop: only compute paces the pipeline, and one core runs one step's
    # compute at a time however many micro-batches are in flight.
    assert predicted_steps_s(0.2, 0.0, in_flight, SHARES, cores=1) == pytest.approx(1 / 0.2)


def test_one_core_still_overlaps_hops_with_compute():
    # A hop is waiting, not compute: at 1 in flight the cycle paces it, at
    # 4 in flight the hops hide behind other micro-batches' compute.
    assert predicted_steps_s(0.2, 0.1, 1, SHARES, cores=1) == pytest.approx(1 / 0.4)
    assert predicted_steps_s(0.2, 0.1, 4, SHARES, cores=1) == pytest.approx(1 / 0.2)


@pytest.mark.parametrize("cores", [2, 3, 16])
@pytest.mark.parametrize("in_flight", [1, 2, 4, 8])
def test_a_core_per_stage_leaves_the_stages_own_bound(cores, in_flight):
    c, hop = 0.2, 0.05
    before = min(in_flight / (c + 2 * hop), 1 / (max(SHARES) * c))
    assert predicted_steps_s(c, hop, in_flight, SHARES, cores) == pytest.approx(before)


def test_fewer_cores_than_stages_cap_the_overlap_between():
    # 1.5 cores: more than one step's compute at once, less than 2 stages'.
    assert predicted_steps_s(0.2, 0.0, 8, [0.5, 0.5], cores=1.5) == pytest.approx(1.5 / 0.2)
