"""Causal LMs: presets and loading, the int8 weights workers run, log-probs."""

from .device import pick_device
from .int8 import int8_state, load_dequantized, load_int8, publishable_state, tied_aliases
from .loading import (
    cache_root,
    load_model,
    load_tokenizer,
    local_model_dir,
    resolve_model,
    skeleton,
)
from .logprobs import gather_logprobs, sequence_logprobs
from .presets import PRESETS, TinySpec

__all__ = [
    "PRESETS",
    "TinySpec",
    "cache_root",
    "gather_logprobs",
    "int8_state",
    "load_dequantized",
    "load_int8",
    "load_model",
    "load_tokenizer",
    "local_model_dir",
    "pick_device",
    "publishable_state",
    "resolve_model",
    "sequence_logprobs",
    "skeleton",
    "tied_aliases",
]
