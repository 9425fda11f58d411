"""The int8 kernels: each is correct wherever it is allowed, the planner
picks the fastest correct one per (shape, row bucket) and keeps it on disk."""

import json

import pytest
import torch

from colonnade.model import int8 as int8_module
from colonnade.model import kernels
from colonnade.model.int8 import Int8Linear
from colonnade.model.kernels import KERNELS, ROW_BUCKETS, Kernel, Planner, bucket


def _case(out_f, in_f, rows, seed=0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8, generator=gen)
    scale = torch.rand(out_f, generator=gen) * 0.01 + 1e-4
    return torch.randn(rows, in_f, generator=gen) * 3, codes, scale


@pytest.mark.parametrize("name", sorted(KERNELS))
@pytest.mark.parametrize(("out_f", "in_f"), [(33, 16), (64, 100), (576, 192), (40, 1536)])
def test_every_allowed_kernel_computes_the_reference(name, out_f, in_f):
    kernel = KERNELS[name]
    if not kernel.fits(out_f, in_f):
        assert name == "int8pack" and in_f % 16, "only int8pack refuses shapes"
        return
    for rows in (1, 5, 40):
        x, codes, scale = _case(out_f, in_f, rows)
        got = kernel.run(x.to(torch.bfloat16), kernel.pack(codes)).float() * scale
        assert got.shape == (rows, out_f)
        assert kernels.within_tolerance(got, x, codes, scale), (name, rows)


def test_the_tolerance_rejects_a_wrong_result():
    x, codes, scale = _case(64, 64, 8)
    right = kernels.reference(x, codes, scale)
    assert kernels.within_tolerance(right.float(), x, codes, scale)
    assert not kernels.within_tolerance(right.float() * 1.01, x, codes, scale)
    # Activations "may" round to bf16: float32 ones are within the bound too.
    unrounded = (x.double() @ codes.double().t()) * scale.double()
    assert kernels.within_tolerance(unrounded.float(), x, codes, scale)
    nan = right.float().clone()
    nan[0, 0] = float("nan")
    assert not kernels.within_tolerance(nan, x, codes, scale)


def test_row_buckets():
    assert [bucket(r) for r in (1, 2, 4, 5, 16, 17, 64, 65, 256, 10_000)] == [
        0,
        1,
        1,
        2,
        2,
        3,
        3,
        4,
        4,
        4,
    ]
    assert len(ROW_BUCKETS) == 5


def _fake_times(times):
    calls = []

    def measure(out_f, in_f, rows, names=None):
        calls.append((out_f, in_f, rows))
        return {k: v for k, v in times.items() if names is None or k in names}

    return measure, calls


def test_the_planner_keeps_the_fastest_and_measures_each_slot_once(tmp_path, monkeypatch):
    measure, calls = _fake_times({"int8pack": 3e-5, "bf16_gemm": 1e-5, "float": 9e-5})
    monkeypatch.setattr(kernels, "measure", measure)
    monkeypatch.delenv(kernels.FORCE_ENV, raising=False)
    p = Planner(tmp_path / "k.json")
    assert p.choose(64, 64, 1).name == "bf16_gemm"
    assert p.choose(64, 64, 1).name == "bf16_gemm"
    assert p.choose(64, 64, 3).name == "bf16_gemm"  # another bucket: measured
    assert calls == [(64, 64, 1), (64, 64, 4)]
    # int8pack cannot run K=100: never offered there
    assert p.choose(64, 100, 1).name == "bf16_gemm"
    doc = json.loads((tmp_path / "k.json").read_text())
    assert doc["machine"] == kernels.machine_key()
    assert doc["choices"] == dict.fromkeys(["64x64@1", "64x64@4", "64x100@1"], "bf16_gemm")
    assert doc["timings_us"]["64x64@1"]["int8pack"] == 30.0

    # A new process on the same machine reads the file and measures nothing.
    def boom(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(kernels, "measure", boom)
    again = Planner(tmp_path / "k.json")
    assert again.choose(64, 64, 2).name == "bf16_gemm"
    assert again.summary() == doc["choices"]


def test_a_cache_from_another_machine_or_unreadable_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.delenv(kernels.FORCE_ENV, raising=False)
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"version": 1, "machine": "other", "choices": {"64x64@1": "float"}}))
    measure, calls = _fake_times({"int8pack": 1e-5, "float": 9e-5})
    monkeypatch.setattr(kernels, "measure", measure)
    assert Planner(path).choose(64, 64, 1).name == "int8pack"
    path.write_text("{not json")
    assert Planner(path).choose(64, 64, 1).name == "int8pack"
    path.write_text(
        json.dumps(
            {
                "version": 1,
                "machine": kernels.machine_key(),
                "choices": {"64x64@1": "no-such-kernel"},
            }
        )
    )
    assert Planner(path).choose(64, 64, 1).name == "int8pack"
    assert len(calls) == 3


def test_an_unwritable_cache_keeps_choices_in_memory(tmp_path, monkeypatch):
    monkeypatch.delenv(kernels.FORCE_ENV, raising=False)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    measure, _ = _fake_times({"float": 1e-5})
    monkeypatch.setattr(kernels, "measure", measure)
    p = Planner(blocker / "sub" / "k.json")  # a directory under a file
    assert p.choose(8, 16, 1).name == "float"
    assert p.path is None and p.summary() == {"8x16@1": "float"}


def test_a_wrong_kernel_is_never_chosen_however_fast(monkeypatch):
    """Correctness is checked on the CPU that measures, before speed counts."""

    def wrong(x, packed):
        return (x @ packed[0].t()) * 1.05

    bad = Kernel("fast_but_wrong", lambda o, i: True, lambda c: (c.to(torch.bfloat16),), wrong)
    monkeypatch.setitem(KERNELS, bad.name, bad)
    times = kernels.measure(32, 64, 4)
    assert bad.name not in times
    assert set(times) == {n for n in KERNELS if n != bad.name and KERNELS[n].fits(32, 64)}
    assert all(t > 0 for t in times.values())


def test_a_forced_kernel_runs_where_it_fits(tmp_path, monkeypatch):
    monkeypatch.setenv(kernels.FORCE_ENV, "int8pack")
    p = Planner(tmp_path / "k.json")
    assert p.choose(64, 64, 1).name == "int8pack"
    assert p.choose(64, 100, 1).name == kernels.FALLBACK
    monkeypatch.setenv(kernels.FORCE_ENV, "nope")
    with pytest.raises(ValueError, match="not one of"):
        Planner(tmp_path / "k.json")


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_an_int8_linear_on_each_kernel_follows_new_codes(name, monkeypatch):
    # Each kernel keeps its own packed copy of the codes; a patch (load)
    # must replace it. A worker packs under inference_mode and loads the
    # next version outside it: that once raised on the in-place update.
    monkeypatch.setenv(kernels.FORCE_ENV, name)
    monkeypatch.setattr(kernels, "_planners", {})
    x, codes, scale = _case(40, 64, 20)
    bias = torch.randn(40)
    layer = Int8Linear(codes, scale, bias)
    with torch.inference_mode():
        first = layer(x.reshape(4, 5, 64))
    assert first.shape == (4, 5, 40) and first.dtype == torch.float32
    assert layer.kernel(20).name == name
    assert kernels.within_tolerance(first.reshape(20, 40) - bias, x, codes, scale)
    newer = -codes
    layer.load(newer, scale, None)
    with torch.inference_mode():
        got = layer(x)
    assert kernels.within_tolerance(got - bias, x, newer, scale)
    tracked = layer(x.clone().requires_grad_())
    assert torch.equal(tracked.detach(), got)


def test_processes_sharing_the_cache_keep_each_others_slots(tmp_path, monkeypatch):
    monkeypatch.delenv(kernels.FORCE_ENV, raising=False)
    measure, calls = _fake_times({"int8pack": 1e-5, "float": 9e-5})
    monkeypatch.setattr(kernels, "measure", measure)
    a, b = Planner(tmp_path / "k.json"), Planner(tmp_path / "k.json")
    a.choose(64, 64, 1)
    b.choose(32, 64, 1)
    doc = json.loads((tmp_path / "k.json").read_text())
    assert set(doc["choices"]) == {"64x64@1", "32x64@1"}
    b.forget()
    assert b.summary() == {}
    b.choose(32, 64, 1)
    assert len(calls) == 3  # forgotten: measured again


def test_the_planner_stacks_siblings_only_where_one_wide_call_is_faster(tmp_path, monkeypatch):
    # A wide weight streamed slower than two narrow ones (torch's int8
    # kernel at 1 row here): the planner keeps a call per member there.
    def measure(out_f, in_f, rows, names=None):
        per_row = 1e-6 if rows == 1 and out_f > 100 else 1e-7
        return {"int8pack": out_f * per_row, "float": 1.0}

    monkeypatch.setattr(kernels, "measure", measure)
    monkeypatch.delenv(kernels.FORCE_ENV, raising=False)
    p = Planner(tmp_path / "k.json")
    assert not p.stacks((64, 64), 32, 1)  # 128 wide: 1.28e-4 against 2 × 6.4e-6
    assert p.stacks((64, 64), 32, 16)  # 1.28e-5 against 1.28e-5: the one call wins ties
    doc = json.loads((tmp_path / "k.json").read_text())
    assert doc["choices"]["stack 64+64x32@1"] == "apart"
    assert doc["choices"]["stack 64+64x32@16"] == "stacked"

    def boom(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(kernels, "measure", boom)
    again = Planner(tmp_path / "k.json")  # another process: read, not measured
    assert not again.stacks((64, 64), 32, 1) and again.stacks((64, 64), 32, 9)


def test_siblings_run_apart_where_the_planner_says_so(monkeypatch):
    from colonnade.model.int8 import Siblings

    decisions = []

    class Fake:
        def stacks(self, sizes, in_f, rows):
            decisions.append((sizes, in_f, rows))
            return rows > 1

        def choose(self, out_f, in_f, rows):
            return KERNELS["float"]

    monkeypatch.setattr(int8_module, "planner", lambda: Fake())
    torch.manual_seed(0)
    members = [
        Int8Linear(torch.randint(-127, 128, (n, 32), dtype=torch.int8), torch.rand(n), None)
        for n in (24, 8)
    ]
    group = Siblings(members)
    calls = []
    real = group.layer.alone
    monkeypatch.setattr(group.layer, "alone", lambda x: calls.append(x) or real(x))
    one, many = torch.randn(1, 32), torch.randn(5, 32)
    for x in (one, many, one):
        got = [m(x) for m in members]
        want = [x.to(torch.bfloat16).float() @ m.dequantized().t() for m in members]
        for g, w in zip(got, want, strict=True):
            assert (g - w).abs().max() <= 1e-3 * w.abs().max()
    # 1 row: each member alone; 5 rows: the stacked layer once for both members.
    assert [c.shape[0] for c in calls] == [5]
    assert decisions == [((24, 8), 32, 1), ((24, 8), 32, 5)]  # once per bucket
