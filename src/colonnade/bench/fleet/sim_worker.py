"""The simulated worker: the real `Worker` loop with the model taken out.

`worker_class()` builds `SimWorker`, whose engine is a `SimEngine` holding
the version its follower verified (its `SimLoader` builds one in place of
the model) and whose batches are `Policy`'s smoke episodes. `shared_decode`
and `shared_model` are installed by `simulation.run_fleet` around a whole
fleet, so that work every worker would repeat identically (decoding a
patch, initialising the model skeleton) is done once while each worker
still makes every request it would make.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time


class Policy:
    """Smoke episodes without a model: the answer tag around the task's word
    (right with probability `right`, else another colour or 'unsure'), as
    tokens the trainer decodes, replays and scores like any other."""

    def __init__(self, tokenizer, env, right: float = 0.5) -> None:
        from colonnade.envs.smoke import COLOURS, UNSURE

        self.tok, self.env, self.right = tokenizer, env, right
        words = (*COLOURS, UNSURE)
        self.answers = {
            w: tokenizer.encode(f"<answer> {w}</answer>", add_special_tokens=False) for w in words
        }

    def episode(self, task, key: bytes):
        """One made-up episode whose randomness is its row's draws (`key`), with
        the intervals an honest worker would report for them."""
        import numpy as np

        from colonnade.protocol import EpisodeRecord
        from colonnade.protocol.draws import below_for, uniforms

        rng = random.Random(key)
        word = task.answers[0]
        if rng.random() >= self.right:
            word = rng.choice([w for w in self.answers if w != word])
        ids = self.answers[word]
        # Made-up behaviour log-probs (<= 0, as the schema requires).
        logps = [round(-rng.uniform(0.01, 1.5), 4) for _ in ids]
        below = below_for(uniforms(key, range(len(ids))), np.array(logps))
        return EpisodeRecord(list(ids), [True] * len(ids), logps, "done", below.tolist())


class SimEngine:
    """The engine's contract as far as the worker loop reads it: a version and a name."""

    name = "torch"

    def __init__(self, version: int) -> None:
        self.version = version


def worker_class():
    """SimWorker, built on first use: the role module imports torch."""
    from colonnade.rollout.weights import EngineLoader
    from colonnade.rollout.worker import Stop, Worker

    class ThreadStop(Stop):
        """Stop without signal handlers: a worker thread cannot install them;
        the bench sets `requested` to make a worker leave."""

        def install(self) -> None:
            pass

    class SimLoader(EngineLoader):
        """What engine_for / refresh do, minus the model: hold the version
        the follower verified."""

        def build(self, state, version: int) -> SimEngine:
            return SimEngine(version)

        def refresh(self, engine, state, changed, version: int) -> None:
            engine.version = version

    class SimWorker(Worker):
        """The real worker loop with generation replaced by `Policy`."""

        loader_class = SimLoader

        def __init__(self, cfg, store, policy: Policy, gen_seconds: float) -> None:
            super().__init__(cfg, store)
            self.stop = ThreadStop()
            self.policy, self.gen_seconds = policy, gen_seconds

        def make_batch(self):
            from colonnade.protocol import GroupRecord, RolloutBatch

            v, slot, chosen, draws = self.assignment()
            g = self.joined.spec.group_size
            groups = [
                GroupRecord(t.id, [self.policy.episode(t, draws[i * g + row]) for row in range(g)])
                for i, t in enumerate(chosen)
            ]
            time.sleep(self.gen_seconds)  # the generation this batch stands for
            return RolloutBatch(self.id, v, self.seq, groups, {"reward_claimed": 0.0},
                                SimEngine.name, slot)  # fmt: skip

    return SimWorker


class SharedDecode:
    """Stands in for the `pulse` module inside `protocol.weights` while the
    fleet runs, so that a patch is decoded once for the whole fleet.

    Every worker still downloads each patch and the Follower checks it as
    always; only `apply` onto a base whose hash the follower knows is shared:
    the first worker to ask decodes (and verifies the result's hash), the
    others get the same tensors. Without it a large fleet decoding every
    patch takes the cores from the trainer. Everything else is the real module.
    """

    def __init__(self, real, keep: int = 64) -> None:
        self._real, self._keep = real, keep
        self._done: dict[tuple[str, str], dict] = {}
        self._busy: dict[tuple[str, str], threading.Lock] = {}
        self._lock = threading.Lock()
        self.decoded = self.shared = 0

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def apply(self, base, patch, *, base_hash: str | None = None, in_place: bool = False):
        # Never in place: the fleet's followers share one copy of each state,
        # which one of them must not rewrite under the others.
        if base_hash is None:
            return self._real.apply(base, patch, base_hash=base_hash)
        key = (base_hash, self._real.read_header(patch)["result_hash"])
        with self._lock:
            busy = self._busy.setdefault(key, threading.Lock())
        with busy:  # the first caller decodes; the others wait for its result
            if key not in self._done:
                result = self._real.apply(base, patch, base_hash=base_hash)
                with self._lock:
                    self._done[key] = result
                    self.decoded += 1
                    while len(self._done) > self._keep:
                        old = next(iter(self._done))
                        self._done.pop(old)
                        self._busy.pop(old, None)
                return dict(result)
            self.shared += 1
            return dict(self._done[key])


@contextlib.contextmanager
def shared_decode():
    """`SharedDecode` installed in protocol.weights for the duration."""
    from colonnade.protocol import weights

    real = weights.pulse
    weights.pulse = shim = SharedDecode(real)
    try:
        yield shim
    finally:
        weights.pulse = real


@contextlib.contextmanager
def shared_model(model, tokenizer):
    """Workers' `fetch_model` for the duration: each worker still downloads
    the run's model files (counted like any request), but gets the one
    skeleton and tokenizer built here instead of initialising its own (a
    random init of the tiny model each: most of a large fleet's start-up CPU)."""
    from colonnade.protocol import keys
    from colonnade.protocol.model_files import MODEL_FILE_LIMIT
    from colonnade.rollout import worker as worker_module

    def fetch(store, spec):
        for name in spec.model_files:
            store.get(keys.model_file(name), max_bytes=MODEL_FILE_LIMIT)
        return model, tokenizer

    real = worker_module.fetch_model
    worker_module.fetch_model = fetch
    try:
        yield
    finally:
        worker_module.fetch_model = real
