"""The wheel as a worker machine gets it: built, installed with the worker's
extra only into a fresh virtual environment, and run from there.

What this catches: a module or package the wheel leaves out, a dependency the
code imports but pyproject.toml does not declare (the fresh environment shares
nothing with the development one: no --system-site-packages, no test extras),
a broken `colonnade` entry point, and the documented way in (a key, `colonnade
invite`, `colonnade worker --join`) failing outside the source tree.

What it needs, and why this way: pip installs the wheel's dependencies as a
worker's pip would, from the package index and the find-links pip is
configured with. On this project's machines torch's CPU build lies on disk
(pip's find-links) and the rest comes from PyPI or its local mirror, so
nothing reaches past the package index; a `--no-index` install from a local
wheelhouse was the other choice, but no machine here holds wheels of every
dependency (blake3 and MLX come from PyPI). Elsewhere on Linux, PyPI's torch
is a CUDA build of several GB: the test still holds, only slower. The wheel
is built from a copy of the tree with `--no-build-isolation` (the
development environment's setuptools), so a stale build/ folder cannot leak
into it. The fresh environment is deleted at the end: it takes a few GB.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from colonnade.protocol import keys
from colonnade.store import LocalStore

pytestmark = [pytest.mark.slow, pytest.mark.procs]

ROOT = Path(__file__).resolve().parent.parent


def _run(args, timeout, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)
    tail = f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert out.returncode == 0, f"{args[:4]}: exit {out.returncode}\n{tail}"
    return out


def _build_wheel(tmp: Path) -> Path:
    tree = tmp / "tree"
    shutil.copytree(ROOT / "src", tree / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))  # fmt: skip
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    _run([sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps", "--no-build-isolation",
          "-w", str(tmp / "dist")], 300)  # fmt: skip
    (wheel,) = (tmp / "dist").glob("colonnade-*.whl")
    return wheel


def _check_contents(wheel: Path) -> None:
    """Every module of the source tree is in the wheel, and the command too."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "colonnade = colonnade.cli.main:main" in z.read(info).decode()
    src = ROOT / "src"
    modules = {p.relative_to(src).as_posix() for p in src.rglob("*.py")}
    assert modules and modules <= names, sorted(modules - names)[:10]


def _env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    return {**env, "COLONNADE_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1"}


def _wait(cond, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    t0 = time.monotonic()
    while not cond():
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            raise AssertionError(f"no {what} (trainer: {proc.poll()})\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


@pytest.mark.timeout(1800)
def test_a_worker_installed_from_the_wheel_joins_a_run(tmp_path):
    wheel = _build_wheel(tmp_path)
    _check_contents(wheel)
    venv = tmp_path / "venv"
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    env = _env(tmp_path)
    trainer = None
    try:
        _run([sys.executable, "-m", "venv", str(venv)], 300)
        _run([str(bin_dir / "python"), "-m", "pip", "install", "--prefer-binary",
              f"{wheel}[mlx]"], 1200, env=env, cwd=tmp_path)  # fmt: skip
        py, colonnade = str(bin_dir / "python"), str(bin_dir / "colonnade")
        # The wheel's code, not the tree's; the worker's extra and nothing of the test extras.
        where = _run([py, "-c", "import colonnade, importlib.util as u; print(colonnade.__file__,"
                      " u.find_spec('mlx') is not None, u.find_spec('pytest') is None)"],
                     120, env=env, cwd=tmp_path).stdout.split()  # fmt: skip
        assert Path(where[0]).is_relative_to(venv) and where[1:] == ["True", "True"]
        helped = _run([colonnade, "worker", "--help"], 120, env=env, cwd=tmp_path).stdout
        assert "--join" in helped and "--threads" in helped

        # The README's way in: the worker makes a key, the operator registers
        # its .pub and hands it the run's join string.
        _run([colonnade, "keys", "new", "--id", "fresh", "--out", str(tmp_path / "wkeys")],
             120, env=env, cwd=tmp_path)  # fmt: skip
        (tmp_path / "pubkeys").mkdir()
        shutil.copy(tmp_path / "wkeys" / "fresh.pub", tmp_path / "pubkeys")
        run = tmp_path / "run"
        trainer = subprocess.Popen(
            [sys.executable, "-m", "colonnade.cli.main", "trainer", "--store", str(run),
             "--preset", "smoke", "--max-versions", "3", "--retain-all",
             "--worker-keys", str(tmp_path / "pubkeys")],
            stdout=(tmp_path / "trainer.log").open("w"), stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        store = LocalStore(run)
        _wait(lambda: store.exists(keys.LATEST), 300, "v0", trainer, tmp_path / "trainer.log")
        join = _run([colonnade, "invite", "--store", str(run)], 120, env=env, cwd=tmp_path)
        worker = _run([colonnade, "worker", "--join", join.stdout.strip(), "--key",
                       str(tmp_path / "wkeys" / "fresh.key"), "--max-batches", "1",
                       "--threads", "1"], 600, env=env, cwd=tmp_path)  # fmt: skip
        uploaded = [k for k in store.list(keys.INBOX) if k.startswith(f"{keys.INBOX}fresh/")]
        assert any(keys.parse_rollout_key(k.removeprefix(keys.INBOX)) for k in uploaded), (
            worker.stderr[-3000:]
        )
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.send_signal(signal.SIGTERM)
            try:
                trainer.wait(timeout=60)
            except subprocess.TimeoutExpired:
                trainer.kill()
                trainer.wait()
        shutil.rmtree(venv, ignore_errors=True)
