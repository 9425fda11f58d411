"""Episodes of several requests: a chat client's turns stitched into one token stream.

A worker runs an environment that talks to a model over the OpenAI API
(`envs/verifiers.py`) against an endpoint in its own process. Each model
turn is one request; the episode the trainer needs is one stream of tokens
after the first prompt: the model's tokens (with μ and the mass below each)
and, between turns, whatever the next request's prompt adds (the tool's or
user's reply rendered by the chat template, masked as the environment's).

The worker opens an episode with its draw key (`protocol.draws.draw_key`)
and hands the env a handle, which every request of the episode carries in
the extension field `colonnade_episode`. The endpoint asks here what each
turn runs on and where its draws start, and records each answer. Only an
endpoint built with an `Episodes` reads the field; `colonnade serve`
refuses it.

A client sends text, not tokens: the next request's messages hold the
model's reply as text, which the chat template renders and the tokenizer
encodes again, not always into the tokens that were sampled (a byte-level
BPE merges differently). So a turn does not run on the prompt it renders
to, but on the stream so far followed by what that prompt adds after the
text of the stream (`bridge`): the model sees exactly the tokens the
trainer will teacher-force, and every token keeps its position across
turns, so the draw check and spot checks read the episode as one row (a
reply cut before its stop string goes on from the cut: the stop string's
tokens stay the model's, as sampled). A prompt that does not go on from
the text the client was shown (a template that drops an earlier turn's
text, an environment that edits its history) cannot make one stream: the
episode is marked `broken`, saying why, and the worker refuses to send it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from colonnade.engine import Episode

# Tokens either side of where the shown text's own encoding ends that the
# bridge tries: the template's re-encoding of a reply differs from the
# sampled tokens by a few merges, not by whole words.
BRIDGE_SLACK = 16


@dataclass
class Stitched:
    """One episode across its requests, as a rollout batch records it."""

    key: bytes  # its draws' key
    budget: int  # tokens after the first prompt, model's and environment's
    prompt: list[int] = field(default_factory=list)  # the first request's
    tokens: list[int] = field(default_factory=list)
    from_model: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    below: list[float] = field(default_factory=list)
    finish: str = ""  # the last turn's: "eos", "done" (a stop string), "length"
    turns: int = 0
    broken: str | None = None  # why the turns are not one stream
    # The episode after its first prompt as the client has it: each reply's
    # text as it was answered (the EOS that ended it rendered back), each
    # addition as its tokens decode. The next prompt must go on from this.
    shown: str = ""

    @property
    def stream(self) -> list[int]:
        return self.prompt + self.tokens

    def left(self, prompt: Sequence[int]) -> int:
        """Tokens a turn on `prompt` (as `Episodes.turn` gives it) may still add."""
        return self.budget - (len(prompt) - len(self.prompt)) if self.turns else self.budget


def bridge(tokenizer, stream: Sequence[int], first: int, shown: str,
           prompt: Sequence[int]) -> list[int] | None:  # fmt: skip
    """`stream` followed by what `prompt` adds after the text `shown`, or
    None where `prompt` does not go on from it. `first`: the first prompt's
    length, which both share token for token (the messages before the
    model's first reply render alike); `shown`: the episode after it as
    the client has it (`Stitched.shown`)."""
    if list(prompt[:first]) != list(stream[:first]):
        return None
    if list(prompt[: len(stream)]) == list(stream):
        return list(prompt)  # the text encodes to the tokens sampled
    # Where the shown text ends in `prompt`: near where its encoding would.
    guess = first + len(tokenizer.encode(shown, add_special_tokens=False))
    near = range(max(first, guess - BRIDGE_SLACK), min(len(prompt), guess + BRIDGE_SLACK) + 1)
    for k in sorted(near, key=lambda k: abs(k - guess)):
        if tokenizer.decode(prompt[first:k], skip_special_tokens=False) == shown:
            return [*stream, *prompt[k:]]
    return None


class Episodes:
    """The open episodes of one in-process endpoint, by handle."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._open: dict[str, Stitched] = {}
        self._lock = threading.Lock()

    def open(self, key: bytes, budget: int) -> str:
        handle = os.urandom(12).hex()
        with self._lock:
            self._open[handle] = Stitched(key, budget)
        return handle

    def get(self, handle: str) -> Stitched | None:
        with self._lock:
            return self._open.get(handle)

    def turn(self, handle: str, prompt: Sequence[int]) -> tuple[list[int], int]:
        """(what a turn asked on `prompt` runs on, where its draws start);
        marks the episode broken when `prompt` does not go on from the stream
        (the turn then runs on `prompt` as it is, and nothing is sent)."""
        ep = self._open[handle]
        if not ep.turns:
            return list(prompt), 0
        if ep.broken is None:
            bridged = bridge(self.tokenizer, ep.stream, len(ep.prompt), ep.shown, prompt)
            if bridged is not None:
                return bridged, len(bridged) - len(ep.prompt)
            ep.broken = f"turn {ep.turns + 1}'s prompt does not go on from the text before it"
        return list(prompt), max(0, len(prompt) - len(ep.prompt))

    def record(self, handle: str, prompt: Sequence[int], turn: Episode, text: str) -> None:
        """Add a finished turn: what its prompt added (the environment's), then
        its tokens; `text`: the reply as the client got it."""
        ep = self._open[handle]
        if not ep.turns:
            ep.prompt = list(prompt)
        elif ep.broken is None:
            added = list(prompt[len(ep.stream) :])
            ep.tokens += added
            ep.from_model += [False] * len(added)
            ep.logprobs += [0.0] * len(added)
            ep.below += [0.0] * len(added)
            ep.shown += self.tokenizer.decode(added, skip_special_tokens=False)
        ep.shown += text
        if turn.finish == "eos":  # dropped from the text, rendered back by the template
            ep.shown += self.tokenizer.decode(turn.tokens[-1:], skip_special_tokens=False)
        ep.tokens += turn.tokens
        ep.from_model += [True] * len(turn.tokens)
        ep.logprobs += turn.logprobs
        ep.below += turn.below
        ep.finish = turn.finish
        ep.turns += 1

    def close(self, handle: str) -> Stitched:
        with self._lock:
            return self._open.pop(handle)
