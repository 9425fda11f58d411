"""The Grafana dashboard's queries, answered by a real Prometheus scraping a live run.

Grafana cannot be installed here; Prometheus can (Debian's package). The
test starts a smoke run with exporters, points a Prometheus at them, and
sends every PromQL query of deploy/grafana/dashboards/colonnade.json
through Prometheus's HTTP API: each must return a finite value.
"""

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs  # separate processes: not in the fast lane

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "colonnade.json"


def _prometheus() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is missing in CI (.ci/run installs Debian's package)")
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    return binary


def _free_run_of_ports(n: int) -> int:
    for base in range(23400, 40000, 17):
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def _queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def _query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _finite(result: list) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


def test_promtool_accepts_the_shipped_config():
    _prometheus()
    p = subprocess.run(
        ["promtool", "check", "config", str(ROOT / "deploy" / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.timeout(400)
def test_every_dashboard_query_returns_data(tmp_path):
    binary = _prometheus()
    base = _free_run_of_ports(4)
    prom_port = base + 3
    (tmp_path / "prom.yml").write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: colonnade\n"
        "    static_configs:\n      - targets: ["
        + ", ".join(f"'127.0.0.1:{base + i}'" for i in range(3))
        + "]\n"
    )
    (tmp_path / "run.toml").write_text(
        "warmstart_steps = 20\neval_n = 0\n[trainer]\nmax_versions = 500\n"
    )
    env = {**os.environ, "COLONNADE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen(
        [sys.executable, "-m", "colonnade.cli.main", "run", "--preset", "smoke", "--no-live",
         "--config", str(tmp_path / "run.toml"), "--out", str(tmp_path / "run"),
         "--metrics-port", str(base)],
        env=env, stdout=subprocess.DEVNULL, stderr=(tmp_path / "run.log").open("w"),
    )  # fmt: skip
    prom = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prom.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "prom.log").open("w"),
    )  # fmt: skip
    missing = _queries()
    try:
        deadline = time.monotonic() + 300
        while missing and time.monotonic() < deadline:
            assert run.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(2)
            try:
                missing = [q for q in missing if not _finite(_query(prom_port, q))]
            except OSError:
                continue  # Prometheus still starting
    finally:
        run.send_signal(signal.SIGINT)
        prom.terminate()
        run.wait(timeout=120)
        prom.wait(timeout=30)
    assert not missing, f"queries with no data: {missing}"
