"""`rg:<dataset>`: prompts, the dataset's own scoring, a split that shares no question."""

import os
import sys

import pytest

from colonnade.envs import Environment, load_environment, success_of

if os.environ.get("CI") is None:  # CI installs the test extra, which has it: never skip there
    pytest.importorskip("reasoning_gym")

SMALL = {"size": 120, "seed": 7}


@pytest.fixture(scope="module")
def arith():
    return load_environment("rg:basic_arithmetic", **SMALL)


def _questions(env, split):
    return [t.question for t in env.tasks(split)]


def test_is_an_environment_with_one_turn_and_declared_success(arith):
    assert isinstance(arith, Environment)
    assert arith.name == "rg:basic_arithmetic" and arith.max_turns == 1
    rule = success_of(arith)
    assert rule.declared and rule.metric is None and rule.threshold == 1.0


def test_prompt_states_the_answer_format_and_asks_the_question(arith):
    task = arith.tasks("test")[0]
    system, user = arith.prompt(task)
    assert system["role"] == "system" and "<answer></answer>" in system["content"]
    assert user == {"role": "user", "content": task.question}
    assert task.question.startswith("Calculate")


def test_reward_is_the_datasets_score_answer(arith):
    task = arith.tasks("test")[0]
    right = arith.score(task, [f"Sum it up. <answer>{task.answers[0]}</answer>"])
    assert right.reward == 1.0 and right.metrics == {"format_ok": 1.0, "turns": 1.0}
    assert success_of(arith)(right)
    wrong = arith.score(task, ["<answer>not a number</answer>"])
    assert wrong.reward == 0.0 and wrong.metrics["format_ok"] == 1.0
    untagged = arith.score(task, [task.answers[0]])
    assert untagged.reward == 0.0 and untagged.metrics["format_ok"] == 0.0
    # basic_arithmetic's score_answer gives partial credit to an answer that
    # holds the right one: a reward, but no success.
    partial = arith.score(task, [f"<answer>{task.answers[0]}0000</answer>"])
    assert 0.0 < partial.reward < 1.0 and not success_of(arith)(partial)
    assert arith.respond(task, ["<answer>1</answer>"]) is None
    assert arith.score(task, []).reward == 0.0


def test_split_shares_no_question_even_where_the_dataset_repeats_them():
    # One-digit sums of two terms repeat often among 300 draws.
    config = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "allow_parentheses": False}
    env = load_environment("rg:basic_arithmetic", size=300, seed=1, **config)
    train, test = _questions(env, "train"), _questions(env, "test")
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not set(train) & set(test)
    assert len(train) + len(test) < 300  # duplicates were dropped
    assert test and len(train) > 3 * len(test)
    assert all(t.question.count(" ") == 3 for t in env.tasks("train"))  # "Calculate a op b."


def test_same_arguments_same_tasks_and_scores(arith):
    again = load_environment("rg:basic_arithmetic", **SMALL)
    assert list(again.tasks("train")) == list(arith.tasks("train"))
    task = arith.tasks("train")[3]
    turns = [f"<answer>{task.answers[0]}</answer>"]
    assert again.score(again.task(task.id), turns) == arith.score(task, turns)
    other = load_environment("rg:basic_arithmetic", size=120, seed=8)
    assert _questions(other, "train") != _questions(arith, "train")


def test_shots_are_example_turns_outside_both_splits():
    env = load_environment("rg:basic_arithmetic", size=60, shots=2)
    task = env.tasks("test")[0]
    messages = env.prompt(task)
    assert [m["role"] for m in messages] == ["system", *["user", "assistant"] * 2, "user"]
    shots = {messages[1]["content"], messages[3]["content"]}
    assert messages[2]["content"].startswith("<answer>")
    assert not shots & {*_questions(env, "train"), *_questions(env, "test")}


def test_other_datasets_and_config_keys_pass_through():
    env = load_environment("rg:chain_sum", size=40, min_terms=2, max_terms=2)
    task = env.tasks("test")[0]
    assert env.score(task, [f"<answer>{task.answers[0]}</answer>"]).reward == 1.0
    assert env.tokenizer_texts() and any("<answer>" in t for t in env.tokenizer_texts())


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("rg:basic_arithmetc", {}, "did you mean basic_arithmetic"),
        ("rg:basic_arithmetic", {"nope": 1}, "no setting nope; its settings: .*min_terms"),
        ("rg:basic_arithmetic", {"min_terms": 3, "max_terms": 2}, "bad settings"),
        ("rg:basic_arithmetic", {"test_fraction": 1.5}, "test_fraction"),
        ("rg:basic_arithmetic", {"size": 2, "shots": 1}, "0 for train and 1 for test"),
        ("rg:", {}, "name the dataset"),
    ],
)
def test_bad_names_and_settings_fail_in_one_line(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        load_environment(name, **kwargs)


def test_without_reasoning_gym_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import now raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'colonnade\[tasks\]'"):
        load_environment("rg:basic_arithmetic")
