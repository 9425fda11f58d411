"""A direct TCP link between a pipeline group's stages (`--stage-link tcp`).

By default a group's stage messages pass through the run's inbox
(`rollout/pipeline.py`): a put, then the reader's polls of the key, each a
store round trip. Where the stages can reach each other, `StageLink` carries
them over TCP instead. It is shaped like the `ObjectStore` that `Front` and
`StageServer` take (put, get, list, delete), so they run unchanged over it:

- push, not pull: a stage's own messages (keys under its own id) go by HTTP
  PUT to its consumer (stage K+1; the last stage's replies to the first),
  which keeps them in memory (`Mailbox`); a stage's get and list of its
  producer's keys read its own mailbox, no network. A hop then costs one
  request, the sender's, and the reader finds the message at its next look
  of the mailbox: no round trip to poll (the store's 2.5 a hop).
- no deletes: a writer's delete is a no-op, as its message lives at the
  reader; a writer's listing of its own messages asks the reader (`GET
  /held/{prefix}`), which is how a first stage that restarts numbers its
  batches above the group's last. The mailbox drops a stream's step n when step n + 1 of it lands,
  and every message of a batch when a newer batch's lands. The pipeline's
  order makes that safe (pipeline.py: the first stage sends a stream's step
  n + 1 only once step n's reply came back through every stage, so step n
  was read at every stage before any n + 1 is sent, and a batch starts only
  once the last one's replies all came or it was given up). A message that
  was read is also the first to go when the mailbox is full (`Mailbox.put`):
  its bounds then hold back a sender (503, retried) but never lock the line
  up, since every message not yet read is the next one its reader wants.
- every message is a stranger's, as from the store: at most
  `MAX_STAGE_BYTES`, its key under the producer's prefix (anything else is
  refused before its body is read), in a signed run signed by the
  producer's registered key (`signing.sign_link`: a header over a digest of
  the run, the key and the bytes, checked against the trainer's signed
  `trainer/keys.json`), and then checked by `unpack_step`/`unpack_sampled`
  as before. The mailbox holds at most `max_messages` messages and
  `max_bytes` bytes; the server at most `MAX_CONNECTIONS` connections, each
  dropped after `IDLE_S` without a byte.
- discovery through the inbox: each stage on a link writes where it listens
  as `{worker}/stage-link.json` (`documents.StageAddress`, signed in a signed
  run), and a producer reads its consumer's (`open_stage_address`: bounded,
  schema-checked, of this run, group and worker) before its first put and
  again whenever the consumer cannot be reached (it may have restarted on
  another port).

Every request has a timeout; a put is tried again (the address read again)
until `timeout` has passed, then raises `LinkDown`: to the first stage a
`StageTimeout` (the batch is given up, as for a stage that died), to a later
stage a `StoreError` (logged and tried again, as for the store's).

A design that pulls (each stage serving its own messages to its reader, as
the store does) would keep deletes and listings remote: a round trip per
look again, the cost the link is there to remove.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler

from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from colonnade.httpjson import BoundedServer
from colonnade.protocol import keys
from colonnade.protocol.documents import (
    ENVELOPE_BYTES,
    StageAddress,
    open_stage_address,
    seal_stage_address,
)
from colonnade.protocol.schemas import MAX_JSON_BYTES
from colonnade.protocol.signing import (
    SignatureRejected,
    Trust,
    public_from_hex,
    sign_link,
    verify_link,
)
from colonnade.protocol.stages import MAX_STAGE_BYTES
from colonnade.store import (
    InvalidKey,
    NotFound,
    ObjectStore,
    ObjectTooLarge,
    StoreError,
    StoreUnavailable,
)
from colonnade.untrusted import SchemaError, host_port

from .pipeline import TIMEOUT_S, Group, GroupError, StageTimeout

log = logging.getLogger("colonnade.stagelink")

PATH = "/stage/"  # PUT /stage/{message key}
HELD = "/held/"  # GET /held/{prefix}: the keys held under a prefix, a line each
SIGNATURE = "X-Colonnade-Signature"  # 128 hex characters (`signing.sign_link`)
# The mailbox's bounds: enough for a front's every micro-batch (a stream
# holds one message not yet read), and a few of the largest messages.
MAX_MESSAGES = 1024
MAX_HELD_BYTES = 4 * MAX_STAGE_BYTES
MAX_CONNECTIONS = 64  # a producer's pooled connections, and room for strangers
IDLE_S = 60.0  # a connection silent this long is closed (its slot freed)
# A body must come whole within BODY_S + its bytes / MIN_RATE (256 MiB: 4.5 min).
BODY_S, MIN_RATE = 10.0, 1 << 20
REQUEST_S = 30.0  # one request's connect and each read or write on its socket
RETRY_S = (0.05, 1.0)  # the pause between tries of a put: first, at most
KEYRING_EVERY_S = 5.0  # the keyring is read again at most this often
POOL = 8  # idle connections a sender keeps to its consumer
MAX_ANSWER = 4096  # the bytes of an answer's text a sender reads
# A listing of the keys held, a line each: a key is its worker id (at most
# 64 characters, `keys.check_worker_id`) and a few dozen more.
MAX_LISTING = MAX_MESSAGES * 160
LISTING_S = 5.0  # a listing's one try: a consumer out of reach lists nothing


class LinkDown(StoreUnavailable, StageTimeout):
    """A message the consumer did not take within the timeout (unreachable,
    or refused). Both at once: the first stage gives its batch up on a
    `StageTimeout`, a later stage logs a `StoreError` and goes on."""


class Refused(Exception):
    """What a mailbox will not take: an HTTP status and why."""

    def __init__(self, status: int, text: str, unread: bool = False):
        super().__init__(text)
        self.status, self.unread = status, unread  # unread: the body was left unread


@dataclass
class _Held:
    data: bytes
    read: bool = False


class Mailbox:
    """The messages one producer pushed here, by key, in memory.

    A stream keeps its newest step only and the mailbox its newest batch
    only (the module's order argument); what arrives older than what is held
    is refused (409), the same step again replaces it (a put tried again)."""

    def __init__(self, producer: str, max_messages: int = MAX_MESSAGES,
                 max_bytes: int = MAX_HELD_BYTES):  # fmt: skip
        self.producer = keys.check_worker_id(producer)
        self.max_messages, self.max_bytes = max_messages, max_bytes
        self.held: dict[str, _Held] = {}
        self.seqs: dict[int, tuple[int, str]] = {}  # stream -> (seq, key) of the newest batch
        self.batch = -1
        self.bytes = 0
        self.lock = threading.Lock()

    def check_key(self, key: str) -> tuple[int, int, int]:
        """(batch, stream, seq) of a key this mailbox may take; Refused otherwise."""
        parsed = keys.parse_stage_key(key)
        if parsed is None:
            raise Refused(400, f"{key[:200]!r} is no stage message key")
        if parsed[0] != self.producer:
            raise Refused(403, f"this stage takes messages of {self.producer!r} only")
        return parsed[1:]

    def put(self, key: str, data: bytes) -> None:
        batch, stream, seq = self.check_key(key)
        if len(data) > MAX_STAGE_BYTES:
            raise Refused(413, f"a message is at most {MAX_STAGE_BYTES} bytes")
        with self.lock:
            if batch < self.batch:
                raise Refused(409, f"batch {batch} is older than batch {self.batch}")
            if batch > self.batch:
                for old in list(self.held):
                    self._drop(old)
                self.batch, self.seqs = batch, {}
            held = self.seqs.get(stream)
            if held is not None:
                if seq < held[0]:
                    raise Refused(409, f"step {seq} of stream {stream} is older than {held[0]}")
                self._drop(held[1])
            self._make_room(len(data))
            self.held[key] = _Held(data)
            self.bytes += len(data)
            self.seqs[stream] = (seq, key)

    def _make_room(self, size: int) -> None:
        """Drop messages already read until one of `size` bytes fits; Refused
        (503: try again) while the messages not yet read fill the bounds."""

        def full() -> bool:
            return len(self.held) + 1 > self.max_messages or self.bytes + size > self.max_bytes

        if full():
            for key in [k for k, h in self.held.items() if h.read]:
                self._drop(key)
                if not full():
                    break
        if full():
            raise Refused(503, f"the mailbox is full ({len(self.held)} messages, "
                               f"{self.bytes} bytes not yet read)")  # fmt: skip

    def _drop(self, key: str) -> None:
        held = self.held.pop(key, None)
        if held is not None:
            self.bytes -= len(held.data)

    def get(self, key: str) -> bytes:
        with self.lock:
            held = self.held.get(key)
            if held is None:
                raise NotFound(f"stage link: {key}")
            held.read = True
            return held.data

    def list(self, prefix: str = "") -> list[str]:
        with self.lock:
            return sorted(k for k in self.held if k.startswith(prefix))


class Keyring:
    """A signed run's registered worker keys, as the trainer signed them
    (`trainer/keys.json`), read again at most every KEYRING_EVERY_S when a
    worker's key is missing or does not verify (keys are registered while a
    run goes on)."""

    def __init__(self, read: Callable[[], dict[str, Ed25519PublicKey]]):
        self.read = read
        self.keys: dict[str, Ed25519PublicKey] = {}
        self.at = -float("inf")
        self.lock = threading.Lock()

    @classmethod
    def of_run(cls, store: ObjectStore, trust: Trust) -> Keyring:
        def read() -> dict[str, Ed25519PublicKey]:
            limit = MAX_JSON_BYTES + ENVELOPE_BYTES
            doc = trust.open(keys.KEYRING, store.get(keys.KEYRING, max_bytes=limit), limit)
            ring = {}
            for worker, text in doc.items():
                with contextlib.suppress(SchemaError, ValueError):
                    ring[keys.check_worker_id(worker)] = public_from_hex(text)
            return ring

        return cls(read)

    def current(self, fresh: bool = False) -> dict[str, Ed25519PublicKey]:
        """The keys; read again first when `fresh` and the last read is old enough."""
        with self.lock:
            if time.monotonic() - self.at >= (KEYRING_EVERY_S if fresh else float("inf")):
                self.at = time.monotonic()
                try:
                    self.keys = self.read()
                except (SchemaError, StoreError) as e:
                    log.warning("stage link: the run's keyring not read: %s", e)
            return dict(self.keys)

    def verify(self, worker: str, run_id: str, key: str, data: bytes, signature: str) -> None:
        """SignatureRejected unless `worker`'s registered key signed the message."""
        for fresh in (False, True):
            public = self.current(fresh).get(worker)
            try:
                if public is None:
                    raise SignatureRejected("unknown_key", f"{worker!r} has no registered key")
                verify_link(signature, run_id, key, data, public)
                return
            except SignatureRejected:
                if fresh:
                    raise


class _Handler(BaseHTTPRequestHandler):
    """PUT /stage/{key}: one message, its body bounded and its key checked
    before the body is read; GET /held/{prefix}: the keys held."""

    protocol_version = "HTTP/1.1"  # keep-alive: a sender's connections are reused
    timeout = IDLE_S
    disable_nagle_algorithm = True  # an answer's header and text go out at once
    server: _Server

    def parse_request(self) -> bool:
        if self.server.link.closed:  # a kept connection outlives the listener: not its requests
            self.close_connection = True
            return False
        return super().parse_request()

    def do_PUT(self) -> None:
        link = self.server.link
        try:
            if not self.path.startswith(PATH):
                raise Refused(404, f"messages go to {PATH}KEY")
            key = self.path[len(PATH) :]
            link.mailbox.check_key(key)
            length = self.headers.get("Content-Length")
            if self.headers.get("Transfer-Encoding") or length is None:
                raise Refused(411, "send the message with a Content-Length")
            digits = length.isascii() and length.isdigit() and len(length) <= 12
            if not digits or int(length) > MAX_STAGE_BYTES:
                raise Refused(413, f"a message is at most {MAX_STAGE_BYTES} bytes")
            with link.receiving(int(length)):
                data = self._body(int(length))
                if data is None:
                    self.close_connection = True
                    return
                link.receive(key, data, self.headers.get(SIGNATURE, ""))
        except Refused as e:
            if e.status in (400, 403, 404, 411, 413) or e.unread:
                self.close_connection = True  # the body, if any, is left unread
            self._answer(e.status, str(e))
            return
        self._answer(200, "")

    def _body(self, length: int) -> bytes | None:
        """The request's body, or None if it does not come whole within
        BODY_S + length / MIN_RATE: a sender that trickles bytes would
        otherwise hold its room among the bodies in reading for as long as
        it keeps sending one a minute."""
        deadline = time.monotonic() + BODY_S + length / MIN_RATE
        out, got = bytearray(length), 0
        view = memoryview(out)
        try:
            while got < length:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.connection.settimeout(min(IDLE_S, left))
                n = self.rfile.readinto1(view[got : got + (1 << 20)])
                if not n:
                    return None
                got += n
        except OSError:  # a socket timeout among them
            return None
        finally:
            view.release()
            self.connection.settimeout(IDLE_S)
        return bytes(out)

    def do_GET(self) -> None:
        """The keys held under a prefix of the producer's messages: how a
        producer that restarted numbers its batches on (`StageLink.list`)."""
        mailbox = self.server.link.mailbox
        prefix = self.path[len(HELD) :]
        if not (self.path.startswith(HELD) and prefix.startswith(keys.stage_dir(mailbox.producer))):
            self.close_connection = True
            self._answer(404, f"listings are at {HELD}{keys.stage_dir(mailbox.producer)}...")
            return
        self._answer(200, "\n".join(mailbox.list(prefix)), MAX_LISTING)

    def _answer(self, status: int, text: str, limit: int = MAX_ANSWER) -> None:
        data = text.encode()[:limit]
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True  # the sender left

    def log_message(self, format, *args) -> None:
        log.debug("stage link: %s %s", self.address_string(), format % args)


class _Server(BoundedServer):
    link: StageLink

    def __init__(self, address: tuple[str, int], max_connections: int):
        # Before the base makes its socket: an IPv6 address needs its family.
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _Handler, max_connections)


class StageLink:
    """A stage's messages over TCP, where `Front`/`StageServer` take a store
    (the module's design): its own go to `consumer`, `producer`'s land here.

    `inbox`: where the stages' addresses are (this one's is written at
    start); `keyring`: a signed run's registered keys (None: an open run,
    whose messages are taken unsigned, as its inbox takes them); `private`:
    this worker's key, which signs what it sends (None: unsigned)."""

    def __init__(
        self,
        me: str,
        producer: str,
        consumer: str,
        *,
        run_id: str,
        group: str,
        inbox: ObjectStore,
        keyring: Keyring | None = None,
        private: Ed25519PrivateKey | None = None,
        listen: str = "0.0.0.0:0",
        advertise: str = "",
        timeout: float = TIMEOUT_S,
        max_messages: int = MAX_MESSAGES,
        max_bytes: int = MAX_HELD_BYTES,
    ):
        self.me, self.consumer = keys.check_worker_id(me), keys.check_worker_id(consumer)
        self.run_id, self.group, self.inbox = run_id, group, inbox
        self.keyring, self.private, self.timeout = keyring, private, timeout
        self.mailbox = Mailbox(producer, max_messages, max_bytes)
        # Bodies being read, bounded as the mailbox is: before a signature is
        # checked, connections could otherwise hold 256 MiB apiece.
        self.reading, self.read_bound = 0, max_bytes
        self.closed = False
        self.read_lock = threading.Lock()
        host, port = host_port(listen, any_port=True)
        try:
            self.server = _Server((host, port), MAX_CONNECTIONS)
        except OSError as e:  # taken, or no such interface here: the operator's to fix
            raise GroupError(f"--stage-listen {listen}: cannot listen there ({e})") from None
        self.server.link = self
        bound = self.server.server_address[1]
        self.address = advertise or _advertised(host, bound)
        self.thread = threading.Thread(target=self.server.serve_forever, name="stage-link",
                                       daemon=True)  # fmt: skip
        self.thread.start()
        self.dialer = _Dialer(self._consumer_address, timeout)
        key = keys.stage_link_key(me)
        doc = StageAddress(me, group, self.address, time.time())
        try:
            inbox.put(key, seal_stage_address(private, run_id, key, doc))
        except StoreError:
            self.close()  # opened again on the next try
            raise
        log.info("stage link: listening on %s:%d, reached at %s; sending to %s", host, bound,
                 self.address, consumer)  # fmt: skip

    # -- the store's surface, as Front and StageServer use it -------------------------------
    deletes = False  # a writer's delete does nothing (`delete`): nothing to list for one

    @property
    def url(self) -> str:
        return f"stage-link://{self.address}"

    def put(self, key: str, data: bytes) -> None:
        """Send one of this stage's messages to its consumer; LinkDown when
        it is not taken within the timeout."""
        parsed = keys.parse_stage_key(key)
        if parsed is None or parsed[0] != self.me:
            raise InvalidKey(f"stage link: {key!r} is not a message of {self.me!r}")
        headers = {}
        if self.private is not None:
            headers[SIGNATURE] = sign_link(self.private, self.run_id, key, data)
        self.dialer.send(PATH + key, data, headers)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        data = self.mailbox.get(key)
        if max_bytes is not None and len(data) > max_bytes:
            raise ObjectTooLarge(f"stage link: {key}: {len(data)} bytes exceeds {max_bytes}")
        return data

    def list(self, prefix: str = "") -> list[str]:
        """The producer's messages held here; under this stage's own prefix,
        its messages its consumer holds (one request, nothing if it fails):
        a first stage that restarts numbers its batches above them, as over
        the store (`Front._first_batch`)."""
        if not prefix.startswith(keys.stage_dir(self.me)):
            return self.mailbox.list(prefix)
        text = self.dialer.fetch(HELD + prefix)
        held = [] if text is None else text.splitlines()
        return sorted(k for k in held if k.startswith(prefix) and keys.parse_stage_key(k))

    def delete(self, key: str) -> None:
        """Nothing: this stage's messages are held by its consumer, which
        drops each once the next one of its stream (or batch) lands."""

    # -- the rest ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def receiving(self, size: int):
        """Room for a body of `size` bytes while it is read and checked;
        Refused (503, the body unread) while bodies in reading fill the bound."""
        with self.read_lock:
            if self.reading + size > self.read_bound:
                raise Refused(503, "too many messages in reading", unread=True)
            self.reading += size
        try:
            yield
        finally:
            with self.read_lock:
                self.reading -= size

    def receive(self, key: str, data: bytes, signature: str) -> None:
        """A message that came in: checked, then held; Refused otherwise."""
        if self.keyring is not None:
            try:
                self.keyring.verify(self.mailbox.producer, self.run_id, key, data, signature)
            except SignatureRejected as e:
                raise Refused(403, str(e)) from None
        self.mailbox.put(key, data)

    def _consumer_address(self) -> tuple[str, int] | None:
        """Where the consumer says it listens (its doc in the inbox); None
        while it has written none of this run and group."""
        key = keys.stage_link_key(self.consumer)
        try:
            data = self.inbox.get(key, max_bytes=StageAddress.MAX_BYTES + ENVELOPE_BYTES)
            ring = None if self.keyring is None else self.keyring.current(fresh=True)
            doc = open_stage_address(data, key, self.run_id, ring)
        except NotFound:
            return None
        except (SchemaError, StoreError) as e:  # a bad doc, or the inbox out of reach
            log.warning("stage link: %s not read: %s", key, e)
            return None
        if doc.group != self.group:
            return None  # a doc of another group's start: not written for us
        return host_port(doc.address)

    def close(self) -> None:
        self.closed = True
        self.server.shutdown()
        self.server.server_close()
        self.dialer.close()


def open_link(group: Group, stage: int, inbox: ObjectStore, **kw) -> StageLink:
    """Stage `stage` (from 0)'s link in `group`: it takes the stage before's
    messages (the first stage: the last's replies) and sends to the next
    (the last stage: to the first). `kw`: `StageLink`'s."""
    ids = group.workers
    return StageLink(ids[stage], ids[stage - 1], ids[(stage + 1) % len(ids)], run_id=group.run,
                     group=group.name, inbox=inbox, **kw)  # fmt: skip


def _advertised(host: str, port: int) -> str:
    """The address others dial when none is given: the bound one, or for a
    wildcard bind this host's name resolved."""
    if host in ("0.0.0.0", "::", ""):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
        if ipaddress.ip_address(host).is_loopback:
            # Right where every stage runs on this host; elsewhere the other
            # stages would dial themselves.
            log.warning(
                "stage link: this host's name resolves to %s, which only this host "
                "reaches: pass --stage-advertise HOST:PORT for stages elsewhere",
                host,
            )
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Dialer:
    """A sender's connections to its consumer: a few kept open, every
    request bounded in time, a put tried again until its deadline."""

    def __init__(self, resolve: Callable[[], tuple[str, int] | None], timeout: float):
        self.resolve, self.timeout = resolve, timeout
        self.address: tuple[str, int] | None = None
        self.idle: list[http.client.HTTPConnection] = []
        self.lock = threading.Lock()

    def send(self, path: str, data: bytes, headers: dict[str, str]) -> None:
        deadline = time.monotonic() + self.timeout
        pause, why = RETRY_S[0], "no address"
        while True:
            conn, reused = self._connection(deadline)
            if conn is not None:
                try:
                    conn.request("PUT", path, body=data, headers=headers)
                    resp = conn.getresponse()
                    text = resp.read(MAX_ANSWER).decode(errors="replace")
                    if resp.status // 100 == 2:
                        self._keep(conn, resp)
                        return
                    conn.close()
                    if resp.status != 503:  # refused for good: a try again is the same
                        raise LinkDown(f"stage link: {path[len(PATH) :]} refused "
                                       f"({resp.status}: {text[:200]})")  # fmt: skip
                    why = text[:200]
                except (OSError, http.client.HTTPException) as e:
                    conn.close()
                    if reused and time.monotonic() < deadline:
                        # A kept connection the consumer closed meanwhile:
                        # so are the others, likely; a new one next.
                        self.close()
                        continue
                    with self.lock:
                        self.address = None  # it may have started again elsewhere
                    why = f"{type(e).__name__}: {e}"
            if time.monotonic() + pause > deadline:
                raise LinkDown(f"stage link: {path[len(PATH) :]} not taken in "
                               f"{self.timeout:g} s ({why})")  # fmt: skip
            time.sleep(pause)
            pause = min(pause * 2, RETRY_S[1])

    def fetch(self, path: str) -> str | None:
        """GET `path` from the consumer, one try within LISTING_S (a kept
        connection that failed aside); None if it cannot be had."""
        deadline = time.monotonic() + LISTING_S
        for _ in range(2):
            conn, reused = self._connection(deadline)
            if conn is None:
                return None
            try:
                conn.request("GET", path)
                resp = conn.getresponse()
                text = resp.read(MAX_LISTING).decode(errors="replace")
                if resp.status != 200:
                    conn.close()
                    return None
                self._keep(conn, resp)
                return text
            except (OSError, http.client.HTTPException):
                conn.close()
                if not reused or time.monotonic() >= deadline:
                    return None
                self.close()  # the kept ones are as stale: a new one next
        return None

    def _connection(self, deadline: float) -> tuple[http.client.HTTPConnection | None, bool]:
        """A kept connection (True), a new one (False), or (None, False)
        while the consumer's address is not known; its socket's every wait
        within REQUEST_S and the caller's `deadline`."""
        timeout = max(0.01, min(REQUEST_S, deadline - time.monotonic()))
        with self.lock:
            if self.idle:
                conn = self.idle.pop()
                conn.timeout = timeout
                if conn.sock is not None:
                    conn.sock.settimeout(timeout)
                return conn, True
            address = self.address
        if address is None:
            address = self.resolve()
            if address is None:
                return None, False
            with self.lock:
                self.address = address
        return http.client.HTTPConnection(*address, timeout=timeout), False

    def _keep(self, conn: http.client.HTTPConnection, resp) -> None:
        with self.lock:
            if resp.will_close or not resp.isclosed() or len(self.idle) >= POOL:
                conn.close()
            else:
                self.idle.append(conn)

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()
