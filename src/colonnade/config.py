"""Typed role configs: dataclass defaults, then a TOML file, then CLI flags.

One flat dataclass per role (trainer, worker). `load_config` rejects keys
the dataclass does not have and values of the wrong type, naming them, so a
typo in a TOML file fails at start instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def _accepts(tp: Any, value: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(a, value) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, tp)


def load_config(
    cls: type[T], path: Path | None = None, base: dict | None = None, **overrides: Any
) -> T:
    """cls(**(base | TOML at `path` | non-None overrides)), checked field by field.

    `base` holds named defaults (a preset); the file beats it, flags beat both.
    """
    values: dict[str, Any] = dict(base or {})
    if path is not None:
        try:
            values.update(tomllib.loads(Path(path).read_text()))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"config {path}: {e}") from None
    values.update({k: v for k, v in overrides.items() if v is not None})
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} setting(s): {', '.join(unknown)}")
    for k, v in values.items():
        if not _accepts(hints[k], v):
            raise ValueError(f"{k}: expected {hints[k]}, got {v!r}")
    return cls(**values)
