"""The import graph of src/colonnade shows the roles, with data flowing one way.

Floors, bottom up (a package imports only from floors below it, or from
itself):

1. foundations: `choices` (the named choices several layers check) and
   `untrusted` (bounds and checks of input from strangers), which import
   nothing of colonnade and which every package may use; `background`,
   `config`, `httpjson` (bounded JSON bodies over HTTP), `progress`,
   `store`, `tools` (an environment's tool served over HTTP, its replies
   signed, over httpjson) (none imports another colonnade package but
   those two, and tools httpjson), `envs` (which may also call a tool service), then `pulse`
   (the weight codec) and `model` (the networks, over pulse's codes);
2. `protocol`: everything the trainer and the workers share: keys, typed
   documents, the rollout batch, weight versions, the model files, the
   episode contract (`protocol/turns.py`). It imports no role's `config`:
   the wire does not depend on how a role is set up;
3. `telemetry`: metric rows written and read, over protocol; `engine`: the
   rollout engine (episodes over a pluggable backend), over protocol's
   episode contract;
4. `serve`, the engine behind an OpenAI-compatible endpoint; then the two
   sides, which never import each other and which serve imports neither of:
   `rollout` (the worker, which runs an environment that calls a model over
   that API against an endpoint in its own process) and `train` (the
   trainer);
5. `report`: reads a run's store through protocol and telemetry, whichever
   side wrote it; it imports neither side;
6. `operate` works on a run from the outside (its status, from the store
   as the report reads it; a published version taken out as a model
   folder, rebuilt as a worker rebuilds it); `launch` composes a run (it
   starts the sides, evaluates, reports) and takes its final model out
   through `operate`, which never imports it;
7. `cli` and `bench`, the entrypoints.

And one rule across floors: a side's role module (`rollout.worker`,
`train.trainer`) is run by the CLI; nothing else outside its package imports
it (its config lives in `config`; what both sides need belongs in protocol).
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "colonnade"

BASE = {"choices", "untrusted"}  # import nothing; every package may import them
FOUNDATIONS = BASE | {"background", "config", "httpjson", "progress", "store", "tools", "envs"}
_BELOW_PROTOCOL = FOUNDATIONS | {"pulse", "model"}
_SIDE = _BELOW_PROTOCOL | {"protocol", "telemetry"}
_RUN = _SIDE | {"engine", "rollout", "train", "report"}

# package -> the packages it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    **{name: BASE for name in FOUNDATIONS - BASE},
    "envs": BASE | {"tools"},  # an environment's tool may be a service
    "tools": BASE | {"httpjson"},  # a tool service answers as the endpoint does
    **{name: set() for name in BASE},
    "pulse": BASE,
    "model": BASE | {"pulse"},
    "protocol": _BELOW_PROTOCOL - {"config"},
    "telemetry": _BELOW_PROTOCOL | {"protocol"},
    "engine": _BELOW_PROTOCOL | {"protocol"},
    "rollout": _SIDE | {"engine", "serve"},
    "train": _SIDE | {"engine"},  # spot checks recompute a row with the engine's rule
    "serve": _BELOW_PROTOCOL | {"protocol", "engine"},
    "report": BASE | {"store", "envs", "protocol", "telemetry"},
    # model: an export merges a version's LoRA adapters (model.lora)
    "operate": BASE
    | {"config", "store", "envs", "pulse", "model", "protocol", "telemetry", "report"},
    "launch": _RUN | {"operate"},
    "cli": _RUN | {"launch", "operate", "serve"},
    "bench": _RUN | {"launch", "serve"},
    "__main__": {"cli"},
    "__init__": set(),
}
ROLE_MODULES = ("colonnade.rollout.worker", "colonnade.train.trainer")
ROLE_CALLERS = {"cli"}  # packages that may run a role, not only configure it
# Modules elsewhere that run the roles in-process: the fleet simulation runs
# the real trainer and subclasses the real worker.
ROLE_CALLER_FILES = {Path("bench/fleet/simulation.py"), Path("bench/fleet/sim_worker.py")}


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(absolute module, names, line) of every import in `path`, lazy ones included."""
    here = _module(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            names = [a.name for a in node.names]
            out.append((base, names, node.lineno))
            if base == "colonnade":  # `from colonnade import untrusted`: a module
                mods = [n for n in names if (SRC / n).is_dir() or (SRC / f"{n}.py").is_file()]
                out += [(f"colonnade.{n}", [], node.lineno) for n in mods]
    return out


def _owner(module: str) -> str | None:
    """The package of src/colonnade a module belongs to (None: not ours)."""
    parts = module.split(".")
    if parts[0] != "colonnade" or len(parts) < 2:
        return None
    return parts[1]


def _edges():
    for path in sorted(SRC.rglob("*.py")):
        mine = _owner(_module(path)) or "__init__"
        for target, names, line in _imports(path):
            yield path.relative_to(SRC), mine, target, names, line


def test_every_package_has_a_floor():
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in SRC.glob("*.py")}
    assert (packages | modules) - set(ALLOWED) == set()


def test_packages_import_only_from_the_floors_below():
    wrong = [
        f"{path}:{line} ({mine}) imports {target}"
        for path, mine, target, _, line in _edges()
        if (owner := _owner(target)) not in (None, mine) and owner not in ALLOWED[mine]
    ]
    assert wrong == []


@pytest.mark.parametrize(
    ("side", "never"),
    [
        ("train", {"rollout", "launch", "report"}),
        ("rollout", {"train", "launch", "report"}),
        ("report", {"train", "rollout", "launch"}),
        ("protocol", {"train", "rollout", "launch", "report", "telemetry", "config"}),
    ],
)
def test_the_sides_share_only_protocol(side, never):
    assert never.isdisjoint(ALLOWED[side])


def test_role_modules_are_run_only_by_the_cli():
    wrong = [
        f"{path}:{line} takes {names} from {target}"
        for path, mine, target, names, line in _edges()
        if target in ROLE_MODULES
        and _owner(target) != mine
        and mine not in ROLE_CALLERS
        and path not in ROLE_CALLER_FILES
    ]
    assert wrong == []


def test_the_checker_sees_lazy_and_relative_imports():
    """The rules above would pass vacuously if imports went unseen."""
    found = {(t, tuple(n)) for t, n, _ in _imports(SRC / "engine" / "loop.py")}
    assert ("colonnade.engine.session", ("Session",)) in found
    lazy = {t for t, _, _ in _imports(SRC / "launch" / "run.py")}
    assert "colonnade.report" in lazy  # imported inside a function
    assert "colonnade.untrusted" in {t for t, _, _ in _imports(SRC / "protocol" / "schemas.py")}
