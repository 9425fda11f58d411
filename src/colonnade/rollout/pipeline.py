"""Rollouts from a pipeline of stage-workers, through the run's object store.

A model too big for one worker runs as a group of N stage-workers
(`engine/stages.py`: stage K holds a contiguous slice of the layers and
their KV cache). Who does what:

- the first stage (`Front`) runs the episode loop itself (`engine.Engine`,
  unchanged: turns, stop strings, tool replies, refill, shared prefills) over
  one `FrontStream` backend per micro-batch. Each stream's cache is its own
  stage's cache plus a journal: every cut the session makes (`Cache`: rows
  copied, written, appended, joined, gathered; caches made and dropped) is
  done on its own layers at once and recorded, and travels with the next
  step, so each later stage replays the same cuts on its own layers in the
  same order. A step runs the first stage's layers and puts a `Step`
  message for stage 2; the stream's thread then waits for the last stage's
  `Sampled` reply, while the other streams' steps run: with M micro-batches
  in flight the stages work on different micro-batches at once;
- a later stage (`StageServer`) reads each stream's next step at its key
  (listing the previous stage's messages beside, for new batches and
  streams), takes them in order, replays its cuts, runs its layers and
  puts the hidden states for the next stage; the last stage samples with the
  run's rule (`engine.sampling.sample`, the draws computed by the first
  stage from the rows' keys, `protocol.draws`) and puts the tokens, their
  log-probs and masses below, for the first stage.

Messages (`protocol/stages.py`) are inbox objects under the writer's own
prefix (`protocol.keys.stage_key`): `{worker}/stages/{batch}/{stream}/{seq}`.
Each is read once, checked as a stranger's object (bounds, dtypes, shapes,
finite values, and bound to the run, group, stage, batch, stream and step
the reader expects), and deleted by its writer once it is known read: a
stage's message of step n is read once the next step of its stream (n + 1)
reaches it, since the first stage sends a step only after the previous
step's reply came back through every stage. A batch number changes with
every `Front.generate`: a later stage drops older batches' caches and
deletes its messages of them.

Every stage runs the same published version: the first stage runs a batch
with one version (`Front.version` as the batch starts) and each step names
it; a later stage catches up to a newer one before it runs the step
(`StageServer.catch_up`, the stage-worker's follower) and refuses a step
of an older one than it runs (versions never go back).

A stage that dies loses the micro-batches in flight: the first stage's wait
runs out (`StageTimeout`) and the batch is not made; a claim lapses as for
any worker that stops. A reply that does not check (`BadReply`) ends the
batch the same way.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from colonnade.engine.layout import Block, Layout
from colonnade.engine.loop import Engine, Episode, Responder, units
from colonnade.engine.sampling import Draw, SamplingParams, sample
from colonnade.engine.stages import StageBackend
from colonnade.engine.torch_backend import TorchCache
from colonnade.protocol import keys
from colonnade.protocol.stages import (
    MAX_STAGE_BYTES,
    Binding,
    Op,
    Sampled,
    Step,
    pack_sampled,
    pack_step,
    unpack_sampled,
    unpack_step,
)
from colonnade.store import NotFound, ObjectStore, StoreError
from colonnade.untrusted import SchemaError

log = logging.getLogger("colonnade.pipeline")

POLL_S = 0.002  # between looks for an awaited message (a slow store paces itself)
TIMEOUT_S = 120.0  # a stage silent this long is taken for dead
# A later stage's reads and writes in flight at once: a read a stream
# under way, so as many as the micro-batches a front keeps in flight.
IO_THREADS = 32


class GroupError(ValueError):
    """A pipeline group a worker cannot take part in (the CLI's one-line error)."""


class StageTimeout(RuntimeError):
    """A stage did not answer in time: the micro-batches in flight are lost."""


class BadReply(StageTimeout):
    """The last stage's reply did not check: the batch is given up as for a
    silent stage (nothing of it is uploaded)."""


@dataclass(frozen=True)
class Group:
    """A pipeline group as every stage knows it: the run, the group's name,
    and its stage-workers' ids in stage order."""

    run: str
    name: str
    workers: tuple[str, ...]

    def binding(self, stage: int, batch: int, stream: int, seq: int) -> Binding:
        return Binding(self.run, self.name, stage, batch, stream, seq)


def _wait(store: ObjectStore, key: str, timeout: float, poll: float, what: str) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return store.get(key, max_bytes=MAX_STAGE_BYTES)
        except NotFound:
            if time.monotonic() > deadline:
                raise StageTimeout(f"no {what} in {timeout:g} s ({key})") from None
            time.sleep(poll)


def _delete(store: ObjectStore, key: str) -> None:
    with contextlib.suppress(NotFound):
        store.delete(key)


def _messages(store: ObjectStore, worker: str) -> dict[tuple[int, int, int], str]:
    """Stage `worker`'s messages in the store: (batch, stream, seq) -> key."""
    out = {}
    for key in store.list(keys.stage_dir(worker)):
        parsed = keys.parse_stage_key(key)
        if parsed is not None and parsed[0] == worker:
            out[parsed[1:]] = key
    return out


def _delete_before(store: ObjectStore, worker: str, batch: int) -> None:
    """Delete stage `worker`'s messages of batches older than `batch`."""
    if not getattr(store, "deletes", True):
        return  # a direct link's reader drops them itself: no listing to pay for
    for (b, _, _), key in _messages(store, worker).items():
        if b < batch:
            _delete(store, key)


class Journal:
    """One stream's cache cuts since its last step, in order; cache ids."""

    def __init__(self):
        self.ops: list[Op] = []
        self.ids = itertools.count()
        self.lock = threading.Lock()

    def add(self, op: Op) -> None:
        with self.lock:
            self.ops.append(op)

    def take(self) -> list[Op]:
        with self.lock:
            ops, self.ops = self.ops, []
        return ops


class FrontCache:
    """`backend.Cache` of the first stage: its own layers' cache, every cut
    also journaled for the later stages (`Op`s on this cache's id)."""

    def __init__(self, local: TorchCache, journal: Journal, made: Op | None = None, rows: int = 0):
        self.local, self.journal = local, journal
        self.id = next(journal.ids)
        if made is not None:  # copied from another cache
            made.other = self.id
            journal.add(made)
        else:
            journal.add(Op("new", self.id, -1, rows))
        # The later stages drop their copy once this one is gone.
        weakref.finalize(self, journal.add, Op("free", self.id))

    @property
    def empty(self) -> bool:
        return self.local.empty

    def rows(self, index: np.ndarray, drop: int) -> FrontCache:
        copied = self.local.rows(index, drop)
        return FrontCache(copied, self.journal, Op("rows", self.id, -1, drop, 0, index.copy()))

    def select(self, index: np.ndarray, drop: int) -> None:
        self.local.select(index, drop)
        self.journal.add(Op("select", self.id, -1, drop, 0, index.copy()))

    def write(self, slots: np.ndarray, other: FrontCache, start: int) -> None:
        self.local.write(slots, other.local, start)
        self.journal.add(Op("write", self.id, other.id, start, 0, slots.copy()))

    def append(self, rows: np.ndarray, other: FrontCache, width: int) -> None:
        self.local.append(rows, other.local, width)
        self.journal.add(Op("append", self.id, other.id, width, 0, rows.copy()))

    def join(self, other: FrontCache, pad_self: int, pad_other: int) -> None:
        self.local.join(other.local, pad_self, pad_other)
        self.journal.add(Op("join", self.id, other.id, pad_self, pad_other))

    def stack(self, others: list[FrontCache], pads: list[int]) -> None:
        self.local.stack([o.local for o in others], pads)
        index = np.array([[o.id, pad] for o, pad in zip(others, pads[1:], strict=True)])
        self.journal.add(Op("stack", self.id, -1, pads[0], 0, index.reshape(-1, 2)))

    def gather(self, index: np.ndarray) -> None:
        self.local.gather(index)
        self.journal.add(Op("gather", self.id, -1, 0, 0, index.copy()))


class FrontStream:
    """`backend.Backend` of one micro-batch at the first stage: its layers
    here, the rest down the line; `sample` is where the tokens come back."""

    name = "torch"

    def __init__(self, front: Front, batch: int, stream: int, version: int):
        self.front, self.batch, self.stream, self.version = front, batch, stream, version
        self.journal = Journal()
        self.seq = 0

    def new_cache(self, batch: int) -> FrontCache:
        return FrontCache(self.front.stage.new_cache(batch), self.journal, rows=batch)

    def forward(self, cache: FrontCache, block: Block, layout: Layout) -> torch.Tensor:
        """The step through every stage; its logits stay at the last stage
        (what samples is `sample`): [B, 0]."""
        self._step(cache, block, layout, None, None)
        return torch.empty(block.ids.shape[0], 0)

    def sample(
        self,
        cache: FrontCache,
        block: Block,
        layout: Layout,
        params: SamplingParams,
        draws: np.ndarray,
    ) -> Draw:
        got = self._step(cache, block, layout, params, np.asarray(draws, dtype=np.float64))
        return Draw(torch.from_numpy(got.tokens.copy()), torch.from_numpy(got.logprobs.copy()),
                    torch.from_numpy(got.below.copy()))  # fmt: skip

    def _step(self, cache, block, layout, params, draws) -> Sampled:
        front, seq = self.front, self.seq
        with front.compute:
            hidden = front.stage.run(cache.local, block, layout)
        dist = (params.temperature, params.top_k, params.top_p) if params else None
        step = Step(front.group.binding(0, self.batch, self.stream, seq), cache.id,
                    self.journal.take(), hidden.float().cpu().numpy(), block.positions,
                    layout.real, block.allowed, draws, dist, self.version)  # fmt: skip
        workers = front.group.workers
        mine = keys.stage_key(workers[0], self.batch, self.stream, seq)
        front.store.put(mine, pack_step(step))
        last = len(workers) - 1
        reply_key = keys.stage_key(workers[-1], self.batch, self.stream, seq)
        raw = _wait(
            front.store, reply_key, front.timeout, front.poll, f"reply from stage {last + 1}"
        )
        rows = 0 if draws is None else len(draws)
        try:
            got = unpack_sampled(raw, front.group.binding(last, self.batch, self.stream, seq),
                                 front.vocab, rows)  # fmt: skip
        except SchemaError as e:
            raise BadReply(f"reply from stage {last + 1} refused: {e}") from None
        front.io.submit(_delete, front.store, mine)  # off the step's path: a round trip
        self.seq += 1
        return got

    def refresh(self, state, changed) -> None:
        raise RuntimeError("a pipeline takes a newer state at its stages (Front.refresh)")


def split_streams(prompts: Sequence[Sequence[int]], streams: int) -> list[list[int]]:
    """Row indices in at most `streams` micro-batches, the rows of one
    prompt (a group) kept together, the micro-batches as even as the groups
    allow, in order."""
    groups = units(prompts, 0)
    streams = max(1, min(streams, len(groups)))
    total = sum(len(g) for g in groups)
    out: list[list[int]] = [[] for _ in range(streams)]
    k, done = 0, 0
    for g in groups:
        # Move on once this micro-batch holds its share of what came so far.
        if out[k] and done >= total * (k + 1) / streams and k < streams - 1:
            k += 1
        out[k].extend(g)
        done += len(g)
    return [s for s in out if s]


class Front:
    """The first stage of a group: runs the episodes, `in_flight`
    micro-batches at once."""

    def __init__(
        self,
        stage: StageBackend,
        store: ObjectStore,
        group: Group,
        tokenizer,
        vocab: int,
        in_flight: int = 2,
        timeout: float = TIMEOUT_S,
        poll: float = POLL_S,
    ):
        if not stage.stage.first or stage.stage.count != len(group.workers):
            raise ValueError("the front is the first stage of its group")
        self.stage, self.store, self.group = stage, store, group
        self.tokenizer, self.vocab = tokenizer, vocab
        self.in_flight, self.timeout, self.poll = in_flight, timeout, poll
        self.compute = threading.Lock()  # one stage's layers run one step at a time
        self.io = ThreadPoolExecutor(2, thread_name_prefix="front-io")
        self.batches = itertools.count(self._first_batch())
        self.version = 0  # the published version the stages run; a batch takes one

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        responders: Sequence[Responder],
        params: SamplingParams,
        keys_: Sequence[bytes],
        max_rows: int = 0,
    ) -> list[Episode]:
        """`Engine.generate` over the pipeline: the rows in micro-batches,
        each running in its own thread, their episodes in the rows' order."""
        if not (len(prompts) == len(responders) == len(keys_)):
            raise ValueError("one responder and one draw key per prompt")
        batch, version = next(self.batches), self.version
        self._clear(batch)
        parts = split_streams(prompts, self.in_flight)
        rows_each = -(-max_rows // len(parts)) if max_rows else 0

        def run(stream: int, rows: list[int]) -> list[Episode]:
            backend = FrontStream(self, batch, stream, version)
            engine = Engine(backend, copy.deepcopy(self.tokenizer), version)
            return engine.generate(
                [prompts[i] for i in rows],
                [responders[i] for i in rows],
                params,
                max_rows=rows_each,
                keys=[keys_[i] for i in rows],
            )

        out: list[Episode | None] = [None] * len(prompts)
        with ThreadPoolExecutor(len(parts), thread_name_prefix="stream") as pool:
            done = [pool.submit(run, s, rows) for s, rows in enumerate(parts)]
            for rows, fut in zip(parts, done, strict=True):
                for i, ep in zip(rows, fut.result(), strict=True):
                    out[i] = ep
        return out

    def _first_batch(self) -> int:
        """A number above every batch the group's stages hold messages of: a
        later stage takes only a batch newer than its last, so a front that
        restarts (or a second front on the same store) numbers on from there."""
        held = [b for w in self.group.workers for b, _, _ in _messages(self.store, w)]
        return max([int(time.time()) % 10_000_000, *(b + 1 for b in held)])

    def _clear(self, batch: int) -> None:
        """Delete this stage's messages of older batches: a batch given up
        (`StageTimeout`) leaves its last steps unanswered."""
        _delete_before(self.store, self.group.workers[0], batch)


class _Caches:
    """One stream's caches at a later stage, by the first stage's ids, with
    the cuts replayed on them; a cut the caches cannot take is a bad message."""

    def __init__(self, stage: StageBackend):
        self.stage = stage
        self.by_id: dict[int, TorchCache] = {}

    def get(self, i: int) -> TorchCache:
        if i not in self.by_id:
            raise SchemaError(f"no cache {i}")
        return self.by_id[i]

    def apply(self, ops: list[Op]) -> None:
        for n, op in enumerate(ops):
            try:
                self._apply(op)
            except (IndexError, RuntimeError, ValueError) as e:
                raise SchemaError(f"op {n} ({op.name}) does not fit the caches: {e}") from None

    def _apply(self, op: Op) -> None:
        if op.name == "new":
            self.by_id[op.cache] = self.stage.new_cache(op.a)
            return
        if op.name == "free":
            self.by_id.pop(op.cache, None)
            return
        cache = self.get(op.cache)
        if op.name == "stack":  # index: [others, 2], each other cache's id and pad
            others = [self.get(int(i)) for i in op.index[:, 0]]
            cache.stack(others, [op.a, *(int(p) for p in op.index[:, 1])])
            return
        if op.index is not None and not cache.empty:
            limit = cache.layers[0].keys.shape[2 if op.name == "gather" else 0]
            if op.index.size and int(op.index.max()) >= limit:
                raise IndexError(f"index {int(op.index.max())} of {limit}")
        if op.name == "rows":
            self.by_id[op.other] = cache.rows(op.index, op.a)
        elif op.name == "select":
            cache.select(op.index, op.a)
        elif op.name == "write":
            cache.write(op.index, self.get(op.other), op.a)
        elif op.name == "append":
            cache.append(op.index, self.get(op.other), op.a)
        elif op.name == "join":
            cache.join(self.get(op.other), op.a, op.b)
        elif op.name == "gather":
            cache.gather(op.index)


class StageServer:
    """A later stage of a group: steps in from the previous stage, hidden
    states (or, on the last stage, sampled tokens) out."""

    def __init__(
        self,
        stage: StageBackend,
        store: ObjectStore,
        group: Group,
        hidden_size: int,
        poll: float = POLL_S,
        io_threads: int = IO_THREADS,
        version: int = 0,
        catch_up: Callable[[int], None] | None = None,
    ):
        """`version`: the published version the stage's tensors are of;
        `catch_up(v)`: brings them to a newer version v, before a step of v
        runs (None: the stage takes steps of `version` only)."""
        k = stage.stage.index
        if k == 0 or stage.stage.count != len(group.workers):
            raise ValueError("a stage server is a later stage of its group")
        self.stage, self.store, self.group = stage, store, group
        self.hidden_size, self.poll = hidden_size, poll
        self.me, self.prev = group.workers[k], group.workers[k - 1]
        self.batch = -1
        self.caches: dict[int, _Caches] = {}  # stream -> its caches
        self.next: dict[int, int] = {}  # stream -> the step it takes next
        self.broken: set[int] = set()  # streams whose message was refused
        self.steps = 0
        self.version, self.catch_up = version, catch_up
        # Reads and writes overlap (a slow store's round trips would
        # otherwise add up, one micro-batch after another); steps run in turn.
        self.io = ThreadPoolExecutor(io_threads, thread_name_prefix="stage-io")
        self.writes: list[Future] = []

    def serve(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Take steps until `stop()`; a store error is logged and tried again."""
        try:
            while not stop():
                try:
                    took = self.poll_once()
                except StoreError as e:
                    log.warning("stage %d: %s", self.stage.stage.index + 1, e)
                    took = 0
                if not took:
                    time.sleep(self.poll)
        finally:
            self.flush()

    def flush(self) -> None:
        """Wait for the messages put so far."""
        writes, self.writes = self.writes, []
        for w in writes:
            w.result()

    def poll_once(self) -> int:
        """Take every step that has arrived, each stream's in order; how many.

        A stream under way is read at its next step's key, which one round
        trip finds and reads; beside those reads, a listing of the previous
        stage's messages finds a new batch, new streams, and a message that
        landed after its read."""
        under_way = [(stream, seq, keys.stage_key(self.prev, self.batch, stream, seq))
                     for stream, seq in sorted(self.next.items())
                     if stream not in self.broken]  # fmt: skip
        listing = self.io.submit(_messages, self.store, self.prev)
        found = list(self.io.map(self._read, under_way))
        ready = listing.result()
        newest = max((b for b, _, _ in ready), default=-1)
        done = 0
        if newest > self.batch:
            self._new_batch(newest)  # what was read is of an older batch
        else:
            for (stream, seq, _), raw in zip(under_way, found, strict=True):
                if raw is not None and stream not in self.broken:
                    self._take(stream, seq, raw)
                    done += 1
        # Each stream's next step may be followed by more of it in one look
        # (a message read late): take them in order, a round at a time.
        while True:
            wanted = [(stream, seq, key) for (batch, stream, seq), key in sorted(ready.items())
                      if batch == self.batch and stream not in self.broken
                      and seq == self.next.get(stream, 0)]  # fmt: skip
            if not wanted:
                return done
            for (stream, seq, _), raw in zip(wanted, self.io.map(self._read, wanted), strict=True):
                if raw is not None:
                    self._take(stream, seq, raw)
                    done += 1
                else:
                    self.broken.add(stream)  # listed, then gone: not its writer's honest order

    def _read(self, item: tuple[int, int, str]) -> bytes | None:
        try:
            return self.store.get(item[2], max_bytes=MAX_STAGE_BYTES)
        except NotFound:
            return None

    def _new_batch(self, batch: int) -> None:
        self.flush()
        _delete_before(self.store, self.me, batch)
        self.batch, self.caches, self.next, self.broken = batch, {}, {}, set()

    def _take(self, stream: int, seq: int, raw: bytes) -> None:
        k = self.stage.stage.index
        binding = self.group.binding(k - 1, self.batch, stream, seq)
        caches = self.caches.setdefault(stream, _Caches(self.stage))
        try:
            step = unpack_step(raw, binding, self.hidden_size)
            # A fetch that fails (the store's, or a version that does not
            # verify) raises on: the step stays, to be taken once it is fetched.
            self._run_version(step.version)
        except ValueError as e:
            self._refuse(stream, seq, e)
            return
        try:
            caches.apply(step.ops)
            out = self._run(caches.get(step.cache), step)
        except (ValueError, RuntimeError, IndexError) as e:
            # A step the caches cannot take (rows or columns that disagree
            # with them): the stream's, never the stage's end.
            self._refuse(stream, seq, e)
            return
        mine = keys.stage_key(self.me, self.batch, stream, seq)
        read = keys.stage_key(self.me, self.batch, stream, seq - 1) if seq else None
        self.writes.append(self.io.submit(self._write, mine, out, read))
        self.next[stream] = seq + 1
        self.steps += 1

    def _refuse(self, stream: int, seq: int, why: Exception) -> None:
        k = self.stage.stage.index
        log.warning("stage %d: refused step %d of stream %d: %s", k + 1, seq, stream, why)
        self.broken.add(stream)  # its episodes are lost; the first stage times out

    def _run_version(self, v: int) -> None:
        """The stage's tensors at version `v`, or a ValueError (the step is
        refused): a version older than the one the stage runs."""
        if v == self.version:
            return
        if v < self.version:
            raise ValueError(f"a step of v{v}, but this stage runs v{self.version} already")
        if self.catch_up is None:
            raise ValueError(f"a step of v{v}: this stage runs v{self.version} alone")
        self.flush()  # what was put so far is of the last version's steps
        self.catch_up(v)
        self.version = v

    def _write(self, key: str, data: bytes, read: str | None) -> None:
        self.store.put(key, data)
        if read is not None:
            _delete(self.store, read)

    @torch.inference_mode()
    def _run(self, cache: TorchCache, step: Step) -> bytes:
        layout = Layout(0)
        layout.real = step.real
        block = Block(None, step.positions, step.allowed)
        k = self.stage.stage.index
        out = self.stage.run(cache, block, layout, torch.from_numpy(step.hidden))
        binding = self.group.binding(k, self.batch, step.binding.stream, step.binding.seq)
        if not self.stage.stage.last:
            nxt = Step(binding, step.cache, step.ops, out.float().cpu().numpy(), step.positions,
                       step.real, step.allowed, step.draws, step.distribution,
                       step.version)  # fmt: skip
            return pack_step(nxt)
        if step.draws is None:
            return pack_sampled(Sampled(binding))
        t, k_, p = step.distribution
        params = SamplingParams(temperature=t, top_k=k_, top_p=p)
        got = sample(out, params, step.draws)
        return pack_sampled(Sampled(binding, got.tokens.numpy(), got.logprobs.numpy(),
                                    got.below.numpy()))  # fmt: skip
