"""Command-line flags made from a config's fields: one flag per setting.

`--max-lag` for `max_lag`, typed from the field's annotation, its help from
the field's `setting(..., help)`, `--x/--no-x` for booleans. A flag left out
is None, so `load_config` keeps the preset's or the file's value.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable
from typing import Any

from .loading import CHOICES, HELP

_METAVARS = {int: "N", float: "X"}


class _Switch(argparse.Action):
    """--x sets True, --no-x (or --prefix.no-x) sets False."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, "no-" not in (option_string or ""))

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def _scalar(tp: Any) -> Any:
    """int for `int | None` and the like; None for a type no flag can hold."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _scalar(args[0]) if len(args) == 1 else None
    return tp if tp in (int, float, str, bool) else None


def _default_note(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING or f.default in (None, ""):
        return ""
    value = f.default
    if isinstance(value, bool):
        return ""  # --x / --no-x says it
    return f" (default {value:g})" if isinstance(value, float) else f" (default {value})"


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    prefix: str = "",
) -> list[str]:
    """Add a flag for every scalar field of `cls` (or those in `only`); the dests, in order.

    `prefix` ("trainer.") names flags `--trainer.lr` with dest `trainer__lr`,
    for a role's settings given to another command.
    """
    hints = typing.get_type_hints(cls)
    wanted = set(only) if only is not None else None
    dests = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        tp = _scalar(hints[f.name])
        if tp is None or f.name in skip or (wanted is not None and f.name not in wanted):
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        dest = prefix.replace(".", "__") + f.name
        text = f.metadata.get(HELP, "") + _default_note(f)
        if tp is bool:
            # --trainer.no-fsdp rather than argparse's --no-trainer.fsdp
            off = "--" + prefix + "no-" + f.name.replace("_", "-")
            parser.add_argument(flag, off, dest=dest, action=_Switch, default=None, help=text)
        else:
            choices = f.metadata.get(CHOICES)
            parser.add_argument(
                flag, dest=dest, type=tp, choices=choices, help=text,
                metavar=None if choices else _METAVARS.get(tp) or f.name.split("_")[-1].upper(),
            )  # fmt: skip
        dests.append(dest)
    return dests


def flag_values(args: argparse.Namespace, dests: Iterable[str], prefix: str = "") -> dict:
    """{field: value} of the flags given (None: not given), `prefix` taken off."""
    strip = prefix.replace(".", "__")
    return {d.removeprefix(strip): v for d in dests if (v := getattr(args, d, None)) is not None}
