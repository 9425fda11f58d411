"""A worker's weights: the newest version fetched beside generation, then installed.

`Weights` holds the `Follower` (download, patch, hash check of each
version) and the engine. A fetch runs in the background (`Background`)
while the engine generates with the weights it holds, and `catch_up`
installs what it fetched: the only stall is loading the changed tensors
into the engine. PULSE leaves the tensors a patch did not rewrite as they
were (the same objects), so identity tells which ones to load.

How a state becomes an engine is the `EngineLoader`'s: built from the first
version through `colonnade.engine.engine_for`, refreshed in place after. A
simulated worker swaps in its own loader; the rest is the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from colonnade.background import Background
from colonnade.engine import Engine, engine_for, refresh
from colonnade.protocol import Follower
from colonnade.protocol.schemas import Latest


class EngineLoader:
    """The run's model skeleton, tokenizer and precision on this device:
    what `engine_for` needs besides the state."""

    def __init__(self, model, tokenizer, precision: str, device: torch.device, kind: str,
                 aliases: dict[str, str]) -> None:  # fmt: skip
        self.model, self.tokenizer, self.precision = model, tokenizer, precision
        self.device, self.kind, self.aliases = device, kind, aliases

    @property
    def label(self) -> str:
        """The engine as a heartbeat names it."""
        if self.kind == "mlx":
            return f"mlx-{self.precision}"
        return f"{self.precision}-{'w8' if self.device.type == 'cpu' else 'float'}"

    def build(self, state: dict[str, torch.Tensor], version: int) -> Engine:
        return engine_for(
            self.model,
            self.tokenizer,
            state,
            self.precision,
            self.device,
            self.kind,
            version,
            self.aliases,
        )

    def refresh(self, engine: Engine, state: dict[str, torch.Tensor], changed: set[str],
                version: int) -> None:  # fmt: skip
        refresh(engine, state, changed, version)


@dataclass(frozen=True)
class Installed:
    """A version the engine now runs, and what it cost."""

    before: int | None  # the version it ran until now
    apply_seconds: float  # download, patch, hash check (beside generation)
    load_seconds: float  # the changed tensors into the engine (generation stalled)


class Weights:
    def __init__(self, follower: Follower, loader: EngineLoader) -> None:
        self.follower, self.loader = follower, loader
        self.engine: Engine | None = None  # built once the first version's weights load
        self.prefetch = Background("fetch")  # the follower's next sync, while generating
        self._fetched: float | None = None  # seconds the last fetch took, until installed
        # The state objects the engine last loaded: a tensor a patch rewrote
        # is a new object, so the keys to load again are those whose object
        # differs from the engine's (whatever the follower went through since,
        # a fetch that failed half-way included).
        self._loaded: dict[str, torch.Tensor] = {}
        self._bytes_counted = 0

    @property
    def running_version(self) -> int | None:
        """The version the engine generates with (None before the first)."""
        return self.engine.version if self.engine is not None else self.follower.version

    def fetch(self, latest: Latest) -> None:
        """Move the follower to `latest`'s version: download, patch, hash
        check. In the background but for the first version."""
        t0 = time.perf_counter()
        if self.follower.sync(latest.version, known=latest.meta):
            self._fetched = time.perf_counter() - t0

    def catch_up(self, latest: Latest | None, generate_on: Callable[[], bool]) -> Installed | None:
        """Start fetching `latest`'s version if the follower is behind it,
        and install a fetched version: at once if one is ready, else after
        waiting for the fetch in flight unless `generate_on()` says the
        engine has work with the version it runs. The fetch reads no
        pointer of its own: `latest` is the worker's last look."""
        behind = (
            latest is not None
            and self.follower.version is not None
            and (latest.version > self.follower.version)
        )
        if behind and not self.prefetch.busy and self._fetched is None:
            self.prefetch.submit(lambda: self.fetch(latest))
        if self.prefetch.busy and generate_on():
            return None
        self.prefetch.wait()  # raises what the fetch raised
        fetched, self._fetched = self._fetched, None
        return self._install(fetched) if fetched is not None else None

    def _install(self, apply_seconds: float) -> Installed:
        before = self.running_version
        t0 = time.perf_counter()
        self.load()
        return Installed(before, apply_seconds, time.perf_counter() - t0)

    def load(self) -> None:
        """The follower's state into the engine: the first time built, then
        in place, only the tensors that are not the objects it loaded last."""
        state, version = self.follower.state, self.follower.version
        if self.engine is None:
            self.engine = self.loader.build(state, version)
        else:
            changed = {k for k, t in state.items() if self._loaded.get(k) is not t}
            self.loader.refresh(self.engine, state, changed, version)
        held = getattr(self.loader, "held", None)
        if held is not None:
            # The follower keeps the engine's codes in place of its own: one
            # copy of the weights, not two (a loader that offers them runs a
            # state its follower never rewrites in place).
            state.update(held(self.engine, set(state)))
        self._loaded = dict(state)

    def new_bytes(self) -> int:
        """Weight bytes the follower read since the last call."""
        read = self.follower.bytes_read
        new, self._bytes_counted = read - self._bytes_counted, read
        return new

    def close(self) -> None:
        """Wait for the fetch in flight (raising its error), then stop fetching."""
        self.prefetch.close()
