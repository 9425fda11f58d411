"""The episode loop every backend shares: turns, stops, refill, tool replies, records.

Each step feeds every live episode one chunk: its last sampled token, or
that token followed by the environment's reply when a turn has just ended
(the prompt is the first chunk). An episode extends its own KV prefix and is
never recomputed, and the episodes of a batch end independently (finished
rows leave the cache, waiting rows take their places). The forward pass and
its cache are the backend's (`backend.py`); the cuts on a running batch are
the session's (`session.py`).

A reply that is not ready (a tool service's, which the responder returns
as a `Future`) parks its row: the row leaves the running batch with a copy
of its cache, the other rows keep decoding, and it rejoins the batch (as a
new row would) once the reply has come. A row's draws follow from its key
and its position in the episode, never from the rows beside it, so an
episode is the same whether its replies came at once or late.

Where episodes come from is a `Source`, asked before every step for the
episodes that start now (`Engine.run`): a fixed list (`Engine.generate`,
the worker's and the evaluations' path) or requests arriving while others
run (the OpenAI-compatible server, `colonnade.serve`). One loop serves both,
so a request runs exactly as the same row would in a batch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_any
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import blake3
import numpy as np
import torch

from colonnade.protocol.draws import uniforms
from colonnade.protocol.turns import StopMatcher

from .backend import Backend
from .sampling import SamplingParams
from .session import Session

# turn text (up to its stop string) -> environment text to append, or None
# to end; or a Future of either, for a reply that takes a while (a service's):
# the row waits out of the batch while the others decode.
Responder = Callable[[str], "str | Future[str | None] | None"]

# How long an idle loop waits for a parked row's reply before looking again
# (the responder's own timeouts bound the wait; this only paces the looks).
PARKED_WAIT_S = 1.0
# A row whose reply is on its way waits in place for up to this many of the
# batch's steps (at most GRACE_MAX_S) before it is parked: parking and
# rejoining each copy the batch's cache, about what a step reads, so a reply
# due within a few steps is cheaper waited for; replies that come together
# are then fed together, in one step, as when the batch waits for each.
GRACE_STEPS = 4
GRACE_MAX_S = 1.0


@dataclass
class Episode:
    """Everything the trainer needs of one episode, token by token."""

    prompt_ids: list[int]
    version: int
    tokens: list[int] = field(default_factory=list)  # after the prompt
    from_model: list[bool] = field(default_factory=list)  # env tokens never enter the loss
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob; 0.0 on env tokens
    below: list[float] = field(default_factory=list)  # mass below each token (its draw's interval)
    turns: list[str] = field(default_factory=list)  # each model turn's text
    finish: str = ""  # "done" (env ended it), "eos", "length", "overflow" (a reply too long)

    def add(
        self,
        ids: Sequence[int],
        model: bool,
        logprobs: Sequence[float] | None = None,
        below: Sequence[float] | None = None,
    ):
        self.tokens.extend(ids)
        self.from_model.extend([model] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.below.extend(below if below is not None else [0.0] * len(ids))


@dataclass
class Admission:
    """One episode a `Source` hands to `Engine.run`."""

    prompt: Sequence[int]
    respond: Responder
    key: bytes  # its draws' key (`protocol.draws`)
    # Its turn and episode budgets, stop strings and ignore_eos (None: the
    # run's). Its distribution (temperature, top-k, top-p) must be the run's:
    # one step samples every row from one distribution.
    limits: SamplingParams | None = None
    done: Callable[[Episode], None] | None = None  # the finished episode, on the engine's thread
    # Where its first token stands in its episode's draws: an episode of
    # several requests (a chat client's turns) goes on from its earlier
    # turns' tokens and replies instead of drawing from position 0 again.
    origin: int = 0


class Source(Protocol):
    """Where `Engine.run` takes its episodes from, asked before every step."""

    def admit(self, room: int | None, idle: bool) -> list[Admission]:
        """The episodes that start now, in order, at most `room` (None: no
        bound); those of one prompt side by side share one prefill. `idle`:
        no episode runs: wait for one; [] then ends the run."""
        ...

    def upcoming(self) -> Collection[tuple[int, ...]]:
        """Prompts still to be handed over: a prefill made for one is kept for them."""
        ...


@dataclass
class _Row:
    episode: Episode
    respond: Responder
    pending: list[int]
    key: bytes  # its draws' key (`protocol.draws`)
    limits: SamplingParams
    stops: StopMatcher
    done: Callable[[Episode], None] | None = None
    turn: list[int] = field(default_factory=list)
    origin: int = 0  # `Admission.origin`
    waiting: Future | None = None  # the reply its last turn awaits (parked)

    def draw(self) -> float:
        """The draw for the token this row samples next (at its episode position)."""
        return float(uniforms(self.key, [self.origin + len(self.episode.tokens)])[0])


# A step whose longest chunk (a tool reply) is at least this long, beside rows
# fed one token, feeds the long chunks to their own rows first: padded into
# the step, every other row would run that many pad tokens through the model.
SPLIT_MIN = 8


def _concat(parts: list[Session]) -> Session:
    """One session of these sessions' rows, in order: all at once into one
    buffer where the backend's cache can `stack`; else joined in pairs
    (each join copies both sides, so one after another would copy the first
    rows once per part). Each level of pairs is a new buffer of the rows so
    far, and what it frees the allocator keeps: admitting 64 groups that way
    held about twice the batch's cache beside it (docs/benchmarks.md)."""
    if len(parts) > 1 and hasattr(parts[0].cache, "stack"):
        parts[0].extend_all(parts[1:])
        return parts[0]
    while len(parts) > 1:
        joined = []
        for a, b in zip(parts[::2], parts[1::2], strict=False):
            a.extend(b)
            joined.append(a)
        parts = joined + parts[len(joined) * 2 :]
    return parts[0]


def _split_replies(session: Session, live: list[_Row]) -> None:
    """Feed the rows whose pending chunk is long (a tool reply) all but its
    last token on their own, so the step that follows is one token a row."""
    long = [i for i, r in enumerate(live) if len(r.pending) > 1]
    if not long or len(long) == len(live):
        return
    if max(len(live[i].pending) for i in long) < SPLIT_MIN:
        return
    session.feed(long, [live[i].pending[:-1] for i in long])
    for i in long:
        live[i].pending = live[i].pending[-1:]


class _Listed:
    """`generate`'s source: a fixed list of episodes in admission units."""

    def __init__(self, episodes: list[Admission], grouped: list[list[int]]):
        self.episodes = episodes
        self.waiting = deque(grouped)

    def admit(self, room: int | None, idle: bool) -> list[Admission]:
        """Waiting units taken in order while there is room (a unit may start
        in part: what is left of it stays first in line)."""
        out: list[Admission] = []
        while self.waiting and (room is None or len(out) < room):
            unit = self.waiting[0]
            take = len(unit) if room is None else room - len(out)
            out.extend(self.episodes[i] for i in unit[:take])
            if take >= len(unit):
                self.waiting.popleft()
            else:
                self.waiting[0] = unit[take:]
        return out

    def upcoming(self) -> set[tuple[int, ...]]:
        return {tuple(self.episodes[u[0]].prompt) for u in self.waiting}


def distribution(params: SamplingParams) -> tuple[float, int, float]:
    """What of `params` the sampled distribution depends on (the rest are limits)."""
    return (params.temperature, params.top_k, params.top_p)


def seeded_keys(seed: int, rows: int) -> list[bytes]:
    """Draw keys for rows nobody checks (evaluations, benchmarks), from a seed."""
    return [blake3.blake3(f"colonnade seed {seed} row {i}".encode()).digest() for i in range(rows)]


def units(prompts: Sequence[Sequence[int]], max_rows: int) -> list[list[int]]:
    """Row indices in admission units: runs of one prompt (a group), at most `max_rows` each."""
    out: list[list[int]] = []
    for i, p in enumerate(prompts):
        unit = out[-1] if out else None
        if unit and prompts[unit[0]] == p and (not max_rows or len(unit) < max_rows):
            unit.append(i)
        else:
            out.append([i])
    return out


class Engine:
    """Runs a backend over batches of multi-turn episodes.

    `version` is the published version the backend holds (recorded in every
    episode); `name` is the backend's, which a rollout batch records.
    """

    def __init__(self, backend: Backend, tokenizer, version: int = 0):
        self.backend = backend
        self.tokenizer = tokenizer
        self.version = version
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_ids = {tokenizer.eos_token_id} - {None}

    @property
    def name(self) -> str:
        return self.backend.name

    def _session(self, batch: int) -> Session:
        return Session(self.backend, batch, self.pad_id)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        responders: Sequence[Responder],
        params: SamplingParams,
        seed: int = 0,
        max_rows: int = 0,
        share_prefix: bool = True,
        split_replies: bool = True,
        keys: Sequence[bytes] | None = None,
    ) -> list[Episode]:
        """One episode per prompt; `responders[i]` answers episode i's turns.

        Row i's tokens are drawn by `keys[i]` (`protocol.draws.draw_key`: a
        worker's rows, which the trainer can check); without `keys`, by keys
        that follow from `seed`.

        With `share_prefix`, the rows of one prompt (a group) are prefilled
        once and the cache copied to each. With `split_replies`, a tool reply
        is fed to its own row before the step (where the session can), not
        padded into a step that runs every other row as wide. With
        `max_rows`, at most that many episodes run at once and, as episodes
        end, waiting rows take the free places in the running batch, in
        order, a group's rows admitted together sharing one prefill
        (continuous batching), instead of the batch shrinking to its slowest
        row. Both need prompts of 2 tokens or more (the last token is fed
        with the running batch); otherwise all rows run at once.
        """
        if len(prompts) != len(responders):
            raise ValueError("one responder per prompt")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        if max_rows < 0:
            raise ValueError("max_rows must be >= 0")
        if keys is None:
            keys = seeded_keys(seed, len(prompts))
        if len(keys) != len(prompts):
            raise ValueError("one draw key per prompt")
        episodes: list = [None] * len(prompts)
        listed = [
            Admission(p, r, k, done=partial(episodes.__setitem__, i))
            for i, (p, r, k) in enumerate(zip(prompts, responders, keys, strict=True))
        ]
        share = share_prefix and all(len(p) >= 2 for p in prompts)
        grouped = units(prompts, max_rows) if share else [list(range(len(prompts)))]
        self.run(_Listed(listed, grouped), params, max_rows, share, split_replies)
        return episodes

    @torch.inference_mode()
    def run(
        self,
        source: Source,
        params: SamplingParams,
        max_rows: int = 0,
        share_prefix: bool = True,
        split_replies: bool = True,
    ) -> None:
        """Episodes from `source` until it has none left, each handed to its
        admission's `done` as it ends; sampled from `params`' distribution,
        within each admission's limits (`params`' where it names none).

        Before every step the source is asked for the episodes that start
        now, as many as there are free places (`max_rows`; 0: no bound; a
        row parked while it awaits a reply frees its place, and at most
        `max_rows` rows are parked and running beyond it):
        they take the places of ended rows in the running batch (continuous
        batching). With `share_prefix`, the episodes admitted together are
        prefilled once per distinct prompt, and a prompt's prefill is kept
        while the source says more of it is to come; `split_replies` as in
        `generate`.
        """
        if max_rows < 0:
            raise ValueError("max_rows must be >= 0")
        matchers: dict[tuple[str, ...], StopMatcher] = {}
        # The session's rows; None where an episode ended and no row has
        # taken its place yet (dropped before the next step).
        live: list[_Row | None] = []
        session: Session | None = None
        prefixes: dict[tuple[int, ...], Session] = {}  # prompts still to come
        parked: list[tuple[_Row, Session]] = []  # rows awaiting a reply, their caches
        grace = 0.0  # how long a reply is waited for in place (GRACE_STEPS)
        while True:
            # Rows whose reply came go on (or end, on that reply) first.
            back = self._returned(parked)
            busy = sum(r is not None for r in live)
            # A parked row's place goes to another row; its cache, kept aside,
            # bounds them: at most `max_rows` more rows than run (parked).
            out = len(parked) + len(back)
            room = min(max_rows - busy - len(back), 2 * max_rows - busy - out) if max_rows else None
            idle = busy == 0 and not parked and not back
            handed = source.admit(room, idle) if room is None or room > 0 else []
            if busy == 0 and not handed and not back:
                if not parked:
                    return
                pending = [r.waiting for r, _ in parked]
                if wait_any(pending, PARKED_WAIT_S, FIRST_COMPLETED).done:
                    wait_any(pending, grace)  # the replies close behind rejoin with it
                continue
            admit = [self._row(a, params, matchers) for a in handed]
            if admit:
                share = share_prefix and all(len(r.pending) >= 2 for r in admit)
                if share:
                    wanted = source.upcoming()  # a prompt's prefill is kept for these
                    part = self._prefilled(admit, prefixes, wanted)
                    prefixes = {p: s for p, s in prefixes.items() if p in wanted}
                else:
                    part = self._session(len(admit))
                session, live = self._joined(session, live, part, admit)
            if back:
                part = _concat([cache for _, cache in back])
                session, live = self._joined(session, live, part, [r for r, _ in back])
            assert session is not None
            if None in live:
                self._drop_ended(session, live)
            if split_replies:
                _split_replies(session, live)
            draws = np.array([r.draw() for r in live])
            started = time.perf_counter()
            got = session.sample([r.pending for r in live], params, draws)
            grace = min(GRACE_MAX_S, GRACE_STEPS * (time.perf_counter() - started))
            waiting = []
            for i, row in enumerate(live):
                taken = (int(got.tokens[i]), float(got.logprobs[i]), float(got.below[i]))
                if not self._advance(row, *taken):
                    live[i] = None
                    if row.done is not None:
                        row.done(row.episode)
                elif row.waiting is not None:
                    waiting.append(i)
            for i in self._awaited(live, waiting, grace):
                # Its cache leaves with it; its place frees up.
                parked.append((live[i], session.take([i])))
                live[i] = None
            if all(r is None for r in live):
                live, session = [], None

    def _joined(
        self, session: Session | None, live: list[_Row | None], part: Session, rows: list[_Row]
    ) -> tuple[Session, list[_Row | None]]:
        """`rows` (in `part`, prefilled) into the running batch: in ended
        rows' places where they fit, else appended."""
        if session is None:
            return part, list(rows)
        free = [i for i, r in enumerate(live) if r is None]
        if len(rows) <= len(free) and session.place(free[: len(rows)], part):
            # Ended rows' places taken in place: no copy of the cache.
            for slot, row in zip(free, rows, strict=False):
                live[slot] = row
            return session, live
        self._drop_ended(session, live)
        session.extend(part)
        live.extend(rows)
        return session, live

    def _awaited(self, live: list[_Row | None], waiting: list[int], grace: float) -> list[int]:
        """Of the rows `waiting` on a reply, those it has not come to within
        `grace` seconds (to be parked); the others take their reply in place,
        or end on it."""
        if grace > 0:
            wait_any([live[i].waiting for i in waiting], grace)
        still = []
        for i in waiting:
            row = live[i]
            if not row.waiting.done():
                still.append(i)
                continue
            if not self._came(row):
                live[i] = None
        return still

    def _returned(self, parked: list[tuple[_Row, Session]]) -> list[tuple[_Row, Session]]:
        """The parked rows whose reply has come and that go on, taken out of
        `parked`; those the reply ends are handed to their `done`."""
        back, still = [], []
        for row, cache in parked:
            if not row.waiting.done():
                still.append((row, cache))
                continue
            if self._came(row):
                back.append((row, cache))
        parked[:] = still
        return back

    def _came(self, row: _Row) -> bool:
        """Its awaited reply (done) taken: False when it ended the episode,
        which is then handed to the row's `done`."""
        reply, row.waiting = row.waiting.result(), None
        if self._replied(row, row.pending[0], reply):
            return True
        if row.done is not None:
            row.done(row.episode)
        return False

    def _row(self, episode: Admission, params: SamplingParams, matchers: dict) -> _Row:
        limits = episode.limits or params
        if distribution(limits) != distribution(params):
            raise ValueError("an episode's sampling distribution must be the run's")
        if len(episode.prompt) == 0:
            raise ValueError("empty prompt")
        stops = matchers.get(limits.stop)
        if stops is None:
            stops = matchers[limits.stop] = StopMatcher(self.tokenizer, limits.stop)
        prompt = list(episode.prompt)
        ep = Episode(prompt, self.version)
        return _Row(ep, episode.respond, list(prompt), episode.key, limits, stops, episode.done,
                    origin=episode.origin)  # fmt: skip

    @staticmethod
    def _drop_ended(session: Session, live: list[_Row | None]) -> None:
        going = [i for i, r in enumerate(live) if r is not None]
        if len(going) < len(live):
            session.keep(going)
            live[:] = [live[i] for i in going]

    def _prefilled(
        self,
        unit: list[_Row],
        prefixes: dict[tuple[int, ...], Session],
        wanted: Collection[tuple[int, ...]],
    ) -> Session:
        """A session holding each row's prompt but its last token, one prefill per
        distinct prompt; each row's pending chunk becomes that last token.

        A group admitted in parts (rows free up one by one) is prefilled once:
        a prompt's prefilled row is kept in `prefixes` while `wanted` (the
        prompts still to come) names it, and later parts copy it. Where every prompt is prefilled
        now, the rows are copied from that prefill at once: no row of it is
        copied, joined and copied again (a cache as large as the batch's,
        twice over, at 64 groups of one row).
        """
        distinct: dict[tuple[int, ...], int] = {}
        index = [distinct.setdefault(tuple(r.pending), len(distinct)) for r in unit]
        for r in unit:
            r.pending = r.pending[-1:]
        missing = [p for p in distinct if p not in prefixes]
        made_rows: dict[tuple[int, ...], int] = {}
        if missing:
            made = self._session(len(missing))
            made.step([list(p[:-1]) for p in missing])
            for j, p in enumerate(missing):
                made_rows[p] = j
                if p in wanted:
                    prefixes[p] = made.take([j])
            if len(missing) == len(distinct):  # made's rows are the distinct prompts, in order
                return made.take(index)
        bank = [prefixes[p] if p in prefixes else made.take([made_rows[p]]) for p in distinct]
        if len(bank) == 1:
            return bank[0].take(index)
        return _concat([bank[0].take([0]), *bank[1:]]).take(index)

    def _advance(self, row: _Row, token: int, logprob: float, below: float) -> bool:
        """Record a sampled token; False when the episode is over."""
        ep, params, stops = row.episode, row.limits, row.stops
        ep.add([token], True, [logprob], [below])
        row.turn.append(token)
        if token in self.eos_ids and not params.ignore_eos:
            ep.turns.append(self.tokenizer.decode(row.turn, skip_special_tokens=True))
            ep.finish = "eos"
            return False
        turn_over = stops.hit(row.turn) or len(row.turn) >= params.max_turn_tokens
        if not turn_over:
            if len(ep.tokens) >= params.max_episode_tokens:
                ep.turns.append(self.tokenizer.decode(row.turn, skip_special_tokens=True))
                ep.finish = "length"
                return False
            row.pending = [token]
            return True
        text = stops.cut(self.tokenizer.decode(row.turn, skip_special_tokens=True))
        ep.turns.append(text)
        reply = row.respond(text)
        if isinstance(reply, Future):  # parked until it comes (`run`)
            row.waiting, row.pending = reply, [token]
            return True
        return self._replied(row, token, reply)

    def _replied(self, row: _Row, token: int, reply: str | None) -> bool:
        """The environment's reply to the turn that ended on `token`; False
        when it ends the episode."""
        ep = row.episode
        if reply is None:
            ep.finish = "done"
            return False
        env_ids = self.tokenizer.encode(reply, add_special_tokens=False)
        if len(ep.tokens) + len(env_ids) >= row.limits.max_episode_tokens:
            ep.finish = "overflow"  # the reply is not shown: the last turn had no answer
            return False
        ep.add(env_ids, False)
        row.pending, row.turn = [token, *env_ids], []
        return True
