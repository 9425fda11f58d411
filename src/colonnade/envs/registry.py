"""Finding environments by built-in name, by prefix, or by import path."""

from __future__ import annotations

import importlib
import inspect

from .args import check_env_kwargs
from .base import Environment

BUILTINS = {
    "searchqa": "colonnade.envs.searchqa",
    "searchqa2": "colonnade.envs.searchqa.multihop",  # two-hop questions (hops=2)
    "smoke": "colonnade.envs.smoke",
    "chattools": "colonnade.envs.chattools",  # a tool called in the model's chat format
}
# `prefix:rest` names a family: the module's load_environment(rest, **kwargs).
PREFIXES = {
    "rg": "colonnade.envs.reasoning_gym",  # rg:<dataset> of reasoning-gym
    "vf": "colonnade.envs.verifiers",  # vf:<module>, an environment in verifiers' shape
}


def load_environment(name: str, **kwargs) -> Environment:
    """`searchqa`, `searchqa2`, `smoke`, `chattools`, `rg:<dataset>`, `vf:<module>`, or a
    module path such as `my_pkg.my_env`.

    The module must expose `load_environment(**kwargs)`; the object it returns
    is checked against the `Environment` interface. `kwargs` are checked as
    every side checks them (`check_env_kwargs`: JSON types, bounded).
    """
    kwargs = check_env_kwargs(kwargs)
    prefix, sep, rest = name.partition(":")
    if sep and prefix in PREFIXES:
        if not rest:
            raise ValueError(f"environment {name!r}: name the dataset after {prefix}:")
        loader = importlib.import_module(PREFIXES[prefix]).load_environment
        return _checked(loader(rest, **kwargs), PREFIXES[prefix])
    module_name = BUILTINS.get(name, name)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            known = ", ".join([*BUILTINS, *(f"{p}:<name>" for p in PREFIXES)])
            raise ValueError(
                f"unknown environment {name!r}: not a built-in ({known}) nor an importable module"
            ) from e
        raise
    loader = getattr(module, "load_environment", None)
    if not callable(loader):
        raise ValueError(f"module {module_name} has no load_environment(**kwargs)")
    _bind(loader, name, kwargs)
    return _checked(loader(**kwargs), module_name)


def _bind(loader, name: str, kwargs: dict) -> None:
    """ValueError naming what the environment takes when `kwargs` do not fit it."""
    try:
        inspect.signature(loader).bind(**kwargs)
    except TypeError as e:
        params = [p for p in inspect.signature(loader).parameters if p != "kwargs"]
        raise ValueError(f"environment {name}: {e}; it takes {', '.join(params)}") from None


# The members of `Environment` (optional attributes are read with getattr).
REQUIRED = ("name", "stop", "max_turns", "tasks", "task", "prompt", "respond", "score")


def _checked(env, module_name: str) -> Environment:
    if not isinstance(env, Environment):
        missing = [a for a in REQUIRED if not hasattr(env, a)]
        raise TypeError(f"{module_name}.load_environment() returned an object lacking {missing}")
    return env
