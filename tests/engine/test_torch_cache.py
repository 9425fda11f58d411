"""The torch engine's cache buffers: a join stacks two caches' rows into one
buffer, each left-padded to one width, exactly what padding then
concatenating makes, with room to grow after."""

from __future__ import annotations

import pytest
import torch

from colonnade.engine.torch_backend import ROOM, TorchCache, growing_layer


def _cache(rows: int, columns: int, seed: int, heads: int = 2, dim: int = 4, vdim: int = 3):
    gen = torch.Generator().manual_seed(seed)
    cache = TorchCache(torch.device("cpu"))
    for _ in range(2):  # two layers
        layer = growing_layer()()
        layer.assign(torch.randn(rows, heads, columns, dim, generator=gen),
                     torch.randn(rows, heads, columns, vdim, generator=gen), ROOM)  # fmt: skip
        cache.layers.append(layer)
    return cache


def _padded(t: torch.Tensor, columns: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, 0, columns, 0))


@pytest.mark.parametrize("pads", [(0, 0), (3, 0), (0, 5), (2, 4)])
def test_a_join_is_padding_then_concatenating(pads):
    pad_a, pad_b = pads
    width = 9
    a, b = _cache(3, width - pad_a, 0), _cache(2, width - pad_b, 1)
    want = [(torch.cat([_padded(x.keys, pad_a), _padded(y.keys, pad_b)]),
             torch.cat([_padded(x.values, pad_a), _padded(y.values, pad_b)]))
            for x, y in zip(a.layers, b.layers, strict=True)]  # fmt: skip
    a.join(b, pad_a, pad_b)
    for layer, (keys, values) in zip(a.layers, want, strict=True):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        # One buffer with room: the next step's column is written in place.
        buffer = layer._k
        assert buffer.shape[2] == width + ROOM
        step_k, step_v = torch.ones(5, 2, 1, 4), torch.ones(5, 2, 1, 3)
        got_k, got_v = layer.update(step_k, step_v)
        assert layer._k is buffer and torch.equal(got_k[:, :, :width], keys)
        assert torch.equal(got_k[:, :, width:], step_k) and torch.equal(got_v[:, :, width:], step_v)


def test_a_join_of_caches_of_other_widths_is_refused():
    a, b = _cache(1, 4, 0), _cache(1, 5, 1)
    with pytest.raises(ValueError, match="one width"):
        a.join(b, 0, 0)


def test_a_stack_of_many_is_their_joins_in_turn():
    # All at once into one buffer: what joining one after another makes.
    widths = [6, 9, 4, 9, 7]
    parts = [_cache(1 + i % 3, w, 10 + i) for i, w in enumerate(widths)]
    pads = [max(widths) - w for w in widths]
    want = []
    for layer in range(2):
        ks = [_padded(p.layers[layer].keys, pad) for p, pad in zip(parts, pads, strict=True)]
        vs = [_padded(p.layers[layer].values, pad) for p, pad in zip(parts, pads, strict=True)]
        want.append((torch.cat(ks), torch.cat(vs)))
    first = parts[0]
    first.stack(parts[1:], pads)
    for layer, (keys, values) in zip(first.layers, want, strict=True):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        assert layer._k.shape[2] == max(widths) + ROOM
    with pytest.raises(ValueError, match="one width"):
        _cache(1, 3, 0).stack([_cache(1, 3, 1)], [1, 0])
