"""`model.unmerged`: adapters beside a linear, in place across refreshes."""

import pytest
import torch
from torch import nn

from colonnade.model.unmerged import adapted_modules, load_adapters


def _state(rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "0.weight": torch.randn(3, 4, generator=gen),
        "0.lora_A.weight": torch.randn(rank, 4, generator=gen),
        "0.lora_B.weight": torch.randn(3, rank, generator=gen).to(torch.bfloat16),
    }


def _net(state) -> nn.Module:
    net = nn.Sequential(nn.Linear(4, 3, bias=False), nn.Linear(3, 3, bias=False))
    net[0].weight.data.copy_(state["0.weight"])
    return net


def test_a_linear_returns_its_base_plus_the_low_rank_update_in_fp32():
    state = _state(2)
    net = _net(state)
    assert load_adapters(net, state)  # adapters came
    x = torch.randn(5, 4)
    a, b = state["0.lora_A.weight"], state["0.lora_B.weight"].float()
    assert torch.allclose(net[0](x), x @ (state["0.weight"] + b @ a).T, atol=1e-6)
    assert list(adapted_modules(net)) == ["0"] and not net[1]._forward_hooks
    assert not any("adapter" in k for k in net.state_dict())  # the base's loaders never see them


def test_a_refresh_copies_in_place_and_a_new_rank_or_none_reshapes():
    state = _state(2)
    net = _net(state)
    load_adapters(net, state)
    held = net[0].adapter_b
    newer = _state(2, seed=1)
    assert not load_adapters(net, newer, {"0.weight"})  # the adapters not named: not read
    assert torch.equal(held, state["0.lora_B.weight"].float())
    assert not load_adapters(net, newer, {"0.lora_B.weight"})  # values only
    assert net[0].adapter_b is held and torch.equal(held, newer["0.lora_B.weight"].float())
    assert load_adapters(net, _state(3))  # another rank: attached again
    assert net[0].adapter_a.shape == (3, 4) and len(net[0]._forward_hooks) == 1
    assert load_adapters(net, {"0.weight": state["0.weight"]})  # none: the base alone
    assert not adapted_modules(net) and not net[0]._forward_hooks
    x = torch.randn(2, 4)
    assert torch.equal(net[0](x), x @ state["0.weight"].T)


def test_adapters_loaded_under_inference_mode_take_a_refresh_outside_it():
    state = _state(2)
    net = _net(state)
    with torch.inference_mode():
        load_adapters(net, state)
    load_adapters(net, _state(2, seed=1), None)  # an inference tensor would refuse the copy
    assert torch.equal(net[0].adapter_a, _state(2, seed=1)["0.lora_A.weight"])


def test_adapters_for_a_module_the_model_lacks_are_refused():
    state = {**_state(2), "9.lora_A.weight": torch.ones(2, 4), "9.lora_B.weight": torch.ones(3, 2)}
    with pytest.raises(ValueError, match="9"):
        load_adapters(_net(state), state)
