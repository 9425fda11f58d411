"""Environments: the interface, the registry, and the built-in tasks.

Built-ins: `searchqa` (multi-turn BM25 search, Search-R1 format) and `smoke`
(one turn, learnable in a minute). Users add theirs as a module exposing
`load_environment(**kwargs)` and name it by import path.
"""

from .answers import exact_match, last_tag, normalize
from .base import SPLITS, Demonstrating, Environment, Practising, Score, Task
from .registry import BUILTINS, load_environment

__all__ = [
    "BUILTINS",
    "SPLITS",
    "Demonstrating",
    "Environment",
    "Practising",
    "Score",
    "Task",
    "exact_match",
    "last_tag",
    "load_environment",
    "normalize",
]
