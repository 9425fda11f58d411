import random
import sys
import textwrap

import pytest

from colonnade.envs import Environment, exact_match, load_environment, normalize
from colonnade.envs.searchqa.corpus import build_corpus


@pytest.fixture(scope="module")
def sqa():
    return load_environment("searchqa", n_clusters=120)


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("The Hugaline!", "hugaline"),
        ("  an  HU-29 ", "hu29"),
        ("Galpelus   jorsyis.", "galpelus jorsyis"),
        ("a", ""),
    ],
)
def test_normalization_table(raw, norm):
    assert normalize(raw) == norm


def test_exact_match_accepts_synonyms_and_rejects_empty():
    assert exact_match("the velorin", ("velorin", "VE-7"))
    assert exact_match("ve 7", ("velorin", "VE-7")) is False
    assert exact_match("VE-7", ("velorin", "VE-7"))
    assert not exact_match("", ("velorin",))


def test_corpus_is_deterministic_and_split_by_entity():
    a, b = build_corpus(80, seed=3), build_corpus(80, seed=3)
    assert a.docs == b.docs and a.train == b.train and a.test == b.test
    assert build_corpus(80, seed=4).docs != a.docs
    train_answers = {normalize(x) for t in a.train for x in t.answers}
    train_genes = {t.info["gene"] for t in a.train}
    for t in a.test:
        assert not {normalize(x) for x in t.answers} & train_answers
        assert t.info["gene"] not in train_genes


def test_every_test_answer_is_retrievable_with_the_question(sqa):
    for task in sqa.tasks("test"):
        info = normalize(sqa.information(task.question))
        assert normalize(task.answers[0]) in info, task


def test_search_then_answer_scores_one(sqa):
    task = sqa.tasks("test")[0]
    first = f"I will search. <search>{task.question}</search>"
    reply = sqa.respond(task, [first])
    assert reply.startswith("\n<information>") and reply.endswith("</information>\n")
    turns = [first, f"<answer>{task.answers[0].upper()}</answer>"]
    assert sqa.respond(task, turns) is None
    s = sqa.score(task, turns)
    assert s.reward == 1.0
    assert s.metrics == {
        "correct": 1.0,
        "searched": 1.0,
        "search_success": 1.0,
        "turns": 2.0,
        "format_ok": 1.0,
    }


def test_guess_without_search_is_wrong_but_well_formed(sqa):
    task = sqa.tasks("test")[1]
    s = sqa.score(task, ["<answer>aspirin</answer>"])
    assert s.reward == 0.0 and s.metrics["format_ok"] == 1.0 and s.metrics["searched"] == 0.0


def test_demonstrations_good_ones_score_one_poor_ones_echo_the_question(sqa):
    rng = random.Random(0)
    for task in sqa.tasks("train")[:40]:
        good = sqa.demonstration(task, True, rng)
        assert good[0] == f"<search>{task.question}</search>"
        assert sqa.score(task, good).reward == 1.0
        poor = sqa.demonstration(task, False, rng)
        assert len(poor) == 1 and task.info["subject"] in task.question
        assert poor == [f"<answer> {task.info['subject']}</answer>"]
        s = sqa.score(task, poor)
        assert s.reward == 0.0 and s.metrics["format_ok"] == 1.0


@pytest.mark.parametrize(
    "turns",
    [
        ["no tags at all"],
        ["<search></search>"],
        ["<answer>unclosed"],
        ["<search>a</search>", "<search>b</search>", "<search>c</search>"],
        [""],
        ["<search>\x00\u2603 ..</search>"],
    ],
)
def test_malformed_output_ends_with_reward_zero(sqa, turns):
    task = sqa.tasks("train")[0]
    assert sqa.respond(task, turns) is None or len(turns) < sqa.max_turns
    s = sqa.score(task, turns)
    assert s.reward == 0.0


def test_turn_limit_ends_the_episode(sqa):
    task = sqa.tasks("train")[0]
    q = f"<search>{task.question}</search>"
    assert sqa.respond(task, [q, q]) is not None
    assert sqa.respond(task, [q, q, q]) is None


def test_smoke_env():
    env = load_environment("smoke")
    task = env.tasks("train")[0]
    assert env.score(task, [f"<answer>{task.answers[0]}</answer>"]).reward == 1.0
    assert env.score(task, ["<answer>nope</answer>"]).reward == 0.0
    assert env.respond(task, ["anything"]) is None


def test_plugin_env_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_env.py").write_text(
        textwrap.dedent(
            """
            from colonnade.envs.smoke import Smoke

            def load_environment(**kw):
                env = Smoke(kw.get("n_tasks", 10), 0)
                env.name = "mine"
                return env
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_environment("my_env", n_tasks=20)
    assert isinstance(env, Environment) and env.name == "mine"
    assert len(env.tasks("train")) + len(env.tasks("test")) == 20
    sys.modules.pop("my_env", None)


def test_unknown_env_and_bad_split_say_why(sqa):
    with pytest.raises(ValueError, match="unknown environment"):
        load_environment("no_such_env_xyz")
    with pytest.raises(ValueError, match="unknown split"):
        sqa.tasks("dev")


def test_practice_corpus_has_the_shape_and_none_of_the_names(sqa):
    from colonnade.envs import Practising

    assert isinstance(sqa, Practising)
    practice = sqa.practice(seed=5)
    assert len(practice.tasks("train")) == len(sqa.tasks("train"))
    assert len(practice.corpus.docs) == len(sqa.corpus.docs)
    assert not practice.corpus.names & sqa.corpus.names
    # No answer, gene or document of the real task turns up in practice.
    real_answers = {normalize(a) for t in (*sqa.tasks("train"), *sqa.tasks("test"))
                    for a in t.answers}  # fmt: skip
    for t in (*practice.tasks("train"), *practice.tasks("test")):
        assert not {normalize(a) for a in t.answers} & real_answers
    text = normalize(" ".join(practice.corpus.docs))
    words = set(text.split())
    assert not {t.info["gene"].lower() for t in sqa.tasks("test")} & words
    # Deterministic under its seed, and a practice corpus is an ordinary env.
    assert sqa.practice(seed=5).corpus.docs == practice.corpus.docs
    task = practice.tasks("test")[0]
    assert normalize(task.answers[0]) in normalize(practice.information(task.question))
