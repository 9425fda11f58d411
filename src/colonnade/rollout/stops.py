"""Stop strings that may be split across tokens (`</se` + `arch>`)."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Finds the first stop string in a turn's text as tokens arrive.

    Only the tail of the turn is decoded each step: a byte-level token
    decodes to at least one character, so the last `longest + 2` tokens
    cover any stop string that the newest token can have completed.
    """

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.window = max((len(s) for s in self.stops), default=0) + 2

    def hit(self, turn_tokens: Sequence[int]) -> bool:
        if not self.stops:
            return False
        tail = self.tokenizer.decode(turn_tokens[-self.window :], skip_special_tokens=False)
        return any(s in tail for s in self.stops)

    def cut(self, text: str) -> str:
        """`text` up to and including its first stop string (all of it if none)."""
        ends = [text.find(s) + len(s) for s in self.stops if s in text]
        return text[: min(ends)] if ends else text
