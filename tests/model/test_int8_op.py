"""The int8 matmul as an opaque operator (`colonnade::int8_linear`): the
same numbers as the eager layer, a fake that gives the output shape, and a
graph compiled around it that still runs siblings' stacked codes once."""

import pytest
import torch
import torch._dynamo.testing
import torch._inductor.config
from torch import nn

from colonnade.model import kernels
from colonnade.model.int8 import Int8Linear, Siblings, compile_options

OP = torch.ops.colonnade.int8_linear.default


def _layer(out_f, in_f, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8, generator=gen)
    scale = torch.rand(out_f, generator=gen) * 0.01 + 1e-4
    b = torch.randn(out_f, generator=gen) if bias else None
    return Int8Linear(codes, scale, b)


@pytest.mark.parametrize("bias", [False, True])
def test_the_operator_computes_the_layer_and_the_reference(bias):
    layer = _layer(48, 64, bias)
    x = torch.randn(3, 5, 64)
    with torch.inference_mode():
        got = OP(x, layer.handle, layer.out_features)
        assert torch.equal(got, layer(x))
    assert got.shape == (3, 5, 48) and got.dtype == torch.float32 and got.is_contiguous()
    unbiased = (got - layer.bias.data if bias else got).reshape(15, 48)
    assert kernels.within_tolerance(unbiased, x.reshape(15, 64), layer.codes, layer.scale)


def test_the_fake_gives_the_output_shape_without_running_a_kernel(monkeypatch):
    layer = _layer(40, 32)
    monkeypatch.setattr(Int8Linear, "alone", lambda *a: pytest.fail("ran a kernel"))
    with torch._subclasses.fake_tensor.FakeTensorMode():
        y = OP(torch.empty(7, 2, 32), layer.handle, 40)
    assert y.shape == (7, 2, 40) and y.dtype == torch.float32
    monkeypatch.undo()
    # torch's own consistency checks of the schema and the fake against real calls
    torch.library.opcheck(
        OP, (torch.randn(4, 32), layer.handle, 40), test_utils=("test_schema", "test_faketensor")
    )


class _Block(nn.Module):
    """An attention-like block: three siblings on one input, then a linear."""

    def __init__(self):
        super().__init__()
        self.q_proj = _layer(64, 32, True, 1)
        self.k_proj, self.v_proj = _layer(32, 32, False, 2), _layer(32, 32, False, 3)
        self.o_proj = _layer(32, 64, False, 4)
        Siblings([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x):
        h = x * 2  # exact: the eager and compiled inputs agree to the bit
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        return self.o_proj(q * torch.cat([k, v], dim=-1)) + x


@pytest.mark.parametrize("stacked", [True, False])
def test_a_compiled_graph_runs_the_operator_and_each_set_of_siblings_once(stacked, monkeypatch):
    block = _Block()
    monkeypatch.setattr(Siblings, "stacked", lambda self, rows: stacked)
    calls = []
    alone = Int8Linear.alone
    monkeypatch.setattr(Int8Linear, "alone", lambda s, x: calls.append(s) or alone(s, x))
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, backend=counter, dynamic=True, fullgraph=True)
    # one call on the stacked q/k/v codes (or one per member), one for o_proj
    members = [block.q_proj, block.k_proj, block.v_proj]
    want_calls = [block.q_proj._siblings.layer] if stacked else members
    with torch.inference_mode(), torch._inductor.config.patch(compile_options()):
        for rows in (2, 3, 5):
            x = torch.randn(rows, 4, 32)
            want = block(x)
            calls.clear()
            assert torch.equal(compiled(x), want)
            assert calls == [*want_calls, block.o_proj]
    assert counter.frame_count == 1  # one graph for every number of rows
