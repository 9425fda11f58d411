"""The settings reference (docs/configuration.md), made from the fields' own docs.

`colonnade config doc` prints it; a test keeps the file equal to it, so the
reference cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import typing

from .loading import CHOICES, HELP
from .presets import RUN_PRESETS, TRAINER_PRESETS
from .run import RunConfig
from .trainer import TrainerConfig
from .worker import WorkerConfig

SECTIONS = (
    (TrainerConfig, "`colonnade trainer`", "the `[trainer]` table; `--NAME` on the trainer, "
     "`--trainer.NAME` on `colonnade run`"),
    (WorkerConfig, "`colonnade worker`", "the `[worker]` table; `--NAME` on the worker, "
     "`--worker.NAME` on `colonnade run`"),
    (RunConfig, "`colonnade run`", "top-level keys of run.toml; `--NAME` on `colonnade run`"),
)  # fmt: skip


def _type(tp: typing.Any) -> str:
    text = tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))
    return text.replace("NoneType", "None")


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:
        return f"`{f.default_factory()!r}`"
    return "unset" if f.default in (None, "") else f"`{f.default!r}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference() -> str:
    """Markdown: one table per role (setting, type, default, what it does), then presets."""
    out = [
        "# Settings",
        "",
        "Every setting of every role, from the fields' own documentation",
        "(`src/colonnade/config/`; `colonnade config doc` prints this page). Precedence:",
        "defaults < preset < `--config` TOML file < flags. Ranges are checked when a",
        "config is built, so a bad value fails at once in one line.",
    ]
    for cls, title, where in SECTIONS:
        out += ["", f"## {title}: `{cls.__name__}`", "", f"Where: {where}.", ""]
        out += ["| setting | type | default | what it does |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            text = f.metadata.get(HELP, "")
            if f.metadata.get(CHOICES):
                text += f" (one of {', '.join(f.metadata[CHOICES])})"
            row = (f"`{f.name}`", _type(f.type), _default(f), text)
            out.append("| " + " | ".join(_cell(c) for c in row) + " |")
    out += ["", "## Presets", "", "Trainer presets (`colonnade trainer --preset NAME`):", ""]
    out += [f"- `{n}`: {_settings(p)}" for n, p in TRAINER_PRESETS.items()]
    out += ["", "Run presets (`colonnade run --preset NAME`):", ""]
    out += [f"- `{n}`: {_settings(p)}" for n, p in RUN_PRESETS.items()]
    return "\n".join(out) + "\n"


def _settings(values: dict) -> str:
    return ", ".join(
        f"[{k}] {_settings(v)}" if isinstance(v, dict) else f"`{k} = {v!r}`"
        for k, v in values.items()
    )
