"""The Grafana dashboard's queries, answered by a real Prometheus scraping a live run.

Grafana cannot be installed here; Prometheus can (Debian's package). The
test starts a smoke run with exporters and `colonnade exporter` on its
store, points three Prometheus servers at them (every process; the
trainer alone; the store's exporter alone), and sends every PromQL query of
deploy/grafana/dashboards/colonnade.json through each one's HTTP API: each
must return a finite value. The two that never scrape a worker must still
hold every worker's series, read from the store.
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


def _scrape_config(path: Path, ports: list[int]) -> Path:
    path.write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: colonnade\n"
        "    static_configs:\n      - targets: ["
        + ", ".join(f"'127.0.0.1:{p}'" for p in ports)
        + "]\n"
    )
    return path


def _worker_ids(port: int) -> set[str]:
    result = _query(port, 'max by (id) (colonnade_tokens_total{role="worker"})')
    return {s["metric"]["id"] for s in result}


@pytest.mark.timeout(400)
def test_every_dashboard_query_returns_data(tmp_path):
    binary = _prometheus()
    base = _free_run_of_ports(7)
    store_port = base + 3  # `colonnade exporter`'s
    # Prometheus servers: every process's endpoint; the trainer's alone; the store's alone.
    scrapes = {
        "all": (base + 4, [base, base + 1, base + 2]),
        "trainer": (base + 5, [base]),
        "store": (base + 6, [store_port]),
    }
    (tmp_path / "run.toml").write_text(
        "warmstart_steps = 20\neval_n = 0\n[trainer]\nmax_versions = 500\n"
    )
    env = {**os.environ, "COLONNADE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "colonnade.cli.main", "run", "--preset", "smoke", "--no-live",
         "--config", str(tmp_path / "run.toml"), "--out", str(tmp_path / "run"),
         "--metrics-port", str(base)],
        env=env, stdout=subprocess.DEVNULL, stderr=(tmp_path / "run.log").open("w"),
    )]  # fmt: skip
    for name, (port, targets) in scrapes.items():
        procs.append(subprocess.Popen(
            [binary, f"--config.file={_scrape_config(tmp_path / f'{name}.yml', targets)}",
             f"--storage.tsdb.path={tmp_path / f'tsdb-{name}'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=(tmp_path / f"prom-{name}.log").open("w"),
        ))  # fmt: skip
    run = procs[0]
    missing = {name: _queries() for name in scrapes}
    workers = {name: set() for name in ("trainer", "store")}
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "run" / "store" / "run.json").exists():
            assert run.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no run.json"
            time.sleep(1)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "colonnade.cli.main", "exporter", str(tmp_path / "run"),
             "--metrics-port", str(store_port), "--interval", "1"],
            env=env, stdout=subprocess.DEVNULL, stderr=(tmp_path / "exporter.log").open("w"),
        ))  # fmt: skip
        done = False
        while not done and time.monotonic() < deadline:
            assert run.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert procs[-1].poll() is None, (tmp_path / "exporter.log").read_text()[-3000:]
            time.sleep(2)
            try:
                for name, (port, _) in scrapes.items():
                    missing[name] = [q for q in missing[name] if not _finite(_query(port, q))]
                for name in workers:
                    workers[name] = _worker_ids(scrapes[name][0])
            except OSError:
                continue  # Prometheus still starting
            done = not any(missing.values()) and all(w >= {"w1", "w2"} for w in workers.values())
    finally:
        procs[0].send_signal(signal.SIGINT)
        for p in procs[1:]:
            p.terminate()
        for p in procs:
            p.wait(timeout=120)
    assert not any(missing.values()), f"queries with no data: {missing}"
    # Workers whose own endpoints these two never scraped, each under its id.
    assert workers == {"trainer": {"w1", "w2"}, "store": {"w1", "w2"}}, workers
