"""The protocol over the object store: keys, schemas, version publication.

The trainer and the workers share nothing but these objects; see
docs/protocol.md for the table of keys and who writes them.
"""

from . import keys
from .schemas import (
    EpisodeRecord,
    GroupRecord,
    ProtocolMismatch,
    RolloutBatch,
    RunSpec,
    SchemaError,
    VersionMeta,
    decode_batch,
    encode_batch,
)
from .weights import Follower, Publisher, VersionError, latest_version, read_latest, read_meta

__all__ = [
    "EpisodeRecord",
    "Follower",
    "GroupRecord",
    "ProtocolMismatch",
    "Publisher",
    "RolloutBatch",
    "RunSpec",
    "SchemaError",
    "VersionError",
    "VersionMeta",
    "decode_batch",
    "encode_batch",
    "keys",
    "latest_version",
    "read_latest",
    "read_meta",
]
