"""How a tool opens a run it only reads (the report, the live view, the
evaluation of a published version, benchmarks): run.json verified, the
trust it establishes, and the inbox it names.

Such a tool pins the key that signed run.json, or the one it is given
(`trusted`, a fingerprint); every trainer document it reads afterwards is
checked against that key.
"""

from __future__ import annotations

from dataclasses import dataclass

from colonnade.store import ObjectStore

from . import keys
from .inbox import open_inbox
from .schemas import MAX_JSON_BYTES, RunSpec
from .signing import Trust, read_run_envelope


@dataclass(frozen=True)
class RunView:
    spec: RunSpec
    trust: Trust
    inbox: ObjectStore


def open_run(
    store: ObjectStore,
    trusted: str | None = None,
    *,
    endpoint_url: str | None = None,
    profile: str | None = None,
) -> RunView:
    """The run under `store`: NotFound without run.json, SchemaError (or
    SignatureRejected, ProtocolMismatch) for one that does not verify."""
    doc, trust = read_run_envelope(store.get(keys.RUN, max_bytes=MAX_JSON_BYTES), trusted)
    spec = RunSpec.from_dict(doc)
    return RunView(spec, trust, open_inbox(store, spec, endpoint_url=endpoint_url, profile=profile))
