"""Responses in OpenAI's shapes, with what vLLM adds for RL (token ids, log-probs).

A choice's text is its tokens decoded without special tokens and cut before
the first stop string (OpenAI's rule: the stop string is not returned).
Its token ids and log-probs are every token the engine sampled, the last
one included (the EOS, or the token that completed a stop string), as vLLM
returns them: each log-prob is the behaviour log-prob the engine recorded,
of the server's distribution (after its temperature, top-k and top-p).

- chat: `choices[].message.content`; with `logprobs: true`,
  `choices[].logprobs.content[]` of {token, logprob, bytes, top_logprobs: []};
  with `return_token_ids: true`, `prompt_token_ids` beside `choices` and
  `choices[].token_ids`;
- completions: `choices[].text`; with `logprobs: 0`, `choices[].logprobs`
  of {tokens, token_logprobs, top_logprobs (each the sampled token's),
  text_offset}; with `return_token_ids: true`, `choices[].prompt_token_ids`
  and `choices[].token_ids`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from colonnade.engine import Episode

from .requests import Job, Served

# The engine's ends as OpenAI names them: a stop string ends the turn ("done",
# the endpoint's responder ends every episode after one turn), EOS ends it.
FINISH = {"done": "stop", "eos": "stop", "length": "length", "overflow": "length"}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class Pieces:
    """Each token's text and bytes, for log-prob entries (cached: the same
    tokens come back in every response)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._bytes = _byte_decoder()
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        got = self._cache.get(token)
        if got is None:
            got = self._cache[token] = self._piece(token)
        return got

    def _piece(self, token: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token])
        # A byte-level token (GPT-2, Llama 3, Qwen, SmolLM) holds its bytes
        # exactly, where its decoded text shows a lone half of a character
        # as U+FFFD; other tokenizers' text is taken as it decodes.
        name = self.tokenizer.convert_ids_to_tokens(token)
        if isinstance(name, str) and name and all(c in self._bytes for c in name):
            raw = bytes(self._bytes[c] for c in name)
            if raw.decode("utf-8", errors="replace") == text:
                return text, list(raw)
        return text, list(text.encode("utf-8"))

    def text(self, episode: Episode, stop: Sequence[str]) -> str:
        """The choice's text: special tokens left out, cut before the first stop string."""
        text = self.tokenizer.decode(episode.tokens, skip_special_tokens=True)
        found = [i for s in stop if (i := text.find(s)) >= 0]
        return text[: min(found)] if found else text


def _envelope(kind: str, served: Served, job: Job, episodes: list[Episode]) -> dict:
    completion = sum(len(ep.tokens) for ep in episodes)
    prompt = sum(len(p) for p in job.prompts)
    return {
        "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": served.name,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def _token(pieces: Pieces, job: Job, token: int) -> str:
    return f"token_id:{token}" if job.tokens_as_ids else pieces(token)[0]


def chat_response(job: Job, episodes: list[Episode], served: Served, pieces: Pieces) -> dict:
    """/v1/chat/completions' answer: one choice per episode (the request's `n`)."""
    out = _envelope("chat.completion", served, job, episodes)
    choices = []
    for i, ep in enumerate(episodes):
        choice = {
            "index": i,
            "message": {"role": "assistant", "content": pieces.text(ep, job.stop)},
            "logprobs": None,
            "finish_reason": FINISH[ep.finish],
        }
        if job.logprobs:
            content = [
                {
                    "token": _token(pieces, job, t),
                    "logprob": lp,
                    "bytes": pieces(t)[1],
                    "top_logprobs": [],
                }
                for t, lp in zip(ep.tokens, ep.logprobs, strict=True)
            ]
            choice["logprobs"] = {"content": content, "refusal": None}
        if job.token_ids:
            choice["token_ids"] = list(ep.tokens)
        choices.append(choice)
    out["choices"] = choices
    if job.token_ids:
        out["prompt_token_ids"] = list(job.prompts[0])
    return out


def completion_response(job: Job, episodes: list[Episode], served: Served, pieces: Pieces) -> dict:
    """/v1/completions' answer: prompt by prompt, `n` choices each."""
    out = _envelope("text_completion", served, job, episodes)
    choices = []
    for i, ep in enumerate(episodes):
        choice = {
            "index": i,
            "text": pieces.text(ep, job.stop),
            "logprobs": _completion_logprobs(pieces, job, ep) if job.logprobs else None,
            "finish_reason": FINISH[ep.finish],
        }
        if job.token_ids:
            choice["prompt_token_ids"] = list(job.prompts[i // job.n])
            choice["token_ids"] = list(ep.tokens)
        choices.append(choice)
    out["choices"] = choices
    return out


def _completion_logprobs(pieces: Pieces, job: Job, ep: Episode) -> dict:
    tokens = [_token(pieces, job, t) for t in ep.tokens]
    offsets, at = [], 0
    for t in ep.tokens:
        offsets.append(at)
        at += len(pieces(t)[0])
    return {
        "tokens": tokens,
        "token_logprobs": list(ep.logprobs),
        "top_logprobs": [{t: lp} for t, lp in zip(tokens, ep.logprobs, strict=True)],
        "text_offset": offsets,
    }


def models_response(served: Served, created: int) -> dict:
    """/v1/models: the one model this server runs."""
    return {
        "object": "list",
        "data": [
            {"id": served.name, "object": "model", "created": created, "owned_by": "colonnade"}
        ],
    }


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:  # fmt: skip
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
