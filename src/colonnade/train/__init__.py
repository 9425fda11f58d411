"""Training: supervised warm start and the RL trainer's algorithms and loop."""

from .sft import Example, demonstrations, episode_example, train_sft

__all__ = ["Example", "demonstrations", "episode_example", "train_sft"]
