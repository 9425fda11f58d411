"""The torch backend's cache layer: columns written in place, cut like the layout."""

import torch

from colonnade.engine import torch_backend


def test_cache_layer_grows_in_place_and_holds_what_concatenation_would():
    layer = torch_backend.growing_layer()()
    ref_k = ref_v = None
    gen = torch.Generator().manual_seed(0)

    def add(width, batch=3):
        nonlocal ref_k, ref_v
        k = torch.randn(batch, 2, width, 4, generator=gen)
        v = torch.randn(batch, 2, width, 4, generator=gen)
        ref_k = k if ref_k is None else torch.cat([ref_k, k], dim=2)
        ref_v = v if ref_v is None else torch.cat([ref_v, v], dim=2)
        keys, values = layer.update(k, v)
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
        assert layer.get_seq_length() == ref_k.shape[2]

    add(7)
    buffer = layer.keys.data_ptr()
    add(1)
    assert layer.keys.data_ptr() == buffer  # written in place, nothing copied
    for _ in range(3 * torch_backend.ROOM):  # past the room: the buffer grows
        add(1)
    add(50)
    layer.batch_select_indices(torch.tensor([2, 0, 0]))
    ref_k, ref_v = ref_k[[2, 0, 0]], ref_v[[2, 0, 0]]
    add(1)
    layer.drop_front(5)
    ref_k, ref_v = ref_k[:, :, 5:], ref_v[:, :, 5:]
    add(2)
    index = torch.tensor([[0, 3, 9], [1, 2, 3], [4, 5, 6]])
    layer.gather(index)
    at = index[:, None, :, None].expand(-1, 2, -1, 4)
    ref_k, ref_v = ref_k.gather(2, at), ref_v.gather(2, at)
    add(1)
    other = torch.randn(3, 2, 4, 4, generator=gen)
    layer.assign(other, other + 1)
    ref_k, ref_v = other, other + 1
    add(3)
