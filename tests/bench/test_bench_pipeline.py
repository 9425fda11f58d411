"""`colonnade bench pipeline --json`: stage-workers against one whole worker."""

import json

import pytest

from colonnade.cli.main import main


def test_rows_per_stages_latency_and_in_flight(capsys):
    code = main(["bench", "pipeline", "--json", "--latency-ms", "0,5", "--in-flight", "1,2",
                 "--episodes", "4", "--tokens", "3"])  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [(r["stages"], r["latency_ms"], r["in_flight"]) for r in rows] == [
        (2, 0, 1), (2, 0, 2), (2, 5, 1), (2, 5, 2)
    ]  # fmt: skip
    for r in rows:
        assert r["episodes_s"] > 0 and r["single_episodes_s"] > 0
        assert r["predicted_episodes_s"] > 0
        assert r["layers"][0][0] == 0 and r["layers"][0][1] == r["layers"][1][0]
        assert len(r["stage_rss_mb"]) == 1 and r["stage_rss_mb"][0] > 0


@pytest.mark.parametrize(
    "argv, why",
    [(["--stages", "1"], "--stages"), (["--in-flight", "0"], "--in-flight"),
     (["--latency-ms", "x"], "--latency-ms"), (["--episodes", "0"], "--episodes")],
)  # fmt: skip
def test_bad_arguments_are_refused(argv, why):
    with pytest.raises(SystemExit, match=why):
        main(["bench", "pipeline", *argv])
