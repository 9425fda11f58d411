"""Environment arguments: `--env-arg k=v` parsing and the one check every side runs.

An environment's keyword arguments travel from a flag or a TOML table to
the trainer, into run.json, and from there to every worker, which rebuilds
the same environment. They are checked by `check_env_kwargs` at each of
those places (`load_environment`, `colonnade config show`, `RunSpec`), so a
value that starts a run is also one a worker accepts. Values are the JSON
types TOML can also write: strings, integers, finite floats, booleans, and
lists and string-keyed tables of those; no null (TOML has none). Depth and
size are bounded because run.json is read by untrusted-input rules.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

MAX_DEPTH = 6  # lists and tables nested inside one argument
MAX_ITEMS = 4096  # values in all arguments together, containers included
MAX_BYTES = 64 << 10  # of all arguments as JSON (run.json holds them)


def parse_env_arg(text: str) -> tuple[str, Any]:
    """`k=v` → (k, v): v as JSON when it parses (`3`, `true`, `[1, 2]`), else the string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"--env-arg {text!r}: expected KEY=VALUE")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def parse_env_args(items: Iterable[str] | None) -> dict[str, Any]:
    """Every `k=v` in order (a later k wins), checked; {} for None."""
    out = dict(parse_env_arg(t) for t in items or ())
    return check_env_kwargs(out)


def check_env_kwargs(kwargs: Any, where: str = "env_kwargs") -> dict[str, Any]:
    """`kwargs` itself if it is a table of identifier keys to allowed values; else ValueError."""
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"{where}: expected a table of arguments, got {type(kwargs).__name__}")
    count = [0]
    for key, value in kwargs.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"{where}: argument name {key!r} is not an identifier")
        _check_value(value, f"{where}.{key}", 0, count)
    size = len(json.dumps(kwargs))
    if size > MAX_BYTES:
        raise ValueError(f"{where}: {size} bytes as JSON, more than {MAX_BYTES}")
    return dict(kwargs)


def _check_value(value: Any, path: str, depth: int, count: list[int]) -> None:
    count[0] += 1
    if count[0] > MAX_ITEMS:
        raise ValueError(f"{path}: more than {MAX_ITEMS} values in all arguments")
    if isinstance(value, bool | int | str):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path}: {value} is not a finite number")
        return
    if isinstance(value, list | tuple | Mapping):
        if depth >= MAX_DEPTH:
            raise ValueError(f"{path}: nested more than {MAX_DEPTH} levels deep")
        if isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise ValueError(f"{path}: table key {k!r} is not a string")
                _check_value(v, f"{path}.{k}", depth + 1, count)
        else:
            for i, v in enumerate(value):
                _check_value(v, f"{path}[{i}]", depth + 1, count)
        return
    what = "null (TOML has none)" if value is None else type(value).__name__
    raise ValueError(f"{path}: {what} is not allowed; use a string, number, boolean, list or table")
