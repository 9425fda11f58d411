"""A run.json signed by a fresh trainer key, for tests that publish: a plain
module (not conftest) so any test imports it whatever conftest loaded last."""

from __future__ import annotations


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
