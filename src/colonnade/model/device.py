"""Where a model runs: CUDA, Apple MPS or CPU, chosen automatically."""

from __future__ import annotations

import torch

DEVICES = ("auto", "cpu", "cuda", "mps")


def pick_device(preference: str = "auto") -> torch.device:
    """The requested device, or with `auto` the fastest one present."""
    if preference not in DEVICES:
        raise ValueError(f"unknown device {preference!r}; choose one of {', '.join(DEVICES)}")
    if preference == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if preference == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    if preference == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' requested but torch sees no Apple MPS device")
    return torch.device(preference)


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory so far: CUDA's `max_memory_allocated` on a
    GPU, else the peak resident set (VmHWM; ru_maxrss off Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
