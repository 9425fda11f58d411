"""A worker that runs one stage of a pipeline group (`colonnade worker --stage K/N`).

A model bigger than any one worker runs on a group of N workers, each
started with `--stage K/N` and the same `--stage-group ID1,...,IDN` (the
group's worker ids in stage order). Every stage plans the same cuts from
the run's model config (`engine.stages.plan_stages`), so the group agrees
on who holds which layers without a word; the group's name in every stage
message is a digest of the list, so a stage started with another list is
refused by the others.

- Stage 1, the front (`FrontWorker`), is a worker like any other: it
  follows the versions, claims slots, runs the episodes through the
  pipeline (`pipeline.Front`, behind the engine's surface: `PipelineEngine`),
  signs and uploads the group's batch as its own, and heartbeats. A batch
  whose stages do not answer (`StageTimeout`: one died) or whose reply does
  not check (`BadReply`) is given up: nothing of it is uploaded, its
  claim lapses as any stopped worker's does, and the front tries again
  after a pause.
- Stages 2..N (`StageWorker`) serve steps (`pipeline.StageServer`) until
  the run is done or a signal stops them, with the worker's own heartbeat.
  A stage runs the version each step names: it catches up to a newer one
  before the step (the step waits for the load; the fetch ran beside the
  steps once latest.json named the version), and refuses an older one or
  one latest.json has not named (a hostile front's: it would be looked for
  at every step).

Each stage holds only its own tensors (`stageweights.StageFollower`): it
follows the run's versions as a worker does, but keeps, patches and loads
the tensors of its layers alone, so no stage ever holds the whole model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from functools import partial

from colonnade.config import WorkerConfig
from colonnade.engine.loop import Episode, seeded_keys
from colonnade.engine.sampling import SamplingParams
from colonnade.engine.stages import (
    Stage,
    StageBackend,
    build_stage,
    plan_stages,
    stage_names,
    stage_skeleton,
)
from colonnade.protocol import RunSpec
from colonnade.protocol.signing import Trust
from colonnade.store import ObjectStore

from .pipeline import Front, Group, GroupError, StageServer, StageTimeout
from .stagelink import Keyring, open_link
from .stageweights import StageFollower
from .weights import EngineLoader, Weights
from .worker import Worker

log = logging.getLogger("colonnade.worker")

GIVEN_UP_PAUSE_S = (5.0, 15.0)  # after a batch whose stages did not answer
# A later stage looks for steps this often while a batch runs, and at its
# poll_seconds (at most IDLE_LOOK_S) once none came for BUSY_S: a store's
# listing is a billed request, and a batch's first step waits one look.
BUSY_LOOK_S, IDLE_LOOK_S, BUSY_S = 0.005, 0.25, 2.0


def group_name(ids: Sequence[str]) -> str:
    """The group's name in its stage messages: its ids in stage order, digested."""
    return "g-" + hashlib.sha256("\n".join(ids).encode()).hexdigest()[:24]


def stage_worker(cfg: WorkerConfig, store: ObjectStore | None = None) -> Worker:
    """The worker of `cfg`'s stage: the front for stage 1, a server after."""
    k, _ = cfg.pipeline()
    cfg = dataclasses.replace(cfg, engine="torch")  # the stages are torch models
    return FrontWorker(cfg, store) if k == 0 else StageWorker(cfg, store)


class PipelineEngine:
    """What the episode runner (`episodes.run_episodes`) and the worker use
    of an `Engine`, over a pipeline's front: its batches run down the line."""

    name = "torch"  # each stage runs the torch backend's forward

    def __init__(self, front: Front, version: int):
        self.front = front
        front.version = version

    @property
    def version(self) -> int:
        return self.front.version

    @property
    def tokenizer(self):
        return self.front.tokenizer

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        responders,
        params: SamplingParams,
        seed: int = 0,
        max_rows: int = 0,
        share_prefix: bool = True,
        split_replies: bool = True,
        keys: Sequence[bytes] | None = None,
    ) -> list[Episode]:
        """`Engine.generate`'s contract; groups always share their prefill
        and replies are fed as the engine loop feeds them (the front runs
        that loop)."""
        keys = seeded_keys(seed, len(prompts)) if keys is None else keys
        return self.front.generate(prompts, responders, params, keys, max_rows)


class StageLoader:
    """How a stage's tensors become what it runs: `EngineLoader`'s role
    (`Weights` builds once, refreshes after) for one stage of a group."""

    def __init__(self, base: EngineLoader, stage: Stage, group: Group, inbox: ObjectStore,
                 cfg: WorkerConfig, catch_up=None,
                 link: Callable[[], ObjectStore] | None = None):  # fmt: skip
        """`link`: opens the stage's direct link (`--stage-link tcp`); None:
        its messages go through the inbox."""
        self.base, self.stage, self.group, self.inbox = base, stage, group, inbox
        self.cfg, self.catch_up, self.link = cfg, catch_up, link
        self.transport: ObjectStore | None = None
        self.device, self.precision = base.device, base.precision
        self.config = base.model.config

    @property
    def label(self) -> str:
        """The engine as a heartbeat names it: the precision's, and the stage."""
        return f"{self.base.label}-stage{self.stage.index + 1}of{self.stage.count}"

    def mine(self) -> Callable[[str], bool]:
        """Whether a published tensor is this stage's."""
        names = stage_names(*stage_skeleton(self.config, self.stage), self.stage)
        return lambda name: names.local(name) is not None

    def backend(self, state) -> StageBackend:
        # Shared: the stage's follower never rewrites a tensor in place (a
        # patch makes new ones), and takes the engine's codes back (`held`).
        return build_stage(self.config, state, self.stage, self.precision, self.device,
                           share=True)  # fmt: skip

    def held(self, engine, published) -> dict:
        """The codes the stage runs, by published name (`Weights.load`)."""
        backend = engine.front.stage if self.stage.first else engine.stage
        return backend.held(published)

    def build(self, state, version: int):
        backend = self.backend(state)
        # The link opens once the stage can serve: its address, once in the
        # inbox, is what the stage before it waits for.
        if self.transport is None:
            self.transport = self.inbox if self.link is None else self.link()
        if self.stage.first:
            vocab = self.config.get_text_config().vocab_size
            front = Front(backend, self.transport, self.group, self.base.tokenizer, vocab,
                          self.cfg.stage_in_flight, self.cfg.stage_timeout)  # fmt: skip
            return PipelineEngine(front, version)
        hidden = self.config.get_text_config().hidden_size
        return StageServer(backend, self.transport, self.group, hidden, version=version,
                           catch_up=self.catch_up)  # fmt: skip

    def refresh(self, engine, state, changed: set[str], version: int) -> None:
        if self.stage.first:
            engine.front.stage.refresh(state, changed)
            engine.front.version = version
        else:
            engine.stage.refresh(state, changed)
            engine.version = version


class _Stage:
    """What stage 1 and the later stages share (a mixin of `Worker`): the
    group from the settings, the cut from the model's config, and a follower
    of the stage's own tensors in place of the whole worker's."""

    catch_up: Callable[[int], None] | None = None  # a later stage's: steps name versions

    def _group_check(self: Worker) -> None:
        k, ids = self.cfg.pipeline()
        if self.id != ids[k]:
            raise GroupError(f"this worker is {self.id!r}, but stage {k + 1} of --stage-group "
                             f"is {ids[k]!r}: pass --id {ids[k]}")  # fmt: skip

    def wire(self: Worker, spec: RunSpec, trust: Trust, inbox: ObjectStore,
             loader: EngineLoader) -> None:  # fmt: skip
        super().wire(spec, trust, inbox, loader)
        k, ids = self.cfg.pipeline()
        try:
            plan = plan_stages(loader.model, len(ids))
        except ValueError as e:  # more stages than layers
            raise GroupError(str(e)) from None
        group = Group(spec.run_id, group_name(ids), ids)
        link = None
        if self.cfg.stage_link == "tcp":
            ring = Keyring.of_run(self.store, trust) if spec.signed else None
            link = partial(open_link, group, k, inbox, keyring=ring, private=self.private,
                           listen=self.cfg.stage_listen, advertise=self.cfg.stage_advertise,
                           timeout=self.cfg.stage_timeout)  # fmt: skip
        loader = StageLoader(loader, plan[k], group, inbox, self.cfg, self.catch_up, link)
        follower = StageFollower(self.store, spec.anchor_every, trust, loader.mine())
        self.weights = Weights(follower, loader)  # not the whole worker's Follower
        stage = plan[k]
        log.info("stage %d of %d: layers %d..%d of the group %s", k + 1, len(ids), stage.start,
                 stage.stop - 1, ", ".join(ids))  # fmt: skip


class FrontWorker(_Stage, Worker):
    """Stage 1 of a group: a worker whose engine is the pipeline."""

    def __init__(self, cfg: WorkerConfig, store: ObjectStore | None = None):
        super().__init__(cfg, store)
        self._group_check()

    def setup(self) -> None:
        super().setup()
        if getattr(self.joined.env, "worker_rewards", False):
            raise GroupError(
                f"environment {self.joined.spec.env!r} runs its own loop over an endpoint; "
                "a pipeline runs the engine's episode loop only"
            )

    def iteration(self) -> None:
        try:
            super().iteration()
        except StageTimeout as e:
            # The batch is not made: the claim lapses as a stopped worker's.
            pause = random.uniform(*GIVEN_UP_PAUSE_S)
            log.warning("batch given up (%s); next claim in %.0f s", e, pause)
            time.sleep(pause)


class StageWorker(_Stage, Worker):
    """Stage 2..N of a group: serves the steps the stage before it sends."""

    def __init__(self, cfg: WorkerConfig, store: ObjectStore | None = None):
        super().__init__(cfg, store)
        self._group_check()
        self._looked = 0.0  # when latest.json was last read (the run's end)
        self._busy = 0.0  # when a step last came

    @property
    def server(self) -> StageServer | None:
        return self.weights.engine

    def iteration(self) -> None:
        """Take the steps that came; between them, look at latest.json now
        and then (the run's end, the first version to build from, and a
        newer one to fetch beside the steps)."""
        if time.monotonic() - self._looked > self.cfg.poll_seconds:
            self._looked = time.monotonic()
            latest = self.watch.poll()
            if self.server is None and latest is not None:
                self.weights.fetch(latest)  # the newest version: where the front starts too
                self.weights.load()
                log.info("stage ready at v%d", self.running_version)
            elif (latest is not None and not self.weights.prefetch.busy
                  and latest.version > self.weights.follower.version):  # fmt: skip
                # The front takes the newest version at its next batch: its
                # first step then waits for the load alone, not the fetch.
                self.weights.prefetch.submit(lambda: self.weights.fetch(latest))
        if self.server is not None and self.server.poll_once():
            self._busy = time.monotonic()
            return
        idle = time.monotonic() - self._busy > BUSY_S
        time.sleep(min(self.cfg.poll_seconds, IDLE_LOOK_S) if idle else BUSY_LOOK_S)

    def catch_up(self, version: int) -> None:
        """This stage's tensors of `version` (newer than the ones it runs),
        loaded before the step that named it runs."""
        self._published(version)
        t0 = time.perf_counter()
        before = self.running_version
        self.weights.prefetch.wait()  # a fetch beside the steps; its error raises here
        beside = self.weights.follower.version == version
        if not beside:  # not fetched yet, or one newer than the front runs
            self.weights.follower.sync(version)
        t1 = time.perf_counter()
        self.weights.load()
        self.tally.synced(t1 - t0, time.perf_counter() - t1)
        log.info("now running v%d (was v%s; %s, waited %.2f s, loaded %.2f s)", version, before,
                 "fetched beside the steps" if beside else "fetched now", t1 - t0,
                 time.perf_counter() - t1)  # fmt: skip

    def _published(self, version: int) -> None:
        """A ValueError (the step is refused) for a version latest.json has
        not named: a front takes its version from latest.json, so an honest
        step's is there by the time it comes; a hostile one's may never be,
        and the stage would otherwise look for it at every step it reads."""
        newest = self.watch.newest
        if newest is None or newest < version:
            self.watch.poll()
            newest = self.watch.newest
        if newest is None or newest < version:
            raise ValueError(f"a step of v{version}, but latest.json names v{newest} at most")

    def run(self) -> int:
        try:
            return super().run()
        finally:
            if self.server is not None:
                self.server.flush()
