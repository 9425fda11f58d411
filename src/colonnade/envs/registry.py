"""Finding environments by built-in name or by import path."""

from __future__ import annotations

import importlib

from .base import Environment

BUILTINS = {
    "searchqa": "colonnade.envs.searchqa",
    "smoke": "colonnade.envs.smoke",
}


def load_environment(name: str, **kwargs) -> Environment:
    """`searchqa`, `smoke`, or a module path such as `my_pkg.my_env`.

    The module must expose `load_environment(**kwargs)`; the object it returns
    is checked against the `Environment` interface.
    """
    module_name = BUILTINS.get(name, name)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            known = ", ".join(BUILTINS)
            raise ValueError(
                f"unknown environment {name!r}: not a built-in ({known}) nor an importable module"
            ) from e
        raise
    loader = getattr(module, "load_environment", None)
    if not callable(loader):
        raise ValueError(f"module {module_name} has no load_environment(**kwargs)")
    env = loader(**kwargs)
    if not isinstance(env, Environment):
        missing = [
            a
            for a in ("name", "stop", "max_turns", "tasks", "task", "prompt", "respond", "score")
            if not hasattr(env, a)
        ]
        raise TypeError(f"{module_name}.load_environment() returned an object lacking {missing}")
    return env
