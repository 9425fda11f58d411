"""The model's files under `model/`: config, tokenizer, generation config.

The trainer uploads them once, when it starts a run (`model_files` picks
them from its model directory; the signed run.json's `model_files` names
them with their hashes). A worker, and the evaluation of a published
version, read them back with `fetch_model`, each checked against its hash,
into a float skeleton whose weights then come from
`weights/` (docs/protocol.md); the export of a published version takes the
files themselves (`fetch_files`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from colonnade.pulse.hashing import algo_of, digest_bytes
from colonnade.store import ObjectStore

from . import keys
from .schemas import RunSpec

MODEL_FILE_LIMIT = 64 << 20  # bytes, one file: written and read under this bound


class ModelFileError(ValueError):
    """A model file that is not the one the trainer published."""


def model_files(model_dir: Path) -> dict[str, bytes]:
    """Everything but weights: config, tokenizer, generation config."""
    out = {}
    for p in sorted(model_dir.iterdir()):
        weights = p.name.endswith((".safetensors", ".bin", ".safetensors.index.json"))
        if p.is_file() and not weights and p.stat().st_size:
            if p.stat().st_size > MODEL_FILE_LIMIT:
                raise ValueError(f"{p}: larger than {MODEL_FILE_LIMIT} bytes")
            out[p.name] = p.read_bytes()
    return out


def fetch_files(store: ObjectStore, spec: RunSpec, folder: Path) -> list[str]:
    """The run's model files into `folder`, each checked against the hash the
    signed run.json gives it (ModelFileError where one differs); their names."""
    for name, want in spec.model_files.items():
        data = store.get(keys.model_file(name), max_bytes=MODEL_FILE_LIMIT)
        if digest_bytes(data, algo_of(want)) != want:
            key = keys.model_file(name)
            raise ModelFileError(f"{key} does not hash as the signed run.json says")
        (folder / name).write_bytes(data)
    return list(spec.model_files)


def fetch_model(store: ObjectStore, spec: RunSpec):
    """(model skeleton: parameters on the meta device, tokenizer) from the run's
    config and tokenizer files."""
    from colonnade.model.loading import load_tokenizer, skeleton

    # The files are read into memory here: the folder goes when this returns.
    # A skeleton: the engine makes every tensor from the published state, so
    # no fp32 copy of the whole model is ever made.
    with tempfile.TemporaryDirectory(prefix=f"colonnade-{spec.run_id}-") as tmp:
        fetch_files(store, spec, Path(tmp))
        return skeleton(tmp), load_tokenizer(tmp)
