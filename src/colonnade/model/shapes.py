"""Model shapes as transformers configs: the presets' and those of models
that cannot be downloaded here.

A shape is a config, never weights: `colonnade plan` instantiates one on
the meta device to count it exactly (`model_config` finds it by name, or
reads a model folder's config.json), and a test builds a model of the shape
at random init (`AutoModelForCausalLM.from_config(shape_config(name))`).

- `tiny`, `smollm2-135m`: the presets' architectures (model/presets.py).
  `tiny`'s vocabulary is `TinySpec.vocab_size`, the most its tokenizer may
  learn: the preset trains that tokenizer on the environment's text, and a
  small text may give it fewer tokens.
- `qwen3-0.6b`, `qwen3-1.7b`, `qwen3-8b`: the published Qwen3 shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .presets import PRESETS, TinySpec


@dataclass(frozen=True)
class Qwen3Shape:
    """The dimensions that set a Qwen3 model's size."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool
    head_dim: int = 128
    vocab: int = 151936
    max_positions: int = 40960

    def config(self):
        from transformers import Qwen3Config

        return Qwen3Config(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_positions,
            tie_word_embeddings=self.tied,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )


QWEN3 = {
    "qwen3-0.6b": Qwen3Shape(
        hidden=1024, layers=28, heads=16, kv_heads=8, intermediate=3072, tied=True
    ),
    "qwen3-1.7b": Qwen3Shape(
        hidden=2048, layers=28, heads=16, kv_heads=8, intermediate=6144, tied=True
    ),
    "qwen3-8b": Qwen3Shape(
        hidden=4096, layers=36, heads=32, kv_heads=8, intermediate=12288, tied=False
    ),
}


def tiny_config(spec: TinySpec | None = None, **tokens):
    """The `tiny` preset's LlamaConfig: at its largest vocabulary, or with the
    trained tokenizer's `vocab_size` and token ids given (`presets.build_tiny`)."""
    from transformers import LlamaConfig

    spec = spec or TinySpec()
    shape = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
    )
    return LlamaConfig(**{**shape, **tokens})


def smollm2_config():
    """SmolLM2-135M-Instruct's LlamaConfig, as the preset's GGUF gives it."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100_000.0},
    )


SHAPES: dict[str, Callable[[], object]] = {
    "tiny": tiny_config,
    "smollm2-135m": smollm2_config,
    **{name: shape.config for name, shape in QWEN3.items()},
}


def shape_config(name: str):
    """The transformers config of the shape `name` (KeyError: no such shape)."""
    return SHAPES[name]()


def model_config(name: str):
    """(transformers config, what it came from) for a shape's name or a model
    folder; a ValueError in one line for anything else (nothing is fetched)."""
    if name in SHAPES:
        return shape_config(name), f"{'preset' if name in PRESETS else 'built-in shape'} {name}"
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path), str(path / "config.json")
    raise ValueError(
        f"unknown model {name!r}: use a built-in shape ({', '.join(SHAPES)}) "
        "or a model folder with a config.json"
    )
