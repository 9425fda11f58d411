"""The built-in `searchqa` environment (see env.py)."""

from .env import SearchQA


def load_environment(
    n_clusters: int = 600,
    test_fraction: float = 0.2,
    top_k: int = 3,
    max_turns: int = 3,
    seed: int = 0,
) -> SearchQA:
    """600 clusters give 3,600 documents, 1,920 train and 480 test questions."""
    return SearchQA(n_clusters, test_fraction, top_k, max_turns, seed)


__all__ = ["SearchQA", "load_environment"]
