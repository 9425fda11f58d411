"""Rollout generation: the batched multi-turn engine and its sampling rules."""

from .engine import Engine, Episode, Responder
from .sampling import SamplingParams, filtered_logprobs, sample
from .stops import StopMatcher

__all__ = [
    "Engine",
    "Episode",
    "Responder",
    "SamplingParams",
    "StopMatcher",
    "filtered_logprobs",
    "sample",
]
