"""pass@1 counts what the environment declares as success, and says which rule."""

import logging

import pytest

from colonnade.envs import Score, Task, load_environment, metrics_of, success_of
from colonnade.rollout.episodes import Result
from colonnade.rollout.evaluate import figures_line, summarize

TASK = Task("t", "q", ("a",))


def _results(*scores):
    return [Result(TASK, None, s) for s in scores]


class Bare:
    """An environment that declares no success rule (only what it must have)."""

    name = "bare-test-env"


class Threshold:
    name = "threshold-test-env"
    success_threshold = 0.5


def test_builtins_declare_their_correct_metric():
    for name in ("smoke", "searchqa"):
        env = load_environment(name, **({"n_clusters": 20} if name == "searchqa" else {}))
        rule = success_of(env)
        assert (rule.metric, rule.threshold, rule.declared) == ("correct", 1.0, True)


def test_declared_metric_decides_not_the_reward():
    rule = success_of(load_environment("smoke", n_tasks=10))
    out = summarize(
        _results(Score(0.0, {"correct": 1.0, "format_ok": 1.0}), Score(1.0, {"format_ok": 0.0})),
        rule,
    )
    # The second episode's reward is 1 but it lacks `correct`: not a success.
    assert out["pass_at_1"] == 0.5 and out["reward"] == 0.5
    assert out["correct"] == 1.0 and out["format_ok"] == 0.5 and out["n"] == 2
    assert out["success"] == "correct >= 1, declared"


def test_a_declared_threshold_applies_to_the_reward():
    rule = success_of(Threshold())
    out = summarize(_results(Score(0.6, {}), Score(0.4, {}), Score(0.5, {})), rule)
    assert out["pass_at_1"] == round(2 / 3, 4) and out["success"] == "reward >= 0.5, declared"


def test_no_declaration_means_reward_of_one_and_a_single_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="colonnade.envs"):
        rule = success_of(Bare())
        success_of(Bare())
    warnings = [r for r in caplog.records if "bare-test-env" in r.getMessage()]
    assert len(warnings) == 1 and "reward >= 1" in warnings[0].getMessage()
    out = summarize(_results(Score(1.0, {}), Score(0.99, {})), rule)
    assert out["pass_at_1"] == 0.5
    assert out["success"] == "reward >= 1, the default: the environment declares none"


def test_search_metric_keeps_its_report_name_and_the_line_names_the_rule():
    rule = success_of(load_environment("smoke", n_tasks=10))
    declared = metrics_of(load_environment("searchqa", n_clusters=20))
    out = summarize(_results(Score(1.0, {"correct": 1.0, "searched": 1.0})), rule, 1, declared)
    assert out["search_rate"] == 1.0 and "searched" not in out
    # The rename is searchqa's declaration, not eval's: undeclared, a name stays.
    plain = summarize(_results(Score(1.0, {"correct": 1.0, "searched": 1.0})), rule)
    assert plain["searched"] == 1.0 and "search_rate" not in plain
    line = figures_line({**out, "temperature": 1.0, "version": 3})
    assert line.startswith("pass@1 1.000 (correct >= 1, declared), reward 1.000")
    assert line.endswith("n=1") and "temperature" not in line
    assert figures_line({"n": 0}) == "pass@1 n/a, n=0"


def test_the_reports_eval_table_shows_the_environments_figures_and_rule():
    from colonnade.report.html import _eval_table

    before = {"pass_at_1": 0.1, "reward": 0.25, "format_ok": 1.0, "n": 4, "temperature": 1.0}
    table = _eval_table({"before": {**before, "success": "reward >= 1, declared"}, "after": None})
    heads = ["pass_at_1", "reward", "format_ok", "n"]
    assert "".join(f"<th>{h}</th>" for h in heads) in table and "temperature" not in table
    assert "pass@1 counts reward &gt;= 1, declared" in table


class _NoTokenizerTexts:
    """A minimal environment without the optional tokenizer_texts()."""

    name, stop, max_turns = "bare", ("</answer>",), 1

    def tasks(self, split):
        return [Task("t0", "2+2?", ("4",))]

    def task(self, task_id):
        return self.tasks("train")[0]

    def prompt(self, task):
        return [{"role": "user", "content": task.question}]

    def respond(self, task, turns):
        return None

    def score(self, task, turns):
        return Score(float("4" in turns[-1]), {})


def test_tokenizer_texts_is_optional_and_its_absence_says_what_to_do(tmp_path):
    from functools import partial

    from colonnade.envs import Environment, tokenizer_texts_of
    from colonnade.model import resolve_model

    env = _NoTokenizerTexts()
    assert isinstance(env, Environment)  # loads: a pretrained model needs no texts
    assert resolve_model("org/model", partial(tokenizer_texts_of, env), cache=tmp_path)
    with pytest.raises(ValueError, match=r"no tokenizer_texts.*smollm2-135m"):
        resolve_model("tiny", partial(tokenizer_texts_of, env), cache=tmp_path)
