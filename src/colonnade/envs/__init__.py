"""Environments: the interface, the registry, and the built-in tasks.

Built-ins: `searchqa` (multi-turn BM25 search, Search-R1 format),
`searchqa2` (its two-hop questions: one search is not enough), `smoke`
(one turn, learnable in a minute) and `rg:<dataset>`, any dataset of
reasoning-gym (`pip install 'colonnade[tasks]'`), and `vf:<module>`, an
environment written for verifiers, run by its own loop through an OpenAI
client (`pip install 'colonnade[verifiers]'`). Users add theirs as a
module exposing `load_environment(**kwargs)` and name it by import path.
See docs/environments.md.
"""

from .answers import exact_match, last_tag, normalize
from .args import check_env_kwargs, parse_env_arg, parse_env_args
from .base import (
    SPLITS,
    Demonstrating,
    Environment,
    Metric,
    Practising,
    Score,
    Success,
    Task,
    metrics_of,
    success_of,
    tokenizer_texts_of,
)
from .registry import BUILTINS, PREFIXES, load_environment

__all__ = [
    "BUILTINS",
    "PREFIXES",
    "SPLITS",
    "Demonstrating",
    "Environment",
    "Metric",
    "Practising",
    "Score",
    "Success",
    "Task",
    "check_env_kwargs",
    "exact_match",
    "last_tag",
    "load_environment",
    "metrics_of",
    "normalize",
    "parse_env_arg",
    "parse_env_args",
    "success_of",
    "tokenizer_texts_of",
]
