"""A served environment for tests: every turn but the last asks the service.

The service's tool (`tool_result`) measures the query; the reward is a pure
function of the service's results, so a result the trainer did not verify
would change what trains.
"""

from colonnade.envs import Score, Task
from colonnade.tools.signed import public_key

SYSTEM = "Say anything."


class Measure:
    name = "measure"
    stop = ("</q>",)
    success_threshold = 1.0

    def __init__(self, service: str, service_key: str, max_turns: int, n_tasks: int):
        if service:
            public_key(service_key)  # a bad pin fails where the environment is built
        self.service, self.service_key, self.max_turns = service, service_key, max_turns
        self._tasks = [Task(f"t{i}", f"say something about {i}", (str(i),)) for i in range(n_tasks)]

    def tasks(self, split):
        return self._tasks if split == "train" else self._tasks[:2]

    def task(self, task_id):
        return next(t for t in self._tasks if t.id == task_id)

    def prompt(self, task):
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.question}]

    def tool_query(self, task, turns):
        return turns[-1][-40:] if len(turns) < self.max_turns else None

    def tool_result(self, query):
        return {"length": len(query), "vowels": sum(c in "aeiou" for c in query)}

    def tool_reply(self, task, turns, result):
        return f"\n[{result['length']} characters, {result['vowels']} vowels]\n"

    def respond(self, task, turns):
        query = self.tool_query(task, turns)
        if query is None:
            return None
        return self.tool_reply(task, turns, self.tool_result(query))

    def score(self, task, turns, results=None):
        if results is None:  # answered here: the results are the tool's own
            results = [self.tool_result(t[-40:]) for t in turns[: self.max_turns - 1]]
        vowels = sum(r["vowels"] for r in results)
        return Score(float(vowels % 2), {"replies": float(len(results)), "vowels": float(vowels)})

    def tokenizer_texts(self):
        return [SYSTEM, *(t.question for t in self._tasks), "[6 characters, 3 vowels]"] * 20


def load_environment(service: str = "", service_key: str = "", max_turns: int = 3,
                     n_tasks: int = 8) -> Measure:  # fmt: skip
    return Measure(service, service_key, max_turns, n_tasks)
