"""docs/environments.md's example environments run as the page says they do."""

import re
import sys
import types
from pathlib import Path

from colonnade.envs import Environment, load_environment

DOC = Path(__file__).resolve().parents[2] / "docs" / "environments.md"


def _example(name: str, monkeypatch) -> str:
    """The doc's Python block that defines `load_environment`, importable as `name`."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    source = next(b for b in blocks if "def load_environment" in b and f'name = "{name}"' in b)
    module = types.ModuleType(f"doc_{name}")
    exec(compile(source, str(DOC), "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.__name__


def test_single_turn_example(monkeypatch):
    env = load_environment(_example("reverse", monkeypatch), n=50, seed=1)
    assert isinstance(env, Environment)
    train = {t.question for t in env.tasks("train")}
    assert not train & {t.question for t in env.tasks("test")}
    task = env.tasks("test")[0]
    assert env.score(task, [f"<answer>{task.answers[0]}</answer>"]).reward == 1.0
    assert env.score(task, ["no idea"]).reward == 0.0


def test_multi_turn_example_answers_its_tool_and_scores(monkeypatch):
    env = load_environment(_example("multiply", monkeypatch), n=50)
    task = env.tasks("test")[0]
    a, b = re.findall(r"\d+", task.question)
    first = f"<calc>{a} * {b}</calc>"
    assert env.respond(task, [first]) == f"\n<result>{int(a) * int(b)}</result>\n"
    assert env.respond(task, ["<calc>__import__('os')</calc>"]) == "\n<result>error</result>\n"
    turns = [first, f"<answer>{task.answers[0]}</answer>"]
    assert env.respond(task, turns) is None
    s = env.score(task, turns)
    assert s.reward == 1.0 and s.metrics == {"correct": 1.0, "used_calc": 1.0, "turns": 2.0}


def test_page_names_every_command_that_takes_env_arg():
    text = DOC.read_text()
    for command in ("eval", "warmstart", "trainer", "run", "config show"):
        assert f"`{command}`" in text
