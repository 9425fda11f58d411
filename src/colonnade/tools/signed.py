"""Calls to a tool service and its signed replies: the documents and their checks.

A `Call` says where in a run the tool was asked: the run, the task, the
episode's row (its draw key, `protocol.draws.draw_key`, in hex: it commits
to run, version, worker, claim slot, task and row), the model turn that
asked (1-based) and the query that turn holds. The service answers with a
`result` (any JSON value) and signs

    DOMAIN | canonical JSON of {"call": call, "result": result}

with its Ed25519 key (canonical: sorted keys, no spaces, as
`protocol.schemas.dumps` writes). The signature therefore says: the service
gave this result to this query, asked at this turn of this row of this run.
A worker that changes the result, or moves the reply to another row, turn,
task or run, breaks it; the trainer checks the call against what it
recomputes itself (train/replies.py).

Everything here is read from strangers (a worker's batch, a service's
answer): shapes and sizes are checked before a signature is.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from colonnade.untrusted import SchemaError, is_int, need

DOMAIN = b"colonnade-tool-reply 1\0"
MAX_NAME = 256  # characters of a run id or task id
MAX_QUERY = 4096  # characters of a query
MAX_RESULT_BYTES = 64 << 10  # a result, as canonical JSON
MAX_RESULT_DEPTH = 8
MAX_TURN = 1 << 16
CALL_FIELDS = ("run", "task", "row", "turn", "query")
REPLY_FIELDS = ("call", "result", "signature")
_HEX_ROW = re.compile(r"([0-9a-f]{64})?")  # a draw key, or "" outside a run
_HEX_SIG = re.compile(r"[0-9a-f]{128}")
_HEX_KEY = re.compile(r"[0-9a-f]{64}")


class ReplyRejected(SchemaError):
    """A reply that is not the service's answer to the call it names."""

    reason = "tool_reply"


def canonical(doc: Any) -> bytes:
    """The bytes a signature covers: sorted keys, no spaces, UTF-8."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)  # fmt: skip
    return text.encode()


@dataclass(frozen=True)
class Call:
    """What a worker asks a tool service, and where in the run it asks it."""

    run: str  # the run's id ("" outside a run: evaluations, warm starts)
    task: str  # the task's id
    row: str  # the episode's draw key, 64 hex characters ("" outside a run)
    turn: int  # the model turn that asked, from 1
    query: str  # what that turn asks (the environment's `tool_query`)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Call:
        need(isinstance(d, dict) and set(d) == set(CALL_FIELDS), f"a call has {CALL_FIELDS}")
        for name in ("run", "task"):
            need(isinstance(d[name], str) and len(d[name]) <= MAX_NAME,
                 f"call {name}: a string of at most {MAX_NAME}")  # fmt: skip
        need(isinstance(d["row"], str) and _HEX_ROW.fullmatch(d["row"]) is not None,
             "call row: 64 lowercase hex characters or empty")  # fmt: skip
        need(is_int(d["turn"], 0, MAX_TURN), f"call turn: an integer 0..{MAX_TURN}")
        need(isinstance(d["query"], str) and len(d["query"]) <= MAX_QUERY,
             f"call query: a string of at most {MAX_QUERY}")  # fmt: skip
        return cls(**d)


def check_result(result: Any) -> bytes:
    """The canonical bytes of a result, bounded in size and depth; SchemaError."""
    try:
        data = canonical(result)
    except (TypeError, ValueError, RecursionError) as e:  # NaN, a lone surrogate, not JSON
        raise SchemaError(f"result: not JSON ({str(e)[:80]})") from None
    need(len(data) <= MAX_RESULT_BYTES, f"result: {len(data)} bytes, more than {MAX_RESULT_BYTES}")
    need(_depth(result) <= MAX_RESULT_DEPTH, f"result: nested more than {MAX_RESULT_DEPTH} deep")
    return data


def _depth(value: Any) -> int:
    """How deep lists and objects nest in a value that `canonical` took (so bounded)."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _message(call: Call, result: Any) -> bytes:
    return DOMAIN + canonical({"call": call.to_dict(), "result": result})


@dataclass(frozen=True)
class Reply:
    """A service's signed answer to one call: what a batch carries per served reply."""

    call: Call
    result: Any  # JSON: the environment turns it into the reply's text (`tool_reply`)
    signature: str  # 128 hex characters: Ed25519 over `_message(call, result)`

    def to_dict(self) -> dict:
        return {"call": self.call.to_dict(), "result": self.result, "signature": self.signature}

    @classmethod
    def from_dict(cls, d: Any) -> Reply:
        """A reply of the right shape and size; its signature is not checked here."""
        need(isinstance(d, dict) and set(d) == set(REPLY_FIELDS), f"a reply has {REPLY_FIELDS}")
        call = Call.from_dict(d["call"])
        check_result(d["result"])
        sig = d["signature"]
        need(isinstance(sig, str) and _HEX_SIG.fullmatch(sig) is not None,
             "reply signature: 128 lowercase hex characters")  # fmt: skip
        return cls(call, d["result"], sig)

    def verify(self, public: Ed25519PublicKey) -> None:
        """ReplyRejected unless `public` signed exactly this call and result."""
        try:
            public.verify(bytes.fromhex(self.signature), _message(self.call, self.result))
        except InvalidSignature:
            raise ReplyRejected(
                f"the reply to turn {self.call.turn} is not signed by the service's key "
                "for this call and result (altered, or signed by another key)"
            ) from None


def sign_reply(private: Ed25519PrivateKey, call: Call, result: Any) -> Reply:
    """The service's side: `result` for `call`, signed (SchemaError for a result out of bounds)."""
    check_result(result)
    return Reply(call, result, private.sign(_message(call, result)).hex())


def public_key(text: Any) -> Ed25519PublicKey:
    """A pinned service key from its 64 lowercase hex characters; ValueError otherwise."""
    if not isinstance(text, str) or _HEX_KEY.fullmatch(text) is None:
        raise ValueError(
            f"service_key {str(text)[:80]!r}: 64 lowercase hex characters (the public key "
            "`colonnade tools serve` prints)"
        )
    return Ed25519PublicKey.from_public_bytes(bytes.fromhex(text))


def key_hex(public: Ed25519PublicKey) -> str:
    return public.public_bytes_raw().hex()
