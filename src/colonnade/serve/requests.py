"""Requests to the endpoint: untrusted JSON checked into the episodes to run.

`chat_job` and `completion_job` read an OpenAI request body (what vLLM
accepts of it) and say what the engine is to run: the prompt tokens, how
many episodes of each (`n`), each one's limits (`max_tokens`, `stop`,
`ignore_eos`) and draw keys (`seed`), and what the response reports
(`logprobs`, `return_token_ids`). Anything else is refused with a
`RequestError` that names the field, never ignored: a request that asks
for something the server does not do gets a 400, not an answer to another
question.

The distribution is the server's, not the request's (`Served.sampling`):
every token's log-prob the endpoint returns is of that one distribution,
the one a trainer would recompute. A request may repeat the server's
temperature, top-p or top-k; any other value is refused. Fields that only
change the distribution (penalties, biases, min-p) are accepted at their
neutral values only.

An endpoint inside a worker (`Served.episodes`) also reads the extension
field `colonnade_episode`: the handle of an episode the worker opened, whose
draw key and token positions the request's tokens take (`episodes.py`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from colonnade.engine.loop import seeded_keys
from colonnade.protocol.turns import SamplingParams, chat_prompt
from colonnade.untrusted import is_int, is_number

from .episodes import Episodes

ROLES = ("system", "developer", "user", "assistant", "tool")
EPISODE_FIELD = "colonnade_episode"
SPENT = "the episode's token budget is spent"


class RequestError(ValueError):
    """A request the server refuses: HTTP `status`, OpenAI's error `kind`, the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code


@dataclass(frozen=True)
class Bounds:
    """What one request may ask of the server (each a flag of `colonnade serve`)."""

    max_tokens: int = 1024  # a request's max_tokens, at most
    max_prompt_tokens: int = 4096
    context: int | None = None  # the model's positions: prompt + max_tokens fit in them
    max_n: int = 16
    max_episodes: int = 64  # prompts x n of one request
    max_stops: int = 8
    max_stop_chars: int = 64  # the engine decodes this many tokens' tail every step
    max_messages: int = 256
    max_body_bytes: int = 4 << 20


@dataclass(frozen=True)
class Served:
    """The model the server runs and how it samples."""

    name: str  # what /v1/models lists and a request's `model` must name
    sampling: SamplingParams  # its temperature, top-p and top-k: every request's
    bounds: Bounds = field(default_factory=Bounds)
    episodes: Episodes | None = None  # a worker's endpoint: requests may name an episode


@dataclass(frozen=True)
class Job:
    """A request's episodes, as the engine runs them and the response reports them."""

    chat: bool
    prompts: list[list[int]]  # completions may send several; chat sends one
    n: int  # episodes of each prompt
    limits: SamplingParams  # the server's distribution, this request's limits
    stop: tuple[str, ...]
    seed: int | None
    logprobs: bool
    token_ids: bool  # vLLM's return_token_ids: prompt_token_ids and token_ids
    tokens_as_ids: bool  # vLLM's return_tokens_as_token_ids: "token_id:N" in logprobs
    episode: str | None = None  # the worker's episode this turn belongs to (its handle)
    key: bytes | None = None  # that episode's draw key
    origin: int = 0  # where this turn's draws start in the episode

    @property
    def episodes(self) -> int:
        return len(self.prompts) * self.n

    def keys(self) -> list[bytes]:
        """Draw keys, prompt by prompt then choice by choice: with a seed those of
        `Engine.generate(prompts repeated n times, seed=seed)`, else fresh;
        a turn of an episode, the episode's."""
        if self.key is not None:
            return [self.key]
        if self.seed is None:
            return [os.urandom(32) for _ in range(self.episodes)]
        return seeded_keys(self.seed, self.episodes)


# Fields accepted at one value only: they change the distribution, or ask
# for what the server does not do; absent or null is the same value.
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "stream": lambda v: v is False,
    "presence_penalty": lambda v: v == 0,
    "frequency_penalty": lambda v: v == 0,
    "repetition_penalty": lambda v: v == 1,
    "min_p": lambda v: v == 0,
    "min_tokens": lambda v: v == 0,
    "logit_bias": lambda v: v == {},
    "skip_special_tokens": lambda v: v is True,
    "include_stop_str_in_output": lambda v: v is False,
    "echo": lambda v: v is False,
    "best_of": lambda v: v == 1,
    "suffix": lambda v: False,
    "stream_options": lambda v: False,
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "response_format": lambda v: v == {"type": "text"},
}
# Fields read below, or accepted and not used (who is asking).
_COMMON = {"model", "max_tokens", "n", "stop", "seed", "temperature", "top_p", "top_k",
           "ignore_eos", "return_token_ids", "return_tokens_as_token_ids", "user",
           "request_id", "logprobs", EPISODE_FIELD}  # fmt: skip
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"} | set(_NEUTRAL)
COMPLETION_FIELDS = _COMMON | {"prompt"} | set(_NEUTRAL)


def chat_job(body: Any, tokenizer, served: Served) -> Job:
    """A /v1/chat/completions body checked: its messages rendered with the
    tokenizer's chat template, the assistant turn opened."""
    body = _fields(body, CHAT_FIELDS, served)
    prompt = _render(_messages(body.get("messages"), served.bounds), tokenizer)
    top = body.get("top_logprobs")
    if top is not None and not is_int(top, 0, 0):
        raise RequestError("top_logprobs: alternatives are not returned; use 0", "top_logprobs")
    logprobs = _flag(body, "logprobs")
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise RequestError("give max_tokens or max_completion_tokens, not both", "max_tokens")
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    return _job(body, True, [prompt], logprobs, name, None, served)


def completion_job(body: Any, tokenizer, served: Served) -> Job:
    """A /v1/completions body checked: a prompt (text or token ids), or several."""
    body = _fields(body, COMPLETION_FIELDS, served)
    prompts = _prompts(body.get("prompt"), tokenizer, served.bounds)
    logprobs = body.get("logprobs")
    if logprobs is not None and not is_int(logprobs, 0, 0):
        raise RequestError(
            "logprobs: alternatives are not returned; 0 gives each sampled token's", "logprobs"
        )
    # OpenAI's and vLLM's default for completions is 16 tokens.
    default = min(16, served.bounds.max_tokens)
    return _job(body, False, prompts, logprobs is not None, "max_tokens", default, served)


def _fields(body: Any, allowed: set[str], served: Served) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in allowed or (k == EPISODE_FIELD and
                                                             served.episodes is None))  # fmt: skip
    if unknown:
        raise RequestError(f"unsupported field {unknown[0]!r}", unknown[0])
    body = {k: v for k, v in body.items() if v is not None}  # null: as if absent
    for name, neutral in _NEUTRAL.items():
        if name in body and not neutral(body[name]):
            raise RequestError(f"{name}: not supported by this server", name)
    model = body.get("model")
    if model is not None and model != served.name:
        raise RequestError(f"the model {model!r} does not exist; this server runs "
                           f"{served.name!r}", "model", 404, code="model_not_found")  # fmt: skip
    for name in ("user", "request_id"):
        if name in body and not isinstance(body[name], str):
            raise RequestError(f"{name} must be a string", name)
    _same_distribution(body, served.sampling)
    return body


def _same_distribution(body: dict, sampling: SamplingParams) -> None:
    """A request may name the server's temperature, top-p or top-k, no other."""
    for name, ours in (("temperature", sampling.temperature), ("top_p", sampling.top_p)):
        value = body.get(name)
        if value is None:
            continue
        if not is_number(value) or not math.isclose(value, ours, rel_tol=0, abs_tol=1e-9):
            raise RequestError(
                f"{name} is the server's ({ours:g}): every returned log-prob is of that one "
                f"distribution; leave {name} out or send {ours:g}",
                name,
            )
    top_k = body.get("top_k")
    # vLLM spells "off" -1; the engine 0.
    if top_k is not None and not (is_int(top_k, -1) and max(top_k, 0) == sampling.top_k):
        raise RequestError(f"top_k is the server's ({sampling.top_k}); leave it out", "top_k")


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false", name)
    return value


def _job(body: dict, chat: bool, prompts: list[list[int]], logprobs: bool, tokens_field: str,
         default_tokens: int | None, served: Served) -> Job:  # fmt: skip
    """`default_tokens`: max_tokens where the request names none (None: as
    many as the bounds and the model's positions leave)."""
    bounds = served.bounds
    n = body.get("n", 1)
    if not is_int(n, 1, bounds.max_n):
        raise RequestError(f"n must be an integer from 1 to {bounds.max_n}", "n")
    if len(prompts) * n > bounds.max_episodes:
        raise RequestError(f"at most {bounds.max_episodes} completions a request (prompts x n)")
    longest = max(len(p) for p in prompts)
    if longest > bounds.max_prompt_tokens:
        raise RequestError(
            f"the prompt is {longest} tokens, more than the {bounds.max_prompt_tokens} allowed",
            "messages" if chat else "prompt",
        )
    if default_tokens is None:
        room = bounds.context - longest if bounds.context is not None else bounds.max_tokens
        default_tokens = max(1, min(bounds.max_tokens, room))
    max_tokens = body.get(tokens_field, default_tokens)
    if not is_int(max_tokens, 1, bounds.max_tokens):
        raise RequestError(
            f"{tokens_field} must be an integer from 1 to {bounds.max_tokens}", tokens_field
        )
    if bounds.context is not None and longest + max_tokens > bounds.context:
        raise RequestError(
            f"the prompt ({longest} tokens) and {tokens_field} ({max_tokens}) exceed the "
            f"model's {bounds.context} positions",
            tokens_field,
        )
    seed = body.get("seed")
    if seed is not None and not is_int(seed, -(2**63), 2**63 - 1):
        raise RequestError("seed must be a 64-bit integer", "seed")
    stop = _stops(body.get("stop"), bounds)
    ignore_eos = _flag(body, "ignore_eos")
    # A turn one token longer than the episode: the episode's limit is what
    # ends a long completion ("length"), so that "done" means a stop string.
    limits = replace(served.sampling, max_turn_tokens=max_tokens + 1,
                     max_episode_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos)  # fmt: skip
    job = Job(chat, prompts, n, limits, stop, seed, logprobs, _flag(body, "return_token_ids"),
              _flag(body, "return_tokens_as_token_ids"))  # fmt: skip
    handle = body.get(EPISODE_FIELD)
    return job if handle is None else _episode_turn(job, handle, served.episodes)


def _episode_turn(job: Job, handle: Any, episodes: Episodes) -> Job:
    """`job` as a turn of the worker's episode `handle`: on the episode's
    stream so far (`Episodes.turn`), with its draws and positions, within
    what is left of its token budget."""
    ep = episodes.get(handle) if isinstance(handle, str) else None
    if ep is None:
        raise RequestError(f"{EPISODE_FIELD}: no open episode of that name", EPISODE_FIELD)
    if job.episodes != 1 or job.seed is not None:
        raise RequestError("a turn of an episode is one completion, without a seed",
                           EPISODE_FIELD)  # fmt: skip
    prompt, origin = episodes.turn(handle, job.prompts[0])
    left = ep.left(prompt)
    if left < 1:
        raise RequestError(SPENT, EPISODE_FIELD)
    tokens = min(job.limits.max_episode_tokens, left)
    limits = replace(job.limits, max_episode_tokens=tokens, max_turn_tokens=tokens + 1)
    return replace(job, prompts=[prompt], limits=limits, episode=handle, key=ep.key,
                   origin=origin)  # fmt: skip


def _stops(value: Any, bounds: Bounds) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value if value is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a string or a list of non-empty strings", "stop")
    if len(stops) > bounds.max_stops or any(len(s) > bounds.max_stop_chars for s in stops):
        raise RequestError(f"at most {bounds.max_stops} stop strings of at most "
                           f"{bounds.max_stop_chars} characters", "stop")  # fmt: skip
    return tuple(dict.fromkeys(stops))


def _messages(value: Any, bounds: Bounds) -> list[dict[str, str]]:
    if not isinstance(value, list) or not 1 <= len(value) <= bounds.max_messages:
        raise RequestError(f"messages must be a list of 1 to {bounds.max_messages}", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not set(m) <= {"role", "content", "name"}:
            raise RequestError(f"{where} must be an object of role, content and name", where)
        if m.get("role") not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
        msg = {"role": m["role"], "content": _content(m.get("content"), f"{where}.content")}
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise RequestError(f"{where}.name must be a string", f"{where}.name")
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _content(value: Any, where: str) -> str:
    """A message's text: a string, or a list of text parts joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in value
    ):
        return "".join(p["text"] for p in value)
    raise RequestError(f"{where} must be a string or a list of text parts", where)


def _render(messages: list[dict[str, str]], tokenizer) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template: use /v1/completions", "messages")
    try:
        prompt = chat_prompt(tokenizer, messages)
    except Exception as e:  # the template's own checks (roles in order, ...) or a bad render
        raise RequestError(f"the chat template refused the messages: {e}", "messages") from None
    if not prompt:
        raise RequestError("the messages render to an empty prompt", "messages")
    return prompt


def _prompts(value: Any, tokenizer, bounds: Bounds) -> list[list[int]]:
    """A prompt as text, as token ids, or a list of either."""
    if isinstance(value, str) or (isinstance(value, list) and value and is_int(value[0])):
        value = [value]
    if not isinstance(value, list) or not value:
        raise RequestError("prompt must be a string, token ids, or a non-empty list of them",
                           "prompt")  # fmt: skip
    if len(value) > bounds.max_episodes:  # before any is tokenized
        raise RequestError(f"at most {bounds.max_episodes} prompts a request", "prompt")
    vocab = len(tokenizer)
    out = []
    for p in value:
        if isinstance(p, str):
            ids = tokenizer.encode(p)
        elif isinstance(p, list) and all(is_int(t, 0, vocab - 1) for t in p):
            ids = list(p)
        else:
            raise RequestError(
                f"prompt: each must be a string or a list of token ids below {vocab}", "prompt"
            )
        if not ids:
            raise RequestError("prompt: an empty prompt has nothing to continue", "prompt")
        out.append(ids)
    return out
