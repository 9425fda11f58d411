"""Coverage-guided fuzzing (atheris) of the PULSE decoder and the rollout parser.

Each target in fuzz_targets.py runs in its own process for SECONDS, seeded
with valid inputs; a process that exits non-zero found an input raising
something other than the parser's typed error (or hanging past -timeout),
and libFuzzer writes that input under the test's tmp_path as crash-*.
Without atheris the test fails in CI and is skipped elsewhere.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs  # separate processes: not in the fast lane

TARGETS = Path(__file__).with_name("fuzz_targets.py")
SECONDS = 10  # per target


def _require_atheris() -> None:
    probe = subprocess.run([sys.executable, "-c", "import atheris"], capture_output=True, text=True)
    if probe.returncode == 0:
        return
    last = (probe.stderr.strip().splitlines() or ["?"])[-1]
    why = f"atheris does not import ({last}); pip install -e '.[test]'"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.mark.timeout(SECONDS + 90)
@pytest.mark.parametrize("target", ["patch", "batch"])
def test_fuzz_target_finds_no_crash(tmp_path, target):
    _require_atheris()
    cmd = [sys.executable, str(TARGETS), target, str(tmp_path / "corpus"),
           f"-max_total_time={SECONDS}", "-timeout=10", "-rss_limit_mb=4096",
           f"-artifact_prefix={tmp_path}/"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=SECONDS + 80)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    runs = re.search(r"Done (\d+) runs in (\d+) second", log)
    assert runs and int(runs[1]) > 100, log[-2000:]  # it did fuzz, not just start
    print(f"{target}: {runs[1]} executions in {runs[2]} s")
