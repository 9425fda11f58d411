"""Rollout generation: the batched multi-turn engine and its sampling rules."""

from .engine import Engine, Episode, Responder
from .episodes import Result, chat_prompt, model_turns, run_episodes
from .loader import PRECISIONS, load_engine
from .sampling import SamplingParams, filtered_logprobs, sample
from .stops import StopMatcher

__all__ = [
    "PRECISIONS",
    "Engine",
    "Episode",
    "Responder",
    "Result",
    "SamplingParams",
    "StopMatcher",
    "chat_prompt",
    "filtered_logprobs",
    "load_engine",
    "model_turns",
    "run_episodes",
    "sample",
]
