"""The built-in `searchqa2`: searchqa with two-hop questions (`hops=2`).

A name of its own so that `--env searchqa2` is all a run needs; it is the
same environment as `searchqa` with the argument `hops=2`.
"""

from .env import SearchQA


def load_environment(
    n_clusters: int = 600,
    test_fraction: float = 0.2,
    top_k: int = 3,
    max_turns: int = 3,
    seed: int = 0,
    service: str = "",
    service_key: str = "",
) -> SearchQA:
    """Three turns: the two searches and the answer (see docs/environments.md on budgets);
    `service` and `service_key` as for searchqa."""
    return SearchQA(
        n_clusters,
        test_fraction,
        top_k,
        max_turns,
        seed,
        hops=2,
        service=service,
        service_key=service_key,
    )
