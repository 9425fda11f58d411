"""BM25 retrieval over the corpus (bm25s: sparse, numpy only)."""

from __future__ import annotations

import bm25s


class BM25Index:
    def __init__(self, docs: list[str]):
        if not docs:
            raise ValueError("empty corpus")
        self.docs = docs
        self._retriever = bm25s.BM25()
        self._retriever.index(self._tokenize(docs), show_progress=False)

    @staticmethod
    def _tokenize(texts: list[str]):
        return bm25s.tokenize(texts, stopwords="en", show_progress=False)

    def search(self, query: str, k: int) -> list[str]:
        """The k best documents for query, best first (fewer if nothing matches)."""
        tokens = self._tokenize([query])
        if not tokens.vocab:  # only stopwords or punctuation
            return []
        k = min(k, len(self.docs))
        ids, scores = self._retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [self.docs[int(i)] for i, s in zip(ids[0], scores[0], strict=True) if s > 0]
