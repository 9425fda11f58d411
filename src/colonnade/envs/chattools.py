"""`chattools`: a price lookup, called in the model's own chat format.

The smallest chat-format environment: it declares one tool by JSON schema
(`price`), the prompt is rendered with the model's chat template and that
declaration, the model calls the tool as it was trained to (`<tool_call>`
for Qwen and SmolLM, JSON for Llama: `toolcalls.py`), and each
reply is a tool message rendered by the template. A turn without a call
ends the episode and is the answer; the reward is 1 when it is the price.

Arguments: `n_tasks`, `seed`, `max_turns` (turns with a call, plus the
answer), `thinking` (the chat template's `enable_thinking`: False by
default, so a model that thinks by default answers within short limits;
it travels in run.json with the other arguments, so the trainer renders
the prompt and every reply as the worker did).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from .answers import normalize
from .base import Metric, Score, Task, check_split
from .toolcalls import CALL_STOPS, ToolCall, tools_block

ITEMS = ("apple", "pear", "plum", "melon", "lemon", "grape", "cherry", "mango", "kiwi", "fig",
         "peach", "lime", "onion", "carrot", "potato", "pepper", "bean", "leek")  # fmt: skip
PRICE_TOOL = {
    "type": "function",
    "function": {
        "name": "price",
        "description": "The price of an item, in coins.",
        "parameters": {
            "type": "object",
            "properties": {"item": {"type": "string", "description": "the item's name"}},
            "required": ["item"],
        },
    },
}
SYSTEM = "Look up prices with the price tool, then reply with the number alone."
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


class ChatTools:
    name = "chattools"
    stop = CALL_STOPS
    tools = (PRICE_TOOL,)
    success_metric = "correct"
    metrics = (Metric("called", "called the tool"),)

    def __init__(self, n_tasks: int, seed: int, max_turns: int, thinking: bool):
        if n_tasks < 2 or max_turns < 1:
            raise ValueError("n_tasks must be at least 2 and max_turns at least 1")
        rng = random.Random(seed)
        self.prices = {item: rng.randrange(2, 100) for item in ITEMS}
        self.max_turns = max_turns
        self.thinking = thinking
        tasks = []
        for i in range(n_tasks):
            item = rng.choice(ITEMS)
            question = f"How many coins does one {item} cost?"
            tasks.append(Task(f"p{i}", question, (str(self.prices[item]),), {"item": item}))
        cut = n_tasks * 4 // 5
        self._split = {"train": tasks[:cut], "test": tasks[cut:]}
        self._by_id = {t.id: t for t in tasks}

    def tasks(self, split: str) -> Sequence[Task]:
        return self._split[check_split(split)]

    def task(self, task_id: str) -> Task:
        return self._by_id[task_id]

    def prompt(self, task: Task) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.question}]

    def call(self, task: Task, call: ToolCall) -> str:
        """The result of one call (pure): the price, or what was wrong with the call."""
        if call.error:
            return f"error: {call.error}"
        if call.name != "price":
            return f"error: no tool named {call.name!r}; the tool is price"
        item = call.arguments.get("item")
        if not isinstance(item, str):
            return 'error: price takes {"item": NAME}'
        price = self.prices.get(normalize(item))
        return f"error: no item {item!r}" if price is None else f"{price}"

    def respond(self, task: Task, turns: Sequence[str]) -> str | None:
        """Unused: a chat-format environment's replies are its tool messages
        (`protocol.turns.chat_reply` answers each turn through `call`)."""
        return None

    def score(self, task: Task, turns: Sequence[str]) -> Score:
        answer = normalize(_THINK.sub("", turns[-1])) if turns else ""
        correct = answer in {normalize(a) for a in task.answers}
        metrics = {"correct": float(correct), "called": float(len(turns) > 1)}
        return Score(float(correct), metrics)

    def tokenizer_texts(self) -> list[str]:
        calls = [f'<tool_call>{{"name": "price", "arguments": {{"item": "{i}"}}}}</tool_call>'
                 for i in ITEMS]  # fmt: skip
        return [SYSTEM, tools_block(self.tools), *calls, *map(str, range(100)),
                *(t.question for t in self._by_id.values())]  # fmt: skip


def load_environment(
    n_tasks: int = 200, seed: int = 0, max_turns: int = 3, thinking: bool = False
) -> ChatTools:
    return ChatTools(n_tasks, seed, max_turns, thinking)
