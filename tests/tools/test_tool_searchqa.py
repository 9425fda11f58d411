"""searchqa with its corpus behind a tool service: the worker's side holds no
document, the trainer scores from the signed results, and the corpus can be
a hundred times the built-in one."""

import copy
import socket

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade.envs import load_environment
from colonnade.envs.searchqa.corpus import build_corpus
from colonnade.protocol import EpisodeRecord, GroupRecord
from colonnade.protocol.draws import draw_key
from colonnade.tools.client import ToolClient
from colonnade.tools.served import EpisodeTools, client_for
from colonnade.tools.service import ToolService
from colonnade.tools.signed import Call, Reply, public_key
from colonnade.train.replies import ToolRejected
from colonnade.train.samples import rebuild_group

ARGS = {"n_clusters": 40, "seed": 2}


@pytest.fixture(scope="module")
def local():
    return load_environment("searchqa", **ARGS)


@pytest.fixture(scope="module")
def service(local):
    svc = ToolService(local.tool_result, Ed25519PrivateKey.generate()).start()
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def served(service):
    return load_environment("searchqa", **ARGS, service=service.url, service_key=service.public_hex)


def test_a_served_searchqa_holds_no_document_and_asks_the_service(local, served):
    assert served.corpus.docs == [] and served.index is None
    for split in ("train", "test"):
        assert served.tasks(split) == local.tasks(split)
    task = local.tasks("train")[3]
    turns = [f"<search>{task.question}</search>"]
    assert served.respond(task, turns) == local.respond(task, turns)  # a plain call
    assert served.tool_query(task, turns) == task.question
    assert served.tool_query(task, [*turns, "<answer>x</answer>"]) is None
    # The same score from the service's results as from searching here.
    done = [*turns, f"<answer>{task.answers[0]}</answer>"]
    results = [local.tool_result(task.question)]
    assert served.score(task, done, results=results) == local.score(task, done)
    assert local.score(task, done).metrics["search_success"] == 1.0


def test_a_served_searchqa2_asks_for_its_two_hops(service):
    with pytest.raises(ValueError, match="64 lowercase hex"):
        load_environment("searchqa2", service="http://127.0.0.1:1", service_key="nope")
    env = load_environment("searchqa2", **ARGS, service=service.url, service_key="ab" * 32)
    assert env.corpus.docs == [] and env.name == "searchqa2" and env.tasks("train")
    assert env.tasks("train") == build_corpus(40, seed=2, hops=2).train


def _episode(tok, env, task, turns, run, row_key):
    """What an honest worker sends for these model turns: the service's
    replies signed for its row."""
    tools = EpisodeTools(env, task, client_for(env), run, row_key)
    tokens, mask = [], []
    for i, turn in enumerate(turns):
        ids = tok.encode(turn, add_special_tokens=False)
        tokens, mask = tokens + ids, mask + [True] * len(ids)
        reply = tools.respond(turns[: i + 1])
        if reply is None:
            break
        ids = tok.encode(reply, add_special_tokens=False)
        tokens, mask = tokens + ids, mask + [False] * len(ids)
    logp = [-0.5 if m else 0.0 for m in mask]
    return EpisodeRecord(tokens, mask, logp, "done", [0.0] * len(tokens), tools.replies)


def test_the_trainer_scores_a_served_search_from_its_signed_result(tiny, served):
    _, tok = tiny
    task = served.tasks("train")[5]
    key = draw_key("r1", 1, "w1", 0, task.id, 0).hex()
    turns = [f"<search>{task.question}</search>", f"<answer>{task.answers[0]}</answer>"]
    good = _episode(tok, served, task, turns, "r1", key)
    guess = _episode(tok, served, task, ["<answer>aspirin</answer>"], "r1", key)
    assert len(good.tools) == 1 and good.tools[0].call.row == key and guess.tools == []
    train_ids = {t.id for t in served.tasks("train")}
    samples = rebuild_group(tok, served, GroupRecord(task.id, [good, guess]), 1, served.stop,
                            4096, train_ids)  # fmt: skip
    assert [s.score.reward for s in samples] == [1.0, 0.0]
    assert samples[0].score.metrics["search_success"] == 1.0
    # The worker puts the answer into the documents, tokens and all.
    forged = copy.deepcopy(good)
    reply = forged.tools[0]
    fake = [f"{task.answers[0]} is the answer.", *reply.result[1:]]
    forged.tools[0] = Reply(reply.call, fake, reply.signature)
    start = forged.from_model.index(False)
    end = start + forged.from_model[start:].index(True)
    ids = tok.encode(served.tool_reply(task, [""], fake), add_special_tokens=False)
    forged.tokens[start:end], forged.from_model[start:end] = ids, [False] * len(ids)
    forged.logprobs[start:end], forged.below[start:end] = [0.0] * len(ids), [0.0] * len(ids)
    with pytest.raises(ToolRejected, match="not signed") as e:
        rebuild_group(tok, served, GroupRecord(task.id, [forged]), 1, served.stop, 4096, train_ids)
    assert e.value.reason == "tool_reply"


def test_an_unbound_call_gets_the_same_documents_the_index_gives(local, service):
    client = ToolClient(service.url, public_key(service.public_hex))
    query = local.tasks("test")[0].question
    assert client.call(Call("", "", "", 0, query)).result == list(local._search(query))


@pytest.mark.slow
def test_the_corpus_can_be_a_hundred_times_the_built_in_one():
    built_in = build_corpus()
    large = build_corpus(100 * 600)
    assert len(large.docs) >= 100 * len(built_in.docs)
    assert len(set(large.docs)) > 0.99 * len(large.docs)
    tasks = large.train + large.test
    assert len({t.id for t in tasks}) == len(tasks) and len(tasks) == 100 * 4 * 600
    answers = [t.answers[0].lower() for t in tasks if t.id.endswith("-protein")]
    assert len(set(answers)) == len(answers)  # every protein its own
    bare = build_corpus(100 * 600, docs=False)
    assert bare.docs == [] and bare.train == large.train and bare.test == large.test


@pytest.mark.slow
@pytest.mark.procs
def test_a_service_of_the_large_corpus_answers_workers_that_hold_none(tmp_path):
    from colonnade.protocol.signing import new_keypair
    from toolproc import ServiceProcess

    key, _ = new_keypair("tools", tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = {"n_clusters": 60_000, "seed": 1}
    with ServiceProcess("searchqa", [f"{k}={v}" for k, v in args.items()], key, port,
                        timeout=600) as svc:  # fmt: skip
        env = load_environment("searchqa", **args, service=svc.url, service_key=svc.key)
        assert env.corpus.docs == [] and env.index is None
        task = env.tasks("train")[123]
        info = env.respond(task, [f"<search>{task.question}</search>"])
        assert info.count("Doc ") == 3 and task.answers[0] in info
