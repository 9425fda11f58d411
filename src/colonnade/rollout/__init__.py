"""The worker's side: episodes run against environments, and the worker role."""

from .episodes import Result, run_episodes

__all__ = ["Result", "run_episodes"]
