"""Which CPU kernel runs an int8 linear: measured on this machine, kept on disk.

Every candidate computes the same arithmetic on the published codes
(weight-only int8): y = (bf16(x) · codesᵀ) · scale, the products summed in
float32, the sum possibly rounded to bf16, the row scale applied afterwards
in float32. They differ in speed, and which wins depends on the CPU (native
bf16 or AMX, or neither), the shape and the number of rows: torch's int8
kernel is a GEMV at heart, oneDNN's bf16 GEMM runs on AMX tiles where there
are some, and a threshold written down on one machine is wrong on the next.

So the first time a linear of shape (out, in) meets a number of rows in a
bucket it has not met, every candidate that fits is timed on random data of
that shape (the best of a few calls, a few milliseconds), its output checked
against `reference` within `TOLERANCE`, and the fastest correct one kept for
the (shape, bucket). Choices are cached in a JSON file per CPU model, torch
version and thread count, so a worker measures once per machine.
`COLONNADE_INT8_KERNEL=<name>` forces one kernel wherever it fits (tests,
and a user working around a bad pick).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Upper bounds of the row buckets (rows = batch × new tokens in one call):
# decode steps at batch 1, small, medium and large batches, then prefill.
ROW_BUCKETS = (1, 4, 16, 64, 256)

# |kernel − reference| ≤ TOLERANCE · (|bf16(x)| · |codes|ᵀ) · scale, per
# element: rounding an fp32 sum to bf16 moves it by at most 2⁻⁹ of its
# magnitude, fp32 accumulation over K ≤ 16,384 terms by less than 2⁻¹⁰.
TOLERANCE = 2.0**-8

CACHE_VERSION = 1
# A stacking slot's choice (`Planner.stacks`), kept beside the kernels'.
STACKING = ("stacked", "apart")
FORCE_ENV = "COLONNADE_INT8_KERNEL"


def bucket(rows: int) -> int:
    """Index into ROW_BUCKETS of the bucket `rows` falls in (the last above it)."""
    for i, bound in enumerate(ROW_BUCKETS):
        if rows <= bound:
            return i
    return len(ROW_BUCKETS) - 1


Packed = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Kernel:
    """One way to compute bf16(x) · codesᵀ (before the row scale).

    `pack` turns the int8 codes [out, in] into the tensors `run` reads (made
    once per weight, remade when a patch rewrites the codes); `run` takes
    bf16 activations [rows, in] and returns the sums [rows, out], float32 or
    bf16.
    """

    name: str
    fits: Callable[[int, int], bool]
    pack: Callable[[torch.Tensor], Packed]
    run: Callable[[torch.Tensor, Packed], torch.Tensor]


def _int8pack_fits(out_f: int, in_f: int) -> bool:
    # The kernel reads K in blocks of 16 and crashes the process (no error)
    # on other widths: checked here, never discovered at run time.
    return hasattr(torch, "_weight_int8pack_mm") and in_f % 16 == 0


def _int8pack_pack(codes: torch.Tensor) -> Packed:
    return codes, torch.ones(codes.shape[0], dtype=torch.bfloat16)


def _int8pack_run(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    codes, ones = packed
    return torch._weight_int8pack_mm(x, codes, ones)


def _bf16_pack(codes: torch.Tensor) -> Packed:
    return (codes.to(torch.bfloat16),)  # exact: |code| ≤ 127


def _bf16_run(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    return x @ packed[0].t()


def _onednn_fits(out_f: int, in_f: int) -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def _onednn_pack(codes: torch.Tensor) -> Packed:
    # oneDNN's own blocked layout, made once: the plain bf16 GEMM reorders
    # the weight on every call, which dominates at a few rows.
    return (torch.ops.mkldnn._reorder_linear_weight(codes.to(torch.bfloat16), None),)


def _onednn_run(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed[0], None, "none", [None], "")


def _float_pack(codes: torch.Tensor) -> Packed:
    return (codes,)


def _float_run(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    # Converts the codes on every call: the fallback that runs anywhere.
    return x.float() @ packed[0].float().t()


KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel("int8pack", _int8pack_fits, _int8pack_pack, _int8pack_run),
        Kernel("bf16_gemm", lambda o, i: True, _bf16_pack, _bf16_run),
        Kernel("onednn_bf16", _onednn_fits, _onednn_pack, _onednn_run),
        Kernel("float", lambda o, i: True, _float_pack, _float_run),
    )
}
FALLBACK = "float"


def reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The exact value every kernel approximates, in float64: (bf16(x) · codesᵀ) · scale."""
    xb = x.to(torch.bfloat16).double()
    return (xb @ codes.double().t()) * scale.double()


def within_tolerance(
    got: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor
) -> bool:
    """Whether a kernel's scaled output `got` agrees with `reference` (see TOLERANCE)."""
    bound = (x.to(torch.bfloat16).double().abs() @ codes.double().abs().t()) * scale.double()
    err = (got.double() - reference(x, codes, scale)).abs()
    return bool(torch.isfinite(got).all()) and bool((err <= TOLERANCE * bound + 1e-30).all())


def fitting(out_f: int, in_f: int) -> list[str]:
    """Names of the kernels allowed on this shape."""
    return [name for name, k in KERNELS.items() if k.fits(out_f, in_f)]


# Timed calls cycle through copies of the weight at least this large in
# all, so a small weight is read from memory as in a model's forward pass
# (hundreds of weights in turn), not from the core's cache.
COLD_BYTES = 32 << 20
MAX_COPIES = 16


def time_kernel(
    kernel: Kernel, x: torch.Tensor, copies: list[Packed], budget_s: float = 0.02
) -> float:
    """Best-of seconds per call, each round calling once on every copy: at
    least 3 rounds, more while under `budget_s`."""
    kernel.run(x, copies[0])  # first call at a shape builds oneDNN primitives
    best, spent, rounds = float("inf"), 0.0, 0
    while rounds < 3 or (spent < budget_s and rounds < 50):
        t = time.perf_counter()
        for packed in copies:
            kernel.run(x, packed)
        dt = time.perf_counter() - t
        best, spent, rounds = min(best, dt / len(copies)), spent + dt, rounds + 1
    return best


def measure(out_f: int, in_f: int, rows: int, names: list[str] | None = None) -> dict[str, float]:
    """{kernel: seconds per call} for the correct candidates at this shape and row count.

    A candidate whose output is outside the tolerance, or that raises, is
    left out with a warning: it is never chosen on this machine.
    """
    gen = torch.Generator().manual_seed(out_f * 65_537 + in_f * 257 + rows)
    codes = torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8, generator=gen)
    scale = torch.rand(out_f, generator=gen) * 0.01 + 1e-4
    x = torch.randn(rows, in_f, generator=gen)
    xb = x.to(torch.bfloat16)
    n_copies = max(1, min(MAX_COPIES, -(-COLD_BYTES // codes.numel())))
    times: dict[str, float] = {}
    with torch.inference_mode():
        for name in names or fitting(out_f, in_f):
            kernel = KERNELS[name]
            try:
                packed = kernel.pack(codes)
                got = kernel.run(xb, packed).float() * scale
                if not within_tolerance(got, x, codes, scale):
                    shape = (out_f, in_f)
                    log.warning("int8 kernel %s is wrong on this CPU at %s: unused", name, shape)
                    continue
                copies = [packed] + [kernel.pack(codes.clone()) for _ in range(n_copies - 1)]
                times[name] = time_kernel(kernel, xb, copies)
            except RuntimeError as e:
                log.warning("int8 kernel %s fails at %s: %s", name, (out_f, in_f), e)
    return times


def machine_key() -> str:
    """What a choice depends on: CPU model, torch version, threads."""
    return f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


class Planner:
    """The kernel for each (shape, bucket): from the cache file, else measured once.

    One per process (`planner()`); thread-safe, as a worker's background
    fetch may load a model while the engine runs.
    """

    def __init__(self, path: Path | None):
        self.path = path
        self.key = machine_key()
        self.choices: dict[str, str] = {}
        self.timings: dict[str, dict[str, float]] = {}
        self.forced = os.environ.get(FORCE_ENV) or None
        if self.forced is not None and self.forced not in KERNELS:
            raise ValueError(f"{FORCE_ENV}={self.forced}: not one of {', '.join(KERNELS)}")
        self._lock = threading.Lock()
        self.choices = self._read()

    @staticmethod
    def _slot(out_f: int, in_f: int, b: int) -> str:
        return f"{out_f}x{in_f}@{ROW_BUCKETS[b]}"

    def choose(self, out_f: int, in_f: int, rows: int) -> Kernel:
        fits = fitting(out_f, in_f)
        if self.forced is not None:
            return KERNELS[self.forced if self.forced in fits else FALLBACK]
        b = bucket(rows)
        slot = self._slot(out_f, in_f, b)
        with self._lock:
            name = self.choices.get(slot)
            if name is None or name not in fits:
                self._measured(out_f, in_f, b)
                name = self.choices[slot]
                self._save()
        return KERNELS[name]

    def _measured(self, out_f: int, in_f: int, b: int) -> dict[str, float]:
        """The candidates' times at (shape, bucket), measured once in this
        process, the fastest recorded as the slot's choice. Caller holds the lock."""
        slot = self._slot(out_f, in_f, b)
        times = self.timings.get(slot)
        if times is None:
            times = measure(out_f, in_f, ROW_BUCKETS[b], fitting(out_f, in_f))
            self.timings[slot] = times
            self.choices[slot] = min(times, key=times.__getitem__) if times else FALLBACK
        return times

    def stacks(self, sizes: tuple[int, ...], in_f: int, rows: int) -> bool:
        """Whether one call over sibling linears' stacked codes (out widths
        `sizes`, one input width) beats a call per member at `rows` rows.

        Measured, not assumed: one wide call saves the per-call costs, but
        a kernel can stream a wide weight slower than two narrow ones
        (torch's int8 kernel at 1 row, docs/benchmarks.md). Each side runs
        its fastest correct kernel. Forced kernels always stack.
        """
        if self.forced is not None:
            return True
        b = bucket(rows)
        slot = f"stack {'+'.join(map(str, sizes))}x{in_f}@{ROW_BUCKETS[b]}"
        with self._lock:
            name = self.choices.get(slot)
            if name not in STACKING:
                # The same measurements choose each side's kernel: the stack's
                # and the members' slots are chosen here, not measured again.
                def best(out_f: int) -> float:
                    return min(self._measured(out_f, in_f, b).values(), default=float("inf"))

                fused, apart = best(sum(sizes)), sum(best(n) for n in sizes)
                name = STACKING[0] if fused <= apart else STACKING[1]
                self.choices[slot] = name
                self.timings[slot] = {STACKING[0]: fused, STACKING[1]: apart}
                self._save()
        return name == STACKING[0]

    def forget(self) -> None:
        """Measure every slot again at its next use (a benchmark's fresh start)."""
        with self._lock:
            self.choices.clear()
            self.timings.clear()

    def summary(self) -> dict[str, str]:
        """{"out x in @ rows": kernel} for every slot chosen so far."""
        with self._lock:
            return dict(sorted(self.choices.items()))

    def _read(self) -> dict[str, str]:
        """The choices in the cache file, if it is this machine's and readable."""
        return read_choices(self.path, self.key, lambda v: v in KERNELS or v in STACKING)

    def _save(self) -> None:
        # Other processes on this machine (workers, an eval) write the same
        # file: keep their slots, ours win where both measured.
        merged = {**self._read(), **self.choices}
        timings = {s: {k: round(v * 1e6, 1) for k, v in t.items()} for s, t in self.timings.items()}
        if not write_choices(self.path, self.key, merged, {"timings_us": timings}):
            self.path = None


def read_choices(path: Path | None, machine: str, valid: Callable[[str], bool]) -> dict[str, str]:
    """{slot: choice} from a choices file (this module's layout, also the
    compiled step's), if it is `machine`'s and readable; `valid` filters."""
    if path is None or not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
        if doc.get("version") != CACHE_VERSION or doc.get("machine") != machine:
            return {}
        return {
            str(k): v for k, v in doc.get("choices", {}).items() if isinstance(v, str) and valid(v)
        }
    except (OSError, ValueError, AttributeError) as e:
        log.warning("choices file %s unreadable (%s): measuring again", path, e)
        return {}


def write_choices(path: Path | None, machine: str, choices: dict[str, str], extra: dict) -> bool:
    """Write a choices file atomically; False (with a warning) if it cannot be."""
    if path is None:
        return False
    doc = {"version": CACHE_VERSION, "machine": machine, "choices": choices, **extra}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
        os.replace(tmp, path)
        return True
    except OSError as e:
        log.warning("choices file %s not written (%s): choices kept in memory", path, e)
        return False


def machine_slug() -> str:
    """`machine_key()` as a file name."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", machine_key()).strip("-").lower()[:150]


def cache_path() -> Path:
    """`<colonnade cache>/kernels/<machine>.json`."""
    from colonnade.model.loading import cache_root

    return cache_root() / "kernels" / f"{machine_slug()}.json"


_planners: dict[str, Planner] = {}
_planners_lock = threading.Lock()


def planner() -> Planner:
    """This process's planner for the current thread count (the key includes it)."""
    key = machine_key()
    with _planners_lock:
        if key not in _planners:
            _planners[key] = Planner(cache_path())
        return _planners[key]
