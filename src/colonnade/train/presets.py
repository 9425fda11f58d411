"""Named trainer settings (`--preset NAME`): a starting point per task size.

A preset only fills in defaults; the TOML file and flags still override it.
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # Seconds per version on a laptop: for end-to-end tests and first runs.
    "smoke": {
        "env": "smoke",
        "model": "tiny",
        "group_size": 4,
        "groups_per_step": 4,
        "groups_per_batch": 2,
        "lr": 3e-4,
        "max_turn_tokens": 12,
        "max_episode_tokens": 16,
        "anchor_every": 10,
    },
    # The searchqa task at the reference's shape: 8 × 8 episodes per step.
    "searchqa": {
        "env": "searchqa",
        "group_size": 8,
        "groups_per_step": 8,
        "groups_per_batch": 2,
        "lr": 1e-5,
        "max_turn_tokens": 64,
        "max_episode_tokens": 384,
    },
}
