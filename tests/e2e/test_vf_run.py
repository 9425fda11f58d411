"""`colonnade run` with verifiers-shaped environments (tests/vf_envs), the whole path.

`colour` (one turn, a local rubric) learns through workers' in-process
endpoints, the store and the trainer, every reward recomputed by the
trainer. `lookup` (a tool, several turns) in a signed run: with the run's
workers trusted, every reward is theirs and no batch is refused (the
stitched episodes pass the draw check and the spot checks).
"""

import json
import os
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.procs, pytest.mark.slow]
TESTS = Path(__file__).resolve().parents[1]


def _run(tmp_path, *args, timeout=560):
    import subprocess

    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "COLONNADE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": path}  # fmt: skip
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "colonnade.cli.main", "run", "--preset", "smoke", "--out",
           str(out), "--no-live", *args]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((out / "report.json").read_text()), out


@pytest.mark.timeout(600)
def test_a_verifiers_environment_learns_through_the_whole_path(tmp_path):
    report, _ = _run(tmp_path, "--env", "vf:vf_envs.colour", "--max-versions", "16",
                     "--eval-n", "40")  # fmt: skip
    before, after = report["eval"]["before"], report["eval"]["after"]
    assert after["version"] == 16 and after["pass_at_1"] >= before["pass_at_1"] + 0.3
    rewards = report["rewards"]
    assert rewards["trusted"] == 0 and rewards["recomputed"] == report["episodes_consumed"] > 0
    assert not {"forged", "unclaimed"} & set(report["rejected_by_reason"])


@pytest.mark.timeout(600)
def test_unrecomputable_rewards_are_taken_from_the_trusted_workers(tmp_path):
    keys = tmp_path / "run" / "keys"  # the run makes its workers' keys there
    report, _ = _run(tmp_path, "--env", "vf:vf_envs.lookup", "--sign", "--no-warmstart",
                     "--max-versions", "3", "--eval-n", "0", "--trainer.max-episode-tokens",
                     "96", "--trainer.trusted-keys", str(keys))  # fmt: skip
    assert report["signed"] and report["versions_published"] == 3
    rewards = report["rewards"]
    assert rewards["recomputed"] == 0 and rewards["trusted"] == report["episodes_consumed"] > 0
    assert report["rejected_by_reason"] == {} and report["groups_rejected"] == 0
