"""The six tiny architectures the engines are checked on, each built once per test session.

Random-init transformers models (hidden 64, 2 layers, vocab 300) from
`colonnade.bench.engines`, so the tests and `colonnade bench engines` run
the same models; nothing is downloaded.
"""

from __future__ import annotations

import functools

from colonnade.bench.engines import ARCHS, tiny_model, tiny_tokenizer

__all__ = ["ARCHS", "arch_model", "arch_tokenizer"]


@functools.cache
def arch_tokenizer():
    return tiny_tokenizer()


@functools.cache
def arch_model(arch: str):
    """(float32 model, its published int8 state); tests must not modify the model."""
    from colonnade.model import int8_state

    model = tiny_model(arch, arch_tokenizer())
    return model, int8_state(model)
