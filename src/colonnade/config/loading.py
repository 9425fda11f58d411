"""How a role's config is made: dataclass defaults, a preset, a TOML file, flags.

`setting` declares a field with its help text (the one place it is written:
`--help` and docs read it from there). `load_config` rejects keys the
dataclass does not have and values of the wrong type, naming them, so a typo
in a TOML file fails at start instead of being silently ignored; then the
config's own `check` (ranges, and the environment and model names) runs, so
a bad value fails when the config is built and not later in another process.
A role's file may also be a whole run file: the role reads its own table
(docs/configuration.md).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from colonnade.untrusted import is_int, is_number

T = TypeVar("T")
HELP = "help"  # field metadata: the setting's one-line documentation
CHOICES = "choices"
# A run file's role tables: a role config names its own as its class's TABLE.
RUN_TABLES = ("trainer", "worker")
# The run's keys that `colonnade run` hands its roles unchanged.
HANDED_DOWN = ("store", "endpoint_url", "env", "model")


def setting(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with its documentation (and allowed values, for a flag).

    A dict or list default is copied per instance (dataclass default_factory).
    """
    meta = {HELP: help, CHOICES: choices}
    if isinstance(default, dict | list):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def help_of(cls: type, name: str) -> str:
    """The documentation `setting` gave field `name` of `cls`."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)  # type: ignore[arg-type]
    return f.metadata.get(HELP, "")


def _accepts(tp: Any, value: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(a, value) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:  # TOML's inf and nan: a setting's range check takes them or not
        return is_number(value, finite=False)
    if tp is int:
        return is_int(value, -math.inf, math.inf)
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, tp)


def _read(cls: type, path: Path) -> tuple[dict[str, Any], str]:
    """The settings of `cls` in the TOML file at `path`, and where they were
    found (for errors). A run file (one with a [trainer] or [worker] table, as
    `colonnade config show` and `colonnade run` write it) gives a role its own
    table; the run's keys it hands its roles as they are (HANDED_DOWN) fill in
    what the table leaves out. The rest of a run file is the run's."""
    try:
        doc = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"config {path}: {e}") from None
    table = getattr(cls, "TABLE", None)
    if table is None or not any(isinstance(doc.get(t), dict) for t in RUN_TABLES):
        return doc, str(path)
    own = doc.get(table, {})
    if not isinstance(own, dict):
        raise ValueError(f"config {path}: {table} is not a table")
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    handed = {k: doc[k] for k in HANDED_DOWN if k in names and doc.get(k) not in (None, "")}
    return {**handed, **own}, f"[{table}] of {path}"


def load_config(
    cls: type[T], path: Path | None = None, base: dict | None = None, **overrides: Any
) -> T:
    """cls(**(base | TOML at `path` | non-None overrides)), checked field by field.

    `base` holds named defaults (a preset); the file beats it, flags beat both.
    A run file at `path` gives a role config its own table (`_read`).
    """
    values: dict[str, Any] = dict(base or {})
    where = ""
    if path is not None:
        found, source = _read(cls, path)
        values.update(found)
        where = f" in {source}"
    values.update({k: v for k, v in overrides.items() if v is not None})
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} setting(s){where}: {', '.join(unknown)}")
    for k, v in values.items():
        if not _accepts(hints[k], v):
            raise ValueError(f"{k}: expected {hints[k]}, got {v!r}")
    cfg = cls(**values)
    check = getattr(cfg, "check", None)
    if callable(check):
        check()
    return cfg
