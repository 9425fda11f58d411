"""The built-in `searchqa` environment (see env.py); `searchqa2` is its two-hop form."""

from .env import SearchQA


def load_environment(
    n_clusters: int = 600,
    test_fraction: float = 0.2,
    top_k: int = 3,
    max_turns: int = 3,
    seed: int = 0,
    hops: int = 1,
    service: str = "",
    service_key: str = "",
) -> SearchQA:
    """600 clusters give 3,600 documents, 1,920 train and 480 test questions.

    `hops=2`: two-hop questions (as many), over 6,000 documents with the decoys.
    `service=URL`, `service_key=HEX`: the corpus is behind a tool service
    (`colonnade tools serve --env searchqa` with the same corpus arguments);
    this side builds the questions alone. Past 1,000 clusters names are longer.
    """
    return SearchQA(
        n_clusters,
        test_fraction,
        top_k,
        max_turns,
        seed,
        hops=hops,
        service=service,
        service_key=service_key,
    )


__all__ = ["SearchQA", "load_environment"]
