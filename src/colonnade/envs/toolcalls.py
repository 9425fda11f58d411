"""Tool calls in the model's own chat format: read from a turn, answered as tool messages.

An environment that declares `tools` (JSON-schema function declarations,
what a chat template's `tools=` takes) is a *chat-format* environment: its
prompt is rendered with the model's chat template and those tools, the
model calls a tool the way it was trained to, and each reply is a tool
message rendered by the same template. Pure functions of the tokenizer's
template and the text, so that a worker and the trainer's replay
(`protocol/turns.py`) write the same tokens between two model turns.

Families, told apart by the template's own markup (`family_of`):

- `hermes`: Qwen 2.5 / 3, SmolLM3, Hermes: `<tool_call>{"name": ..,
  "arguments": {..}}</tool_call>` in the assistant turn (SmolLM2 writes a
  list inside the tags); replies in `<tool_response>` (the template's).
- `llama`: Llama 3.x: the turn is the JSON itself, `{"name": ..,
  "parameters": {..}}` (after `<|python_tag|>`, several joined by `;`);
  replies in an `ipython` turn (the template's).

A template that ignores `tools=` (SmolLM2's plain ChatML) is given the
declarations in a system block in the hermes form (`tools_block`), which is
the format such models were tuned on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("hermes", "llama")
# Strings that end a turn holding a call (`Environment.stop`): hermes closes
# its tag; Llama's built-in tool turn ends with <|eom_id|>, which is not EOS.
CALL_STOPS = ("</tool_call>", "<|eom_id|>")
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
# A marker no template writes, to find the assistant content in a rendering.
_MARK = "\x00colonnade-turn\x00"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    error: str = ""  # why the call could not be read ("": it could)


def family_of(tokenizer) -> str:
    """The tool-call format of the tokenizer's chat template (hermes unless Llama's)."""
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if "<|python_tag|>" in template or "ipython" in template or "<|eom_id|>" in template:
        return "llama"
    return "hermes"


def parse_calls(text: str, family: str) -> list[ToolCall]:
    """The calls in one model turn, in order; [] when it calls nothing.

    A call that is there but cannot be read (bad JSON, no name) is a
    `ToolCall` with its `error` set, so the model is told what was wrong.
    """
    if family == "hermes":
        return [c for body in _HERMES.findall(text) for c in _read(body)]
    if family == "llama":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return []
        return [c for part in _split_llama(body) for c in _read(part)]
    raise ValueError(f"unknown tool-call family {family!r}; one of {', '.join(FAMILIES)}")


def _split_llama(body: str) -> list[str]:
    """JSON objects joined by `;` (Llama 3.2's parallel calls) or whitespace."""
    out, decoder, i = [], json.JSONDecoder(), 0
    while i < len(body):
        try:
            _, end = decoder.raw_decode(body, i)
        except ValueError:
            return [*out, body[i:]]  # unreadable: reported by _read
        out.append(body[i:end])
        i = end
        while i < len(body) and body[i] in "; \n\t":
            i += 1
    return out


def _read(body: str) -> list[ToolCall]:
    try:
        value = json.loads(body.strip())
    except ValueError as e:
        return [ToolCall("", {}, f"the call is not JSON ({e.msg})")]
    items = value if isinstance(value, list) else [value]
    return [_one(v) for v in items] or [ToolCall("", {}, "an empty list of calls")]


def _one(value: Any) -> ToolCall:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall("", {}, 'a call is an object with a "name"')
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return ToolCall(value["name"], {}, "its arguments are not JSON")
    if not isinstance(args, dict):
        return ToolCall(value["name"], {}, "its arguments are not an object")
    return ToolCall(value["name"], args)


def tool_messages(calls: Sequence[ToolCall], results: Sequence[str]) -> list[dict[str, str]]:
    """One `tool` message a call, in order, as chat templates take them."""
    return [
        {"role": "tool", "name": c.name, "content": r} for c, r in zip(calls, results, strict=True)
    ]


def render(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool | None = None,
    generation: bool = True,
) -> str:
    """The template's text of `messages`, with `tools` and the thinking switch.

    `thinking` is passed as `enable_thinking` (Qwen3-style templates read
    it; others ignore it); None leaves the template's default. Tools that
    the template does not show are put in a system block (`tools_block`).
    """
    extra = {} if thinking is None else {"enable_thinking": thinking}
    messages = list(messages)
    if tools and not _shows_tools(tokenizer):
        messages = _with_block(messages, tools)
        tools = None

    return tokenizer.apply_chat_template(
        messages, tools=list(tools) if tools else None, tokenize=False,
        add_generation_prompt=generation, **extra,
    )  # fmt: skip


def _shows_tools(tokenizer) -> bool:
    """Whether the template writes the declarations it is given."""
    probe = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "colonnade_probe", "parameters": {}}}
    shown = tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False)
    return "colonnade_probe" in shown


def tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The declarations as a hermes-style system block, for a template without tools."""
    lines = "\n".join(json.dumps(t, sort_keys=True) for t in tools)
    return (
        "You may call these tools. Tools:\n<tools>\n" + lines + "\n</tools>\n"
        'To call one, write <tool_call>{"name": NAME, "arguments": {...}}</tool_call>; '
        "its result comes back in the next message."
    )


def _with_block(messages: list, tools) -> list:
    block = tools_block(tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{block}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def between_turns(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    replies: Sequence[Mapping[str, str]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool | None = None,
) -> str:
    """The text after a model turn: the template's end of that turn, the
    tool messages `replies`, and the opening of the next assistant turn.

    The model's own tokens are kept as sampled, never re-rendered: the
    template renders a marker in their place, and what follows the marker
    is the environment's part. `messages` are the episode's prompt.
    """
    turn = {"role": "assistant", "content": _MARK}
    text = render(tokenizer, [*messages, turn, *replies], tools, thinking)
    _, found, after = text.rpartition(_MARK)
    if not found:
        raise ValueError("the chat template does not write an assistant turn's content")
    return after
