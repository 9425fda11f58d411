"""The README's walk-through of a fleet ("A fleet over R2, S3 or SeaweedFS,
step by step"), command by command, on one machine.

Every command comes from the README itself: the fenced block after each
`<!-- deploy: NAME -->` marker, run as written through bash with the
variables of its step 1 set, so the README and this test cannot drift (a
command renamed, a flag dropped, a step reordered or a variable renamed
there fails here). Each machine is a folder of its own (the GPU box,
laptop-1, laptop-2) with its own cache; they share nothing but the store.

Where the test departs from the letter of the README, and why:
- the store is the session's SeaweedFS (the `seaweed` fixture, on free
  ports) rather than the README's `weed mini` on the default ones, which
  other tests' servers may hold: that line is checked, not run;
- `scp FILE HOST:DIR` is a copy from the worker's folder into the box's;
- the second worker runs laptop-1's commands with its id replaced, and
  registers its key after the trainer started (the README's "joins the
  running run with no restart");
- flags are appended for speed and ports, the last of a repeated flag
  winning: `--threads 1` on the workers, `--metrics-host 127.0.0.1
  --metrics-port P --interval 1` on the exporter, `-n 4` on eval; step 8
  names the newest version published instead of the README's;
- the fleet is stopped with SIGTERM (what Ctrl-C does) before step 8, so the
  export and the eval do not share the cores with it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from colonnade.protocol import keys, latest_version
from colonnade.protocol.inbox import list_inbox
from colonnade.protocol.reader import open_run
from colonnade.store import open_store
from ports import free_port

pytestmark = [pytest.mark.procs, pytest.mark.s3]

README = Path(__file__).resolve().parents[2] / "README.md"
STEPS = ["store", "trainer-key", "worker-key", "trainer", "invite", "worker", "status",
         "exporter", "model"]  # fmt: skip
_BLOCK = re.compile(r"<!-- deploy: ([a-z-]+) -->\n```sh\n(.*?)```", re.S)
WORKERS = ("laptop-1", "laptop-2")


def readme_steps(text: str) -> dict[str, list[str]]:
    """Each marked block's commands: continued lines joined, comments dropped."""
    steps = {}
    for name, body in _BLOCK.findall(text):
        body = re.sub(r"\\\n\s*", " ", body)
        lines = (re.sub(r"(^|\s+)#.*$", "", line).strip() for line in body.splitlines())
        steps[name] = [line for line in lines if line]
    return steps


@dataclass
class Machine:
    """A folder standing for one machine: its commands run there, with its own cache."""

    name: str
    dir: Path
    env: dict[str, str]

    def sh(self, line: str, timeout: float = 300) -> str:
        out = subprocess.run(["bash", "-c", line], cwd=self.dir, env=self.env, text=True,
                             capture_output=True, timeout=timeout)  # fmt: skip
        assert out.returncode == 0, f"{self.name}: {line}\n{out.stdout[-2000:]}{out.stderr[-3000:]}"
        return out.stdout

    def start(self, line: str, log: str) -> subprocess.Popen:
        """A long-running command; `exec` so that a signal reaches it, not bash."""
        with (self.dir / log).open("w") as out:  # the child holds its own copy
            return subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=self.dir, env=self.env,
                                    stdout=out, stderr=subprocess.STDOUT)  # fmt: skip


def _copy(line: str, src: Machine, dst: Machine) -> None:
    """`scp FILE HOST:DIR`, between two machines' folders."""
    _, file, target = shlex.split(line)
    shutil.copy(src.dir / file, dst.dir / target.split(":", 1)[1])


def _run(line: str, on: Machine, box: Machine) -> None:
    if line.startswith("scp "):
        _copy(line, on, box)
    else:
        on.sh(line)


def _wait(cond, timeout: float, what: str, procs: dict[str, tuple[subprocess.Popen, Path]]):
    deadline = time.monotonic() + timeout
    while not cond():
        for name, (p, log) in procs.items():
            assert p.poll() is None, f"{what}: {name} exited\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return ""


def _stop(procs: dict[str, tuple[subprocess.Popen, Path]], names) -> None:
    for name in names:
        procs[name][0].send_signal(signal.SIGTERM)
    for name in names:
        p, _ = procs.pop(name)
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.mark.timeout(600)  # a few minutes on 2 cores; a loaded machine may take longer
def test_the_readmes_walkthrough_runs_command_by_command(tmp_path, seaweed, monkeypatch):
    steps = readme_steps(README.read_text())
    assert list(steps) == STEPS

    # 1. The store: the README's variables, set here to the test's server.
    run = f"deploy-{uuid.uuid4().hex[:8]}"
    variables = {"STORE": f"s3://{seaweed.bucket}/{run}",
                 "INBOX": f"s3://{seaweed.bucket}/{run}-inbox",
                 "S3": seaweed.endpoint, **seaweed.env()}  # fmt: skip
    exports = [line for line in steps["store"] if line.startswith("export ")]
    named = {n for line in exports for n in re.findall(r"(\w+)=", line)}
    assert named == set(variables) - {"AWS_DEFAULT_REGION"}
    (weed,) = [line for line in steps["store"] if line not in exports]
    assert weed.startswith("weed mini ") and "-bucket=" in weed
    for k, v in variables.items():
        monkeypatch.setenv(k, v)
    bin_dir = str(Path(sys.executable).parent)
    assert shutil.which("colonnade", path=bin_dir), "the `colonnade` entry point is not installed"
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    base.pop("AWS_PROFILE", None)
    base.update(variables, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1")

    def machine(name: str) -> Machine:
        home = tmp_path / name
        home.mkdir()
        return Machine(name, home, {**base, "COLONNADE_CACHE": str(home / "cache")})

    box, laptops = machine("gpu-box"), [machine(w) for w in WORKERS]
    store = open_store(variables["STORE"], endpoint_url=seaweed.endpoint)
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}

    def start(on: Machine, line: str, name: str) -> None:
        procs[name] = (on.start(line, f"{name}.log"), on.dir / f"{name}.log")

    def as_worker(line: str, laptop: Machine) -> str:
        return line.replace("laptop-1", laptop.name)

    try:
        # 2-4. The trainer's key, the first worker's key sent to the box, the trainer.
        for line in steps["trainer-key"]:
            _run(line, box, box)
        for line in steps["worker-key"]:
            _run(line, laptops[0], box)
        (trainer,) = steps["trainer"]
        start(box, trainer, "trainer")
        _wait(lambda: store.exists(keys.RUN), 180, "run.json", procs)

        # 5. The join string.
        (invite,) = steps["invite"]
        join = box.sh(invite).strip()
        assert join.startswith("colonnade1:") and "\n" not in join

        # 6. The workers: laptop-2's key reaches the box after the trainer started.
        (worker,) = steps["worker"]
        assert "colonnade1:…" in worker
        worker = worker.replace("colonnade1:…", join) + " --threads 1"
        start(laptops[0], worker, "laptop-1")
        for line in steps["worker-key"]:
            _run(as_worker(line, laptops[1]), laptops[1], box)
        start(laptops[1], as_worker(worker, laptops[1]), "laptop-2")

        view = open_run(store, endpoint_url=seaweed.endpoint)

        def working() -> bool:
            listing = list_inbox(view.inbox)
            return (set(listing.heartbeats) >= set(WORKERS)
                    and set(listing.segments) >= set(WORKERS)
                    and (latest_version(store, view.trust) or 0) >= 2)  # fmt: skip

        _wait(working, 300, "both workers' heartbeats and rows, and v2", procs)

        # 7. Watching: the table, the JSON document, the Prometheus endpoint.
        table, as_json = steps["status"]
        text = box.sh(table, 120)
        assert all(w in text for w in WORKERS), text
        doc = json.loads(box.sh(as_json, 120))
        by_id = {w["id"]: w for w in doc["workers"]}
        assert set(by_id) == set(WORKERS), doc
        assert all(w["state"] == "active" and w["version"] is not None for w in by_id.values())
        assert doc["version"] >= 2 and doc["workers_active"] == 2 and doc["done"] is False

        (exporter,) = steps["exporter"]
        port = free_port()
        start(box, f"{exporter} --metrics-host 127.0.0.1 --metrics-port {port} --interval 1",
              "exporter")  # fmt: skip
        series = ['id="main",role="trainer"', *(f'id="{w}",role="worker"' for w in WORKERS)]
        _wait(lambda: all(s in _scrape(port) for s in series), 120,
              "the exporter serving the trainer and both workers", procs)  # fmt: skip

        # 8. The model: the newest version once the fleet has stopped.
        _stop(procs, ["exporter", "laptop-1", "laptop-2", "trainer"])
        newest = latest_version(store, view.trust)
        export, evaluate = steps["model"]
        shown = re.search(r"@v(\d+)", export)[1]  # the README's version, here the newest
        folder = box.dir / f"model-v{newest}"
        box.sh(export.replace(f"v{shown}", f"v{newest}"))
        out = box.sh(evaluate.replace(f"v{shown}", f"v{newest}") + " -n 4", 300)
        assert f"v{newest}, int8; pass@1:" in out and "sampled" in out, out
    finally:
        for p, _ in procs.values():
            p.kill()
            p.wait()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = AutoTokenizer.from_pretrained(folder)("the answer is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
