"""searchqa with `hops=2` (`searchqa2`): one search cannot reach the answer, two can.

The properties are checked on every task of a corpus, not on samples: a
two-hop task whose first search shows the answer is a one-hop task in
disguise, and RL would learn the shortcut.
"""

import os
import random
import re
import subprocess
import sys

import pytest

from colonnade.envs import load_environment, metrics_of, normalize
from colonnade.envs.searchqa.corpus import find_name


@pytest.fixture(scope="module")
def env():
    return load_environment("searchqa2", n_clusters=150)


def _all(env):
    return [*env.tasks("train"), *env.tasks("test")]


def _names(docs, names) -> bool:
    return any(find_name(d, n) for d in docs for n in names)


def _replay(env, task, turns) -> list[str | None]:
    """The environment's replies to each prefix of `turns`, as the trainer rebuilds them."""
    return [env.respond(task, turns[: i + 1]) for i in range(len(turns))]


def test_first_search_never_shows_the_answer_but_shows_the_bridge_and_a_decoy(env):
    """The naive query (the question itself) returns the bridge and a look-alike
    of the answer, never an accepted answer; a search about the bridge returns it."""
    for task in _all(env):
        first = env._search(task.question)
        assert not _names(first, task.answers), task
        assert _names(first, (task.info["bridge"],)), task
        assert _names(first, (task.info["decoy"],)), task
        second = env._search(env.second_query(task, task.info["bridge"]))
        assert _names(second, task.answers), task


def test_no_document_links_the_question_entity_to_the_answer(env):
    """Whatever one query finds, no single document holds both ends of the chain:
    the answer is only ever reached through a document that names the bridge."""
    by_word: dict[str, set[int]] = {}
    for i, doc in enumerate(env.corpus.docs):
        for word in re.findall(r"\w+", doc.lower()):
            by_word.setdefault(word, set()).add(i)

    def naming(name: str) -> set[int]:
        first = re.findall(r"\w+", name.lower())[0]
        return {i for i in by_word.get(first, ()) if find_name(env.corpus.docs[i], name)}

    for task in _all(env):
        answer_docs = set().union(*(naming(a) for a in task.answers))
        assert answer_docs, task
        assert not answer_docs & naming(task.info["subject"]), task
        assert answer_docs & naming(task.info["bridge"]), task


def test_decoys_are_never_right(env):
    answers = {normalize(a) for t in _all(env) for a in t.answers}
    for task in _all(env):
        assert normalize(task.info["decoy"]) not in answers
        naive = [f"<search>{task.question}</search>", f"<answer>{task.info['decoy']}</answer>"]
        assert env.score(task, naive).reward == 0.0


def test_good_demonstration_searches_twice_and_scores_one_through_respond(env):
    rng = random.Random(0)
    for task in _all(env):
        turns = env.demonstration(task, True, rng)
        assert len(turns) == 3 and turns[0] == f"<search>{task.question}</search>", turns
        replies = _replay(env, task, turns)
        assert replies[0] is not None and replies[1] is not None and replies[2] is None
        # The second query copies the bridge out of the first reply.
        bridge = turns[1].removeprefix(f"<search>{task.info['then']} ").removesuffix("?</search>")
        assert find_name(replies[0], bridge) == bridge
        assert any(find_name(replies[1], a) for a in task.answers)
        s = env.score(task, turns)
        assert s.reward == 1.0
        assert s.metrics == {
            "correct": 1.0,
            "searched": 1.0,
            "search_success": 1.0,
            "turns": 3.0,
            "format_ok": 1.0,
        }


def test_poor_demonstration_is_the_naive_episode(env):
    rng = random.Random(0)
    for task in env.tasks("train")[:200]:
        turns = env.demonstration(task, False, rng)
        assert turns == [
            f"<search>{task.question}</search>",
            f"<answer> {find_name(env.information(task.question), task.info['decoy'])}</answer>",
        ]
        assert _replay(env, task, turns)[-1] is None
        s = env.score(task, turns)
        assert s.reward == 0.0 and s.metrics["format_ok"] == 1.0


def test_split_shares_no_entity(env):
    def entities(tasks):
        return {
            normalize(x)
            for t in tasks
            for x in (
                *t.answers,
                t.info["subject"],
                t.info["bridge"],
                t.info["decoy"],
                t.info["gene"],
            )
        }

    assert not entities(env.tasks("train")) & entities(env.tasks("test"))
    clusters = [{t.info["cluster"] for t in env.tasks(s)} for s in ("train", "test")]
    assert not clusters[0] & clusters[1]
    assert len(env.tasks("test")) == 4 * 30 and len(env.tasks("train")) == 4 * 120


def test_searchqa2_is_searchqa_with_hops_2_and_keeps_its_contract(env):
    same = load_environment("searchqa", n_clusters=150, hops=2)
    assert same.corpus == env.corpus and env.name == "searchqa2"
    one = load_environment("searchqa", n_clusters=150)
    assert metrics_of(env) == metrics_of(one) and env.success_metric == one.success_metric
    assert env.stop == one.stop and env.max_turns == 3
    assert env.prompt(env.tasks("test")[0])[0]["content"].endswith("search more than once.")
    # Malformed output still scores 0 without raising.
    task = env.tasks("test")[0]
    for turns in ([], ["no tags"], ["<search></search>"], ["<search>x</search>"] * 4):
        assert env.score(task, turns).reward == 0.0


def test_bad_hops_or_too_few_turns_say_why():
    with pytest.raises(ValueError, match="hops must be one of"):
        load_environment("searchqa", n_clusters=20, hops=3)
    with pytest.raises(ValueError, match="needs max_turns >= 3"):
        load_environment("searchqa2", n_clusters=20, max_turns=2)


def test_practice_twin_is_two_hop_and_shares_no_name(env):
    practice = env.practice(seed=5)
    assert practice.hops == 2 and not practice.corpus.names & env.corpus.names
    words = set(normalize(" ".join(practice.corpus.docs)).split())
    assert not {normalize(t.info["decoy"]) for t in _all(env)} & words
    task = practice.tasks("train")[0]
    assert practice.score(task, practice.demonstration(task, True, random.Random(0))).reward == 1


DIGEST = """
import hashlib, json, random
from colonnade.envs import load_environment

def digest(env):
    h = hashlib.sha256()
    for split in ("train", "test"):
        for t in env.tasks(split):
            h.update(json.dumps([t.id, t.question, list(t.answers), dict(t.info)], sort_keys=True).encode())
            h.update(json.dumps(env.prompt(t)).encode())
    for d in env.corpus.docs:
        h.update(d.encode())
    rng = random.Random(0)
    for t in env.tasks("train")[:40]:
        turns = env.demonstration(t, rng.random() < 0.5, rng)
        h.update(json.dumps(turns).encode())
        for i in range(len(turns)):
            h.update(repr(env.respond(t, turns[: i + 1])).encode())
        s = env.score(t, turns)
        h.update(json.dumps([s.reward, dict(s.metrics)], sort_keys=True).encode())
    h.update(json.dumps(env.tokenizer_texts()[-50:]).encode())
    return h.hexdigest()[:16]
"""  # noqa: E501


def _digest(env) -> str:
    scope: dict = {}
    exec(DIGEST, scope)
    return scope["digest"](env)


# Computed on the commit before `hops` existed: one hop is what it was, byte for byte.
ONE_HOP = [
    ({"n_clusters": 40}, "2d804d1137f2fe83"),
    ({"n_clusters": 40, "seed": 3}, "b92aee7b593a7acb"),
    ({"n_clusters": 60, "top_k": 2, "seed": 7}, "ab80eda4c39f0a6f"),
    ({}, "19002ed4de28566a"),
]


@pytest.mark.parametrize(("kwargs", "want"), ONE_HOP)
def test_one_hop_is_unchanged(kwargs, want):
    assert _digest(load_environment("searchqa", **kwargs)) == want


def test_one_hop_practice_is_unchanged():
    assert _digest(load_environment("searchqa", n_clusters=40).practice(5)) == "cbea0bdbf9c58bf7"


def test_two_hop_replays_in_another_process():
    """Same arguments, another process with another string-hash salt: same tasks,
    documents, demos, replies and scores (the trainer replays what workers ran)."""
    here = _digest(load_environment("searchqa2", n_clusters=60, seed=2))
    code = DIGEST + ("print(digest(load_environment('searchqa2', n_clusters=60, seed=2)))")
    env_vars = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env_vars, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == here
    assert _digest(load_environment("searchqa2", n_clusters=60, seed=3)) != here


def test_two_search_episode_fits_the_searchqa_run_limits():
    """A good two-hop episode, tokenized as the `tiny` preset does it, fits the
    turn and episode limits of the searchqa trainer preset (tokens after the prompt)."""
    from colonnade.config import TRAINER_PRESETS
    from colonnade.model.tokenizer import train_bpe_tokenizer
    from colonnade.protocol.turns import chat_prompt
    from colonnade.train.sft import episode_example

    limits = TRAINER_PRESETS["searchqa"]
    env = load_environment("searchqa2", n_clusters=150)
    tok = train_bpe_tokenizer(env.tokenizer_texts(), 2048, 40)
    rng = random.Random(0)
    for task in env.tasks("test"):
        turns = env.demonstration(task, True, rng)
        ex = episode_example(tok, env, task, turns)
        after_prompt = len(ex.ids) - len(chat_prompt(tok, env.prompt(task)))
        assert after_prompt < limits["max_episode_tokens"], task
        longest = max(len(tok.encode(t, add_special_tokens=False)) for t in turns)
        assert longest < limits["max_turn_tokens"], task
