"""`colonnade bench pipeline --json`: stage-workers against one whole worker."""

import json

import pytest

from colonnade.bench.pipeline import predicted_steps_s
from colonnade.cli.main import main


def test_rows_per_stages_latency_link_and_in_flight(capsys):
    code = main(["bench", "pipeline", "--json", "--latency-ms", "0,5", "--in-flight", "1,2",
                 "--episodes", "4", "--tokens", "3", "--cores", "2",
                 "--link", "store,tcp"])  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [(r["stages"], r["latency_ms"], r["link"], r["in_flight"]) for r in rows] == [
        (2, lat, link, m) for lat in (0, 5) for link in ("store", "tcp") for m in (1, 2)
    ]  # fmt: skip
    for r in rows:
        assert r["episodes_s"] > 0 and r["single_episodes_s"] > 0
        assert r["predicted_episodes_s"] > 0 and r["cores"] == 2
        trips = 2.5 * r["latency_ms"] / 1000 if r["link"] == "store" else 0
        assert r["step_s"] > 0 and r["hop_s"] >= trips
        assert 0 < r["message_s"] <= r["hop_s"]
        assert sum(r["shares"]) == pytest.approx(1, abs=0.01)
        assert r["layers"][0][0] == 0 and r["layers"][0][1] == r["layers"][1][0]
        assert len(r["stage_rss_mb"]) == 1 and r["stage_rss_mb"][0] > 0


@pytest.mark.parametrize(
    "argv, why",
    [(["--stages", "1"], "--stages"), (["--in-flight", "0"], "--in-flight"),
     (["--latency-ms", "x"], "--latency-ms"), (["--episodes", "0"], "--episodes"),
     (["--cores", "0"], "--cores"), (["--link", "udp"], "--link")],
)  # fmt: skip
def test_bad_arguments_are_refused(argv, why):
    with pytest.raises(SystemExit, match=why):
        main(["bench", "pipeline", *argv])


SHARES = [0.6, 0.4]  # two stages, the first with the larger share


def before(step_s, hop_s, in_flight, shares):
    """The model before it counted cores: every stage on a core of its own."""
    cycle = step_s + len(shares) * hop_s
    return min(in_flight / cycle, 1 / (max(shares) * step_s))


@pytest.mark.parametrize("in_flight", [1, 2, 4, 8])
def test_one_core_lets_no_stage_compute_overlap(in_flight):
    # No hop: only compute paces the pipeline, and one core runs one step's
    # compute at a time however many micro-batches are in flight.
    assert predicted_steps_s(0.2, 0.0, in_flight, SHARES, cores=1) == pytest.approx(1 / 0.2)


def test_one_core_still_overlaps_hops_with_compute():
    # A hop is waiting, not compute: at 1 in flight the cycle paces it; with
    # more in flight the hops hide behind other micro-batches' compute, up
    # to one step's compute at a time and no further.
    rates = [predicted_steps_s(0.2, 0.1, m, SHARES, cores=1) for m in (1, 2, 4, 64)]
    assert rates[0] == pytest.approx(1 / 0.4)
    assert rates == sorted(rates) and rates[-1] <= 1 / 0.2
    assert rates[-1] == pytest.approx(1 / 0.2, rel=0.01)


@pytest.mark.parametrize("cores", [2, 3, 16])
def test_a_core_per_stage_has_the_stages_own_bound_at_its_ends(cores):
    c, hop = 0.2, 0.05
    for m in (1, 1000):
        assert predicted_steps_s(c, hop, m, SHARES, cores) == pytest.approx(
            before(c, hop, m, SHARES), rel=0.01
        )
    # Between, micro-batches wait on each other for a core at times.
    for m in (2, 4, 8):
        assert predicted_steps_s(c, hop, m, SHARES, cores) <= before(c, hop, m, SHARES)


def test_fewer_cores_than_stages_cap_the_overlap_between():
    # 1.5 cores: more than one step's compute at once, less than 2 stages'.
    assert predicted_steps_s(0.2, 0.0, 1000, [0.5, 0.5], cores=1.5) == pytest.approx(
        1.5 / 0.2, rel=0.01
    )
    assert predicted_steps_s(0.2, 0.0, 1, [0.5, 0.5], cores=1.5) == pytest.approx(1 / 0.2)


def test_a_messages_packing_queues_for_the_cores_its_round_trips_do_not():
    # Hops of 0.05 s, all of it a message's own compute: on one core the
    # pipeline runs no faster than a step plus both messages, one at a time.
    rate = predicted_steps_s(0.2, 0.05, 64, SHARES, cores=1, message_s=0.05)
    assert rate == pytest.approx(1 / 0.3, rel=0.01)
    # The same hops as round trips alone hide behind the compute.
    assert predicted_steps_s(0.2, 0.05, 64, SHARES, cores=1) == pytest.approx(1 / 0.2, rel=0.01)
