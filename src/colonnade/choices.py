"""The named choices that more than one layer checks, each defined once.

A precision means three things here, and each has its own name: what a
trainer may publish, what a PULSE file may hold, and what an engine can run.
Light on purpose: it imports nothing, so the configs, the wire checks and the
codec read the same tuples without importing one another.
"""

from __future__ import annotations

# What a trainer publishes and run.json names: the weights every worker runs.
PUBLISHED_PRECISIONS = ("int8", "bf16")
# What a PULSE patch's header may name: "exact" carries tensors unrounded.
STORED_PRECISIONS = ("int8", "bf16", "exact")
# What an engine can run a model at, published or loaded from a directory.
RUN_PRECISIONS = ("int8", "fp32", "bf16")

# The backends a rollout batch may name as its engine (the trainer checks it).
ENGINES = ("torch", "mlx")
# What a user may ask for: "auto" picks MLX on Apple silicon when installed.
ENGINE_CHOICES = ("auto", *ENGINES)

# State and payload hash algorithms; pulse.hashing.ALGOS names the same ones
# (a test keeps them equal: importing pulse here would cost torch).
HASHES = ("blake3", "sha256")
# The projections a LoRA adapts by default: attention's four and the gated
# MLP's three (PEFT's "all-linear" without the head).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
