"""The trainer's ranks: one process, or N under `torchrun` with FSDP2.

    torchrun --nproc-per-node N -m colonnade trainer …

`init_distributed` reads torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK) and joins the process group: NCCL on CUDA, gloo on CPU (how the
same code is tested on a machine without GPUs). Without torchrun, or with one
rank, there is no process group and every collective here is a no-op, so the
single-device trainer runs the same code.

Rank 0 leads: it alone talks to the store for rollouts and versions. Every
collective the ranks make together is announced first by a `Command` that
rank 0 broadcasts, and the other ranks do what they are told
(`Trainer.follow`), so no rank can enter a collective the others skip.
Nothing crosses between ranks but tensors: no pickled objects.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from enum import IntEnum

import torch
import torch.distributed as dist

from colonnade.model.device import pick_device

log = logging.getLogger("colonnade.trainer")


class Command(IntEnum):
    """What rank 0 asks of every rank next; `arg` says for which version."""

    PING = 0  # still collecting rollouts: keeps waiting ranks under the timeout
    STEP = 1  # a training step on the batch broadcast next
    SNAPSHOT = 2  # gather the full state for publication
    CHECKPOINT = 3  # save a sharded checkpoint of version `arg`
    LOAD = 4  # load the checkpoint of version `arg`
    DONE = 5  # the run is over (or stopped): leave the loop


@dataclass
class Dist:
    """This process's place among the trainer's ranks."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None  # None: one process, no process group

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """True when the model is split across ranks with FSDP2."""
        return self.backend is not None

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        # NCCL moves device tensors only; gloo CPU tensors.
        return t.to(self.device) if self.backend == "nccl" else t

    def command(self, cmd: Command = Command.PING, arg: int = 0) -> tuple[Command, int]:
        """Rank 0 sends (cmd, arg); every other rank receives it."""
        if not self.sharded:
            return cmd, arg
        t = self._wire(torch.tensor([int(cmd), arg], dtype=torch.int64))
        dist.broadcast(t, src=0)
        got = t.cpu().tolist()
        return Command(got[0]), int(got[1])

    def broadcast(self, tensors: list[torch.Tensor] | None, dtypes: list[torch.dtype]):
        """Rank 0's 1-D tensors (of `dtypes`, in order) on every rank."""
        if not self.sharded:
            return tensors
        sizes = torch.zeros(len(dtypes), dtype=torch.int64)
        if self.leader:
            sizes = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
        sizes = self._wire(sizes)
        dist.broadcast(sizes, src=0)
        out = []
        for i, (n, dtype) in enumerate(zip(sizes.cpu().tolist(), dtypes, strict=True)):
            t = tensors[i].to(dtype) if self.leader else torch.empty(n, dtype=dtype)
            t = self._wire(t.contiguous())
            dist.broadcast(t, src=0)
            out.append(t.cpu())
        return out

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of each rank's `t` (a new CPU tensor on every rank)."""
        if not self.sharded:
            return t
        w = self._wire(t.clone())
        dist.all_reduce(w, op=dist.ReduceOp.SUM)
        return w.cpu()

    def barrier(self) -> None:
        if self.sharded:
            dist.barrier()

    def close(self) -> None:
        if self.sharded and dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies. torchrun starts each
    rank in a session of its own; a torchrun killed outright would otherwise
    leave its ranks training on, unwatched."""
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() == 1:  # the parent died before the call
        os.kill(os.getpid(), signal.SIGKILL)


def init_distributed(device: str = "auto", timeout_s: float = 3600.0, fsdp: bool = False) -> Dist:
    """This process's Dist: from torchrun's environment, or a single process.

    `fsdp` on a single process makes a process group of one, so that the
    model is still wrapped by FSDP2: its mixed precision casts one layer's
    weights to bf16 at a time, where autocast holds a bf16 copy of the whole
    model during the forward (what lets an 8B model train on one 141 GB GPU).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    where = pick_device(device)
    if world <= 1 and not fsdp:
        return Dist(device=where)
    if world <= 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        world = 1
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    die_with_parent()
    if where.type == "mps":
        raise ValueError("several trainer ranks need CUDA (NCCL) or the CPU (gloo), not MPS")
    if where.type == "cuda":
        if local >= torch.cuda.device_count():
            raise ValueError(
                f"local rank {local} has no GPU: {torch.cuda.device_count()} visible, "
                "so --nproc-per-node must not exceed it"
            )
        torch.cuda.set_device(local)
        where, backend = torch.device("cuda", local), "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    log.info("rank %d of %d on %s (%s), pid %d", rank, world, where, backend, os.getpid())
    return Dist(rank=rank, world=world, local_rank=local, device=where, backend=backend)
