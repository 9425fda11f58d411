"""Rollout generation: the batched multi-turn engine and its sampling rules."""

from .engine import Engine, Episode, Responder
from .episodes import Result, run_episodes
from .loader import PRECISIONS, load_engine
from .sampling import SamplingParams, filtered_logprobs, sample

__all__ = [
    "PRECISIONS",
    "Engine",
    "Episode",
    "Responder",
    "Result",
    "SamplingParams",
    "filtered_logprobs",
    "load_engine",
    "run_episodes",
    "sample",
]
