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


RUN_FILES = (
    "",
    "## Run files",
    "",
    "`colonnade config show` prints a run file: the run's keys at the top, then a",
    "`[trainer]` and a `[worker]` table with every setting of each role, as the run",
    "would start them. What it prints loads back, and `colonnade run` writes the same",
    "as `<out>/run.toml`:",
    "",
    "- `colonnade run --config FILE` reads all of it. In the tables, the settings the",
    "  run decides for its processes (`store`, `endpoint_url`, `env`, `model`,",
    "  `metrics_port`) may only repeat the run's own values: set them at the top level.",
    "  A path the run makes (the trainer's `key`, `worker_keys`, the workers' `trust`)",
    "  left empty is the run's; one given is kept.",
    "- `colonnade trainer --config FILE` and `colonnade worker --config FILE` read",
    "  their own table of a run file (one with a `[trainer]` or `[worker]` table); the",
    "  top-level `store`, `endpoint_url`, `env` and `model` fill in what that table",
    "  leaves out, and the rest of the file is the run's. A file of the role's keys",
    "  alone works as before.",
    "- The paths the run makes under its folder (its store, the keys) are printed once",
    "  `--out` names the folder; before that they are left empty, each role's default",
    "  (the trainer and the worker then take `--store`).",
    "- The run's warm start is the run's own: a trainer started from the file starts",
    "  from `model` as it is named there.",
)


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
        "defaults < preset < `--config` TOML file < flags. Ranges, and whether the",
        "environment and the model name something (a built-in, `rg:<dataset>` or an",
        "importable module; a preset, a model folder or a hub name `org/model`), are",
        "checked when a config is built, so a bad value fails at once in one line.",
        *RUN_FILES,
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
