"""`searchqa`: multi-turn search in the Search-R1 format with BM25 retrieval.

The model writes `<search>query</search>`; the environment answers with the
top-k documents in `<information>…</information>`; the model ends with
`<answer>…</answer>`. Reward is the exact match of the last answer after
normalization against the answer and its synonyms. A turn with neither tag,
or a search beyond the turn limit, ends the episode (reward 0): malformed
output never raises.

`hops=2` (the built-in `searchqa2`) asks two-hop questions over the same
kind of corpus (corpus.py): the first search reveals a bridge entity and a
decoy, the second, about the bridge, the answer. Same format, reward and
metrics; three turns at least.

`service=URL` (with `service_key`, the hex key that signs its replies):
the corpus is behind a tool service (`colonnade tools serve --env searchqa`
with the same corpus arguments) and this environment holds none of it:
only the questions. A search is the service's: on a worker, signed for its
episode (tools/served.py), and checked by the trainer instead of replayed;
elsewhere (eval, warm-start demos) a plain call. The service answers a query
with its documents (`tool_result`); the reply text is made here from them
(`tool_reply`), so both sides format it alike.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from typing import Any, ClassVar

from colonnade.tools.client import ToolClient
from colonnade.tools.signed import Call, public_key

from ..answers import exact_match, last_tag, normalize
from ..base import Metric, Score, Task, check_split
from .corpus import HOPS, build_corpus, find_name
from .search import BM25Index

SYSTEM = (
    "Answer the biomedical question. To search the literature write "
    "<search>query</search>; results come back in <information>...</information>. "
    "Finish with <answer>short answer</answer>."
)
# A two-hop answer needs a second search: the prompt says one is allowed.
MULTIHOP_HINT = " You may search more than once."


class SearchQA:
    name = "searchqa"
    stop = ("</search>", "</answer>")
    success_metric = "correct"  # pass@1 counts episodes whose `correct` is 1
    # Shown beside reward and pass@1; `searched` keeps its eval name, search_rate.
    metrics = (
        Metric("searched", "search rate", report="search_rate"),
        Metric("search_success", "search success"),
    )
    # Warm-start defaults per model preset, over the model's (train/warmstart.py;
    # docs/benchmarks.md). From scratch, `tiny` never copies an unseen name out
    # of the demos alone: it drills copying first, and learns the skill long
    # before the mixture. With the tokenizer's merge floor a 150-step drill is
    # enough; the mixture runs at under a third of the skill's rate, which keeps
    # more of the copying.
    # Pretrained, SmolLM2 answers right nearly whenever it searches, so its
    # search rate is its pass rate. Good-only steps leave it searching; the
    # mixture needs most of the steps, at twice the rate, to bring that down
    # (each setting's held-out figures: docs/benchmarks.md).
    warmstart_defaults: ClassVar[dict[str, dict[str, float]]] = {
        "tiny": {"drill_steps": 150, "steps": 1000, "skill_fraction": 0.8, "mix_lr": 3e-4},
        "smollm2-135m": {"good_fraction": 0.25, "skill_fraction": 0.3, "mix_lr": 6e-5},
    }

    def __init__(
        self,
        n_clusters: int,
        test_fraction: float,
        top_k: int,
        max_turns: int,
        seed: int,
        exclude: frozenset[str] = frozenset(),
        hops: int = 1,
        service: str = "",
        service_key: str = "",
    ):
        if top_k < 1 or max_turns < 1:
            raise ValueError("top_k and max_turns must be at least 1")
        if hops not in HOPS:
            raise ValueError(f"hops must be one of {HOPS}, not {hops!r}")
        if hops > 1 and max_turns < hops + 1:
            raise ValueError(
                f"hops={hops} needs max_turns >= {hops + 1} (a search a hop, an answer)"
            )
        self.hops = hops
        if hops > 1:
            self.name = f"searchqa{hops}"
        self.system = SYSTEM if hops == 1 else SYSTEM + MULTIHOP_HINT
        self._corpus_shape = (n_clusters, test_fraction)
        self.service, self.service_key = service, service_key
        local = not service
        self.corpus = build_corpus(n_clusters, test_fraction, seed, exclude, hops, docs=local)
        self.index = BM25Index(self.corpus.docs) if local else None
        # Plain calls, where no episode of a run asks (a worker's are signed
        # for their episode: rollout/episodes.py).
        self._client = None if local else ToolClient(service, public_key(service_key))
        self.top_k, self.max_turns = top_k, max_turns
        self._by_id = {t.id: t for t in (*self.corpus.train, *self.corpus.test)}
        self._search = functools.lru_cache(maxsize=65536)(self._search_uncached)

    def practice(self, seed: int) -> SearchQA:
        """A corpus of the same shape that shares no name with this one.

        A warm start on its demos teaches the skill; RL on this corpus's train
        split then meets only names the warm start never showed, so a reward
        can only come from searching and copying, never from recall, and what
        RL learns carries over to the test split.
        """
        return SearchQA(
            *self._corpus_shape,
            self.top_k,
            self.max_turns,
            seed,
            exclude=self.corpus.names,
            hops=self.hops,
        )

    def tasks(self, split: str) -> Sequence[Task]:
        return self.corpus.train if check_split(split) == "train" else self.corpus.test

    def task(self, task_id: str) -> Task:
        return self._by_id[task_id]

    def prompt(self, task: Task) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": self.system},
            {"role": "user", "content": task.question},
        ]

    def _search_uncached(self, query: str) -> tuple[str, ...]:
        if self.index is None:
            return self._docs(self._client.call(Call("", "", "", 0, query)).result)
        return tuple(self.index.search(query, self.top_k))

    def _docs(self, result: Any) -> tuple[str, ...]:
        """The documents of a service's result: its first `top_k` strings."""
        docs = [d for d in result if isinstance(d, str)] if isinstance(result, list) else []
        return tuple(docs[: self.top_k])

    @staticmethod
    def _information(docs: Sequence[str]) -> str:
        body = "\n".join(f"Doc {i + 1}: {d}" for i, d in enumerate(docs)) or "No results."
        return f"\n<information>\n{body}\n</information>\n"

    def information(self, query: str) -> str:
        return self._information(self._search(query))

    def tool_query(self, task: Task, turns: Sequence[str]) -> str | None:
        """The search the newest turn asks for, or None: the episode ends."""
        turn = turns[-1]
        if last_tag(turn, "answer") is not None:
            return None
        query = last_tag(turn, "search")
        if not query or len(turns) >= self.max_turns:
            return None
        return query

    def tool_result(self, query: str) -> list[str]:
        """The top-k documents for `query`: what a tool service of this corpus answers."""
        return list(self._search(query))

    def tool_reply(self, task: Task, turns: Sequence[str], result: Any) -> str:
        return self._information(self._docs(result))

    def respond(self, task: Task, turns: Sequence[str]) -> str | None:
        query = self.tool_query(task, turns)
        return None if query is None else self.information(query)

    def score(self, task: Task, turns: Sequence[str], results: Sequence | None = None) -> Score:
        """`results`: the service's results of the episode's searches, in order
        (a served environment's, checked by the trainer); None: search here."""
        queries = [last_tag(t, "search") for t in turns[:-1]]
        answer = last_tag(turns[-1], "answer") if turns else None
        format_ok = (
            answer is not None
            and all(q for q in queries)
            and len(turns) <= self.max_turns
            and all(last_tag(t, "answer") is None for t in turns[:-1])
        )
        correct = format_ok and exact_match(answer or "", task.answers)
        wanted = [normalize(a) for a in task.answers]
        if results is None:
            shown = [self._search(q) for q in queries if q]
        else:
            shown = [self._docs(r) for r in results]
        found = any(w in normalize(doc) for docs in shown for doc in docs for w in wanted)
        metrics = {
            "correct": float(correct),
            "searched": float(any(queries)),
            "search_success": float(found),
            "turns": float(len(turns)),
            "format_ok": float(format_ok),
        }
        return Score(reward=float(correct), metrics=metrics)

    def demonstration(self, task: Task, good: bool, rng: random.Random) -> list[str]:
        """Good: search with the question, answer from the top document that
        holds an answer. Poor: answer at once with the entity the question
        names (the gene asked about, say): confident and always wrong.
        Two-hop questions: `_two_hop_demo`.

        The poor answer is a copy from the prompt, as the good one is a copy
        from the information. An earlier poor demo answered with another
        training question's answer: the model learned to emit remembered names
        where it should copy, and fewer of its searches ended in a right answer
        (docs/benchmarks.md).
        """
        if self.hops > 1:
            return self._two_hop_demo(task, good)
        if good:
            for doc in self._search(task.question):
                for answer in task.answers:
                    at = doc.lower().find(answer.lower())
                    if at >= 0:  # copy the span as the document spells it
                        span = doc[at : at + len(answer)]
                        # The leading space makes the answer's tokens those of the
                        # document (BPE marks word starts), so it is a plain copy.
                        return [f"<search>{task.question}</search>", f"<answer> {span}</answer>"]
        return [f"<answer> {task.info['subject']}</answer>"]

    def _two_hop_demo(self, task: Task, good: bool) -> list[str]:
        """Good: search with the question, then with its `then` and the bridge as
        the results spell it, and answer from the second results. Poor: the naive
        episode: one search, then the decoy (a look-alike of the answer) copied
        from its results. Either falls back to answering with the question's
        entity when the results lack what it copies.
        """
        first = self._search(task.question)
        turns = [f"<search>{task.question}</search>"]
        bridge = _span(first, (task.info["bridge"],))
        if good and bridge is not None:
            second = self.second_query(task, bridge)
            answer = _span(self._search(second), task.answers)
            if answer is not None:
                return [*turns, f"<search>{second}</search>", f"<answer> {answer}</answer>"]
        decoy = _span(first, (task.info["decoy"],))
        if not good and decoy is not None:
            return [*turns, f"<answer> {decoy}</answer>"]
        return [f"<answer> {task.info['subject']}</answer>"]

    @staticmethod
    def second_query(task: Task, bridge: str) -> str:
        """The question about the bridge that a two-hop question opens with."""
        return f"{task.info['then']} {bridge}?"

    def tokenizer_texts(self) -> list[str]:
        if self.hops > 1:
            return self._multihop_texts()
        tasks = [*self.corpus.train, *self.corpus.test]
        # Tool replies too, so the tags and "Doc n:" become single tokens.
        replies = [self.information(t.question) for t in self.corpus.train[::4]]
        # The system prompt opens every episode: weighted so, its words become
        # tokens of their own, and every episode is shorter for it (seen once,
        # it was split into sub-word pieces).
        return [
            *[SYSTEM] * len(tasks),
            *self.corpus.docs,
            *(t.question for t in tasks),
            *replies,
        ] + [f"<search>{t.question}</search><answer> {t.answers[0]}</answer>" for t in tasks]

    def _multihop_texts(self) -> list[str]:
        """As for one hop, with both searches of an episode and their replies."""
        tasks = [*self.corpus.train, *self.corpus.test]
        seconds = [self.second_query(t, t.info["bridge"]) for t in tasks]
        # Two replies an episode, each kind at half searchqa's rate: as many in all.
        replies = [self.information(t.question) for t in self.corpus.train[::8]]
        replies += [self.information(q) for q in seconds[::8]]
        demos = [
            f"<search>{t.question}</search><search>{q}</search><answer> {t.answers[0]}</answer>"
            for t, q in zip(tasks, seconds, strict=True)
        ]
        return [*[self.system] * len(tasks), *self.corpus.docs, *replies, *demos]


def _span(docs: Sequence[str], names: Sequence[str]) -> str | None:
    """The first of `names` in `docs`, as the document spells it (a copy, not a recall)."""
    for doc in docs:
        for name in names:
            if (found := find_name(doc, name)) is not None:
                return found
    return None
