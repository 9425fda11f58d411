"""Whether an environment or model name names something, checked when a config is built.

A config names its environment and model by string; a typo there used to
surface minutes later in another process (the trainer's start, a worker's
join). These checks run in the configs' `check`, so `colonnade config show`
and every role refuse it at once, in one line. Light on purpose: nothing is
loaded or built, the names are matched as the loaders match them
(`envs.registry.load_environment`, `model.loading.resolve_model`); a test
keeps the built-in names here equal to theirs.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BUILTIN_ENVS = ("searchqa", "searchqa2", "smoke", "chattools")
ENV_FAMILIES = ("rg", "vf")  # `family:name`: rg:<dataset> of reasoning-gym, vf:<module>
MODEL_PRESETS = ("tiny", "smollm2-135m")


def check_env(name: str) -> None:
    """ValueError unless `name` is a built-in, `family:name`, or an importable module."""
    family, sep, rest = name.partition(":")
    if sep and family in ENV_FAMILIES:
        if not rest:
            raise ValueError(f"environment {name!r}: name the dataset after {family}:")
        return
    if name in BUILTIN_ENVS or _importable(name):
        return
    known = ", ".join([*BUILTIN_ENVS, *(f"{f}:<name>" for f in ENV_FAMILIES)])
    raise ValueError(
        f"unknown environment {name!r}: not a built-in ({known}) nor an importable module"
    )


def _importable(module: str) -> bool:
    if module in sys.modules:  # imported already (or put there, as tests do)
        return True
    # find_spec imports a dotted name's parent packages, not the module itself.
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that is missing, an empty or relative name
        return False


def check_model(name: str) -> None:
    """ValueError unless `name` is a preset, a model folder, or a hub name (org/model)."""
    if name in MODEL_PRESETS:
        return
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"model {name!r}: {path} is not a model folder (no config.json)")
        return
    if "/" not in name:
        raise ValueError(
            f"unknown model {name!r}: use a preset ({', '.join(MODEL_PRESETS)}), "
            "a local model folder or a hub name like org/model"
        )
