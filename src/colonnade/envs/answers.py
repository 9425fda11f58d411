"""Answer normalization and tag parsing shared by the built-in tasks."""

from __future__ import annotations

import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace (SQuAD rule)."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCT))
    return " ".join(text.split())


def exact_match(prediction: str, answers: tuple[str, ...] | list[str]) -> bool:
    pred = normalize(prediction)
    return bool(pred) and any(pred == normalize(a) for a in answers)


def last_tag(text: str, tag: str) -> str | None:
    """Content of the last complete <tag>…</tag> in text, stripped; None if absent."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    return found[-1].strip() if found else None
