"""The direct link between a group's stages (`rollout/stagelink.py`): the
mailbox's order and bounds, what its server refuses, signatures against the
run's keyring, and a consumer out of reach."""

from __future__ import annotations

import http.client
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade.protocol import keys
from colonnade.protocol.documents import StageAddress, open_stage_address, seal_stage_address
from colonnade.protocol.inbox import scan
from colonnade.protocol.signing import SignatureRejected
from colonnade.protocol.stages import MAX_STAGE_BYTES
from colonnade.rollout.pipeline import StageTimeout
from colonnade.rollout.stagelink import (
    PATH,
    Keyring,
    LinkDown,
    Mailbox,
    Refused,
    StageLink,
)
from colonnade.store import InvalidKey, LocalStore, NotFound, StoreError
from colonnade.untrusted import SchemaError, host_port


def _key(batch: int, stream: int, seq: int, worker: str = "a") -> str:
    return keys.stage_key(worker, batch, stream, seq)


def _refused(status: int, fn, *args) -> None:
    with pytest.raises(Refused) as e:
        fn(*args)
    assert e.value.status == status, e.value


def test_a_stream_keeps_its_newest_step_and_the_mailbox_its_newest_batch():
    box = Mailbox("a")
    box.put(_key(5, 0, 0), b"s0")
    box.put(_key(5, 1, 0), b"t0")
    box.put(_key(5, 0, 1), b"s1")  # step 0 of stream 0 was read before 1 was sent
    assert box.list() == [_key(5, 0, 1), _key(5, 1, 0)]
    with pytest.raises(NotFound):
        box.get(_key(5, 0, 0))
    _refused(409, box.put, _key(5, 0, 0), b"late")
    box.put(_key(5, 0, 1), b"s1 again")  # a put tried again replaces its message
    assert box.get(_key(5, 0, 1)) == b"s1 again"
    box.put(_key(6, 1, 0), b"next batch")
    assert box.list() == [_key(6, 1, 0)] and box.bytes == len(b"next batch")
    _refused(409, box.put, _key(5, 1, 1), b"an older batch")
    assert box.list(keys.stage_dir("a")) == [_key(6, 1, 0)] and box.list("b/") == []


def test_the_mailbox_takes_its_producers_messages_only():
    box = Mailbox("a")
    _refused(403, box.put, _key(1, 0, 0, worker="b"), b"x")
    _refused(400, box.put, "a/heartbeat.json", b"x")
    _refused(400, box.put, "a/stages/../../x", b"x")
    assert box.list() == []


def test_messages_not_yet_read_hold_a_sender_back_and_read_ones_make_room():
    box = Mailbox("a", max_messages=2, max_bytes=10)
    box.put(_key(1, 0, 0), b"1234")
    box.put(_key(1, 1, 0), b"1234")
    _refused(503, box.put, _key(1, 2, 0), b"12")  # two held, neither read
    box.get(_key(1, 0, 0))
    box.put(_key(1, 2, 0), b"12")  # the read one goes
    assert box.list() == [_key(1, 1, 0), _key(1, 2, 0)]
    _refused(503, box.put, _key(1, 1, 1), b"12345678901")  # more bytes than the bound
    box.put(_key(1, 1, 1), b"12345678")  # its own stream's older step makes room
    assert box.bytes == 10


def _keypair():
    private = Ed25519PrivateKey.generate()
    return private, private.public_key()


def _pair(tmp_path, keyring=None, privates=(None, None), timeout=5.0, **kw):
    """Two stages' links over one inbox: a (stage 1) sends to b (stage 2) and b back to a."""
    inbox = LocalStore(tmp_path / "inbox")
    common = dict(run_id="r", group="g", inbox=inbox, keyring=keyring, listen="127.0.0.1:0",
                  timeout=timeout, **kw)  # fmt: skip
    a = StageLink("a", "b", "b", private=privates[0], **common)
    b = StageLink("b", "a", "a", private=privates[1], **common)
    return a, b, inbox


def test_messages_go_both_ways_and_land_in_the_readers_mailbox(tmp_path):
    a, b, inbox = _pair(tmp_path)
    try:
        a.put(_key(3, 0, 0), b"step")
        b.put(_key(3, 0, 0, worker="b"), b"reply")
        assert b.list(keys.stage_dir("a")) == [_key(3, 0, 0)] and b.get(_key(3, 0, 0)) == b"step"
        assert a.get(_key(3, 0, 0, worker="b"), max_bytes=5) == b"reply"
        a.delete(_key(3, 0, 0))  # nothing: the reader's mailbox drops it in turn
        assert b.list() == [_key(3, 0, 0)]
        with pytest.raises(InvalidKey):
            a.put(_key(3, 0, 1, worker="b"), b"not a's")
        # Where each listens is in the inbox, and it is no junk there.
        key = keys.stage_link_key("b")
        assert keys.inbox_owner(key) == "b" and scan({key: 1.0}, {"b"}).junk == []
        doc = open_stage_address(inbox.get(key), key, "r", None)
        assert doc.address == b.address and doc.group == "g"
        # Many messages over the kept connections, from threads at once.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda s: a.put(_key(4, s, 0), b"x" * 1000), range(32)))
        assert len(b.list()) == 32
    finally:
        a.close()
        b.close()


def test_a_stage_that_restarts_lists_its_messages_its_consumer_holds(tmp_path):
    # What a first stage numbers its batches above (Front._first_batch), as
    # it would see its own messages in the store.
    a, b, inbox = _pair(tmp_path)
    a.put(_key(500, 0, 3), b"step")
    a.close()
    again = StageLink("a", "b", "b", run_id="r", group="g", inbox=inbox, listen="127.0.0.1:0")
    try:
        assert again.list(keys.stage_dir("a")) == [_key(500, 0, 3)]
        assert again.list(keys.stage_dir("b")) == []  # b's messages to a: none held here
        b.close()
        t0 = time.monotonic()
        assert again.list(keys.stage_dir("a")) == []  # out of reach: nothing, at once
        assert time.monotonic() - t0 < 6
    finally:
        again.close()


def _raw_put(link: StageLink, key: str, body: bytes, headers=None) -> int:
    host, port = host_port(link.address)
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("PUT", PATH + key, body=body, headers=headers or {})
        return conn.getresponse().status
    finally:
        conn.close()


def test_the_server_refuses_strangers_keys_and_oversized_bodies(tmp_path):
    a, b, _ = _pair(tmp_path)
    try:
        assert _raw_put(b, _key(1, 0, 0, worker="c"), b"x") == 403
        assert _raw_put(b, "a/heartbeat.json", b"x") == 400
        assert _raw_put(b, _key(1, 0, 0), b"x") == 200
        # A body declared too long is refused before a byte of it is read.
        host, port = host_port(b.address)
        conn = http.client.HTTPConnection(host, port, timeout=5)
        conn.putrequest("PUT", PATH + _key(1, 1, 0))
        conn.putheader("Content-Length", str(MAX_STAGE_BYTES + 1))
        conn.endheaders()
        assert conn.getresponse().status == 413
        conn.close()
        assert b.list() == [_key(1, 0, 0)]
    finally:
        a.close()
        b.close()


def test_bodies_in_reading_are_bounded_as_the_mailbox_is(tmp_path):
    a, b, _ = _pair(tmp_path, max_bytes=10)
    try:
        b.reading = 8  # another connection's body, being read
        assert _raw_put(b, _key(1, 0, 0), b"12345") == 503  # unread: try again
        b.reading = 0
        assert _raw_put(b, _key(1, 0, 0), b"12345") == 200
        assert b.reading == 0 and b.list() == [_key(1, 0, 0)]
    finally:
        a.close()
        b.close()


def test_a_signed_run_takes_only_the_producers_registered_key(tmp_path):
    (pa, ka), (pb, kb), (stranger, _) = _keypair(), _keypair(), _keypair()
    ring = Keyring(lambda: {"a": ka, "b": kb})
    a, b, inbox = _pair(tmp_path, ring, privates=(pa, pb))
    try:
        a.put(_key(1, 0, 0), b"signed")
        assert b.get(_key(1, 0, 0)) == b"signed"
        assert _raw_put(b, _key(1, 1, 0), b"unsigned") == 403
        forged = StageLink("a", "b", "b", run_id="r", group="g", inbox=LocalStore(tmp_path / "x"),
                           private=stranger, listen="127.0.0.1:0", timeout=1)  # fmt: skip
        forged.dialer.address = host_port(b.address)
        with pytest.raises(LinkDown, match="403"):
            forged.put(_key(1, 2, 0), b"forged")
        forged.close()
        assert b.list() == [_key(1, 0, 0)]
        # An address in a signed run is its stage's own, signed.
        key = keys.stage_link_key("b")
        assert open_stage_address(inbox.get(key), key, "r", {"b": kb}).address == b.address
        with pytest.raises(SignatureRejected):
            open_stage_address(inbox.get(key), key, "r", {"b": ka})
        fake = seal_stage_address(None, "r", key, StageAddress("b", "g", "10.0.0.9:1", 0.0))
        with pytest.raises(SignatureRejected):
            open_stage_address(fake, key, "r", {"b": kb})
        other = keys.stage_link_key("c")  # b's address written under c's key
        moved = seal_stage_address(None, "r", other, StageAddress("b", "g", "10.0.0.9:1", 0.0))
        with pytest.raises(SchemaError, match="address of"):
            open_stage_address(moved, other, "r", None)
    finally:
        a.close()
        b.close()


def test_a_key_registered_later_is_read_again(tmp_path):
    (pa, ka), (pb, kb) = _keypair(), _keypair()
    registered = {"b": kb}
    reads = []

    def read():
        reads.append(1)
        return dict(registered)

    a, b, _ = _pair(tmp_path, Keyring(lambda: dict(registered)), privates=(pa, pb))
    # The consumer's own keyring, read once before "a" was registered: only
    # its miss on a's message can read it again.
    b.keyring = Keyring(read)
    b.keyring.current(fresh=True)
    try:
        registered["a"] = ka
        b.keyring.at = time.monotonic() - 60  # the last read is old enough
        a.put(_key(1, 0, 0), b"now registered")
        assert b.list() == [_key(1, 0, 0)] and len(reads) == 2
        # Within KEYRING_EVERY_S of a read, a miss does not read again.
        registered.pop("a")
        b.keyring.at = -float("inf")
        b.keyring.current(fresh=True)
        assert len(reads) == 3
        registered["a"] = ka
        with pytest.raises(LinkDown, match="403"):
            a.put(_key(1, 1, 0), b"too soon")
        assert len(reads) == 3
    finally:
        a.close()
        b.close()


def test_a_consumer_out_of_reach_raises_within_the_timeout(tmp_path):
    a, b, inbox = _pair(tmp_path, timeout=1.0)
    b.close()  # its address stays in the inbox; nothing listens there
    try:
        t0 = time.monotonic()
        with pytest.raises(LinkDown, match="not taken") as e:
            a.put(_key(1, 0, 0), b"x")
        assert time.monotonic() - t0 < 5
        # The front gives its batch up; a later stage logs a store error.
        assert isinstance(e.value, StageTimeout) and isinstance(e.value, StoreError)
        # No address at all (a consumer not started yet): the same.
        inbox.delete(keys.stage_link_key("b"))
        a.dialer.address = None
        with pytest.raises(LinkDown, match="no address"):
            a.put(_key(1, 0, 1), b"x")
    finally:
        a.close()


def test_an_address_of_another_group_is_not_dialled(tmp_path):
    inbox = LocalStore(tmp_path)
    key = keys.stage_link_key("b")
    inbox.put(key, seal_stage_address(None, "r", key, StageAddress("b", "other", "h:1", 0.0)))
    a = StageLink("a", "b", "b", run_id="r", group="g", inbox=inbox, listen="127.0.0.1:0",
                  timeout=0.3)  # fmt: skip
    try:
        with pytest.raises(LinkDown, match="no address"):
            a.put(_key(1, 0, 0), b"x")
    finally:
        a.close()


@pytest.mark.parametrize("text", ["h", "h:0", "h:65536", "h:1x", ":1", "a b:1", "[::1:1", 7])
def test_a_bad_address_is_refused(text):
    with pytest.raises(ValueError):
        host_port(text)
    assert host_port("0.0.0.0:0", any_port=True) == ("0.0.0.0", 0)
    assert host_port("[::1]:9") == ("::1", 9)


def test_a_length_that_is_not_plain_digits_is_refused(tmp_path):
    a, b, _ = _pair(tmp_path)
    try:
        for length in ("\u00b2", "9" * 5000, "-1", "0x10"):
            host, port = host_port(b.address)
            conn = http.client.HTTPConnection(host, port, timeout=5)
            conn.putrequest("PUT", PATH + _key(1, 0, 0))
            conn.putheader("Content-Length", length.encode("latin-1"))
            conn.endheaders()
            assert conn.getresponse().status == 413, length
            conn.close()
        assert b.list() == [] and b.reading == 0
    finally:
        a.close()
        b.close()


def test_a_trickled_body_gives_its_room_back_at_its_deadline(tmp_path, monkeypatch):
    import socket

    from colonnade.rollout import stagelink

    monkeypatch.setattr(stagelink, "BODY_S", 0.5)
    a, b, _ = _pair(tmp_path)
    try:
        sock = socket.create_connection(host_port(b.address), timeout=5)
        head = f"PUT {PATH}{_key(1, 0, 0)} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
        sock.sendall(head.encode() + b"x")
        t0 = time.monotonic()
        while b.reading and time.monotonic() - t0 < 5:
            sock.sendall(b"x")  # a byte every 0.1 s: never idle, never done
            time.sleep(0.1)
        assert b.reading == 0 and time.monotonic() - t0 < 3
        sock.close()
        assert b.list() == []
    finally:
        a.close()
        b.close()


def test_a_consumer_that_never_answers_costs_a_put_its_timeout(tmp_path):
    import socket

    a, b, _ = _pair(tmp_path, timeout=1.0)
    silent = socket.create_server(("127.0.0.1", 0))  # takes connections, answers nothing
    try:
        a.dialer.address = silent.getsockname()[:2]
        a.dialer.resolve = lambda: silent.getsockname()[:2]
        t0 = time.monotonic()
        with pytest.raises(LinkDown):
            a.put(_key(1, 0, 0), b"step")
        assert time.monotonic() - t0 < 3
        t0 = time.monotonic()
        assert a.list(keys.stage_dir("a")) == []  # a listing's one try, bounded too
        assert time.monotonic() - t0 < 7
    finally:
        silent.close()
        a.close()
        b.close()
