"""A tool service and its client: signed replies, their checks, retries and refusals."""

import json
import socket
import urllib.error
import urllib.parse
import urllib.request

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade.tools.client import Retry, ToolClient, ToolFailed
from colonnade.tools.service import ToolService
from colonnade.tools.signed import Call, Reply, ReplyRejected, key_hex, public_key, sign_reply
from colonnade.untrusted import SchemaError

ROW = "ab" * 32
FAST = Retry(tries=3, timeout=2.0, first_wait=0.01, max_wait=0.02)


@pytest.fixture
def service():
    answers = []

    def answer(query: str):
        answers.append(query)
        if query == "boom":
            raise RuntimeError("the index is gone")
        return [f"doc about {query}", len(answers)]

    svc = ToolService(answer, Ed25519PrivateKey.generate()).start()
    svc.answers = answers
    yield svc
    svc.close()


def _call(query="velorin", turn=1, row=ROW):
    return Call("run1", "q3-drug", row, turn, query)


def test_a_reply_verifies_for_its_call_and_result_and_nothing_else():
    private = Ed25519PrivateKey.generate()
    reply = sign_reply(private, _call(), ["doc 1", {"score": 1.5}])
    reply.verify(private.public_key())
    back = Reply.from_dict(json.loads(json.dumps(reply.to_dict())))  # through the wire
    back.verify(private.public_key())
    altered = Reply(reply.call, ["doc 1 (the answer is kavemab)", {"score": 1.5}], reply.signature)
    elsewhere = [_call(row="cd" * 32), _call(turn=2), Call("run2", "q3-drug", ROW, 1, "velorin")]
    moved = [Reply(c, reply.result, reply.signature) for c in elsewhere]
    for bad in [altered, *moved]:
        with pytest.raises(ReplyRejected, match="not signed"):
            bad.verify(private.public_key())
    with pytest.raises(ReplyRejected):
        reply.verify(Ed25519PrivateKey.generate().public_key())


@pytest.mark.parametrize(
    "doc",
    [
        {"call": {}, "result": 1, "signature": "00" * 64},
        {"call": _call().to_dict(), "result": 1, "signature": "zz" * 64},
        {"call": {**_call().to_dict(), "row": "AB" * 32}, "result": 1, "signature": "00" * 64},
        {"call": {**_call().to_dict(), "turn": -1}, "result": 1, "signature": "00" * 64},
        {"call": {**_call().to_dict(), "query": "x" * 5000}, "result": 1, "signature": "00" * 64},
        {"call": _call().to_dict(), "result": "x" * (70 << 10), "signature": "00" * 64},
        {"call": _call().to_dict(), "result": [[[[[[[[[1]]]]]]]]], "signature": "00" * 64},
        {"call": _call().to_dict(), "result": float("nan"), "signature": "00" * 64},
        {"call": _call().to_dict(), "result": 1, "signature": "00" * 64, "extra": 1},
    ],
)
def test_replies_out_of_shape_or_bounds_are_schema_errors(doc):
    with pytest.raises(SchemaError):
        Reply.from_dict(doc)


def test_the_service_signs_what_it_answers_and_the_client_checks_it(service):
    client = ToolClient(service.url, public_key(service.public_hex), FAST)
    reply = client.call(_call())
    assert reply.result == ["doc about velorin", 1] and reply.call == _call()
    # The same call again: the same reply, though the tool would answer anew.
    assert client.call(_call()) == reply and service.answers == ["velorin"]
    assert client.call(_call(turn=2)).result == ["doc about velorin", 2]
    with urllib.request.urlopen(service.url + "/v1/key", timeout=5) as r:
        assert json.loads(r.read()) == {"public_key": service.public_hex}
    with urllib.request.urlopen(service.url + "/health", timeout=5) as r:
        assert json.loads(r.read()) == {"status": "ok", "calls": 3}


def test_a_client_pinning_another_key_takes_no_reply(service):
    other = key_hex(Ed25519PrivateKey.generate().public_key())
    client = ToolClient(service.url, public_key(other), FAST)
    with pytest.raises(ToolFailed) as e:
        client.call(_call())
    assert e.value.reason == "unverified" and client.retries == 0 and client.failures == 1


def test_a_tool_failure_is_retried_then_given_up(service):
    client = ToolClient(service.url, public_key(service.public_hex), FAST)
    with pytest.raises(ToolFailed) as e:
        client.call(_call("boom"))
    assert e.value.reason == "unavailable" and "HTTP 500" in str(e.value)
    assert service.answers == ["boom"] * 3 and client.retries == 2 and client.failures == 1


def test_a_call_the_service_refuses_is_not_retried(service):
    client = ToolClient(service.url, None, FAST)
    with pytest.raises(ToolFailed) as e:
        client.call(Call("run1", "t", ROW, 1, "x" * 5000))  # past the query bound
    assert e.value.reason == "refused" and "HTTP 400" in str(e.value) and client.retries == 0


def test_a_body_past_the_bound_or_without_a_length_is_refused_unread(service):
    from colonnade.tools.service import MAX_BODY_BYTES

    url = service.url + "/v1/call"
    big = urllib.request.Request(url, data=b"{" * (MAX_BODY_BYTES + 1), method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(big, timeout=5)
    assert e.value.code == 413 and "at most" in json.loads(e.value.read())["error"]
    where = urllib.parse.urlsplit(service.url)
    with socket.create_connection((where.hostname, where.port), timeout=5) as s:
        s.sendall(b"POST /v1/call HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        head = s.recv(4096).decode()
    assert head.startswith("HTTP/1.0 411") or head.startswith("HTTP/1.1 411"), head
    assert service.answers == []


def test_nobody_listening_is_unavailable_after_the_bounded_tries():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    waits = []
    client = ToolClient(f"http://127.0.0.1:{port}", None, Retry(tries=4, timeout=1.0,
                        first_wait=0.5, max_wait=1.0), sleep=waits.append)  # fmt: skip
    with pytest.raises(ToolFailed) as e:
        client.call(_call())
    assert e.value.reason == "unavailable" and waits == [0.5, 1.0, 1.0]


def test_a_service_key_is_64_hex_characters():
    with pytest.raises(ValueError, match="64 lowercase hex"):
        public_key("SHA256:abc")


@pytest.mark.procs
def test_colonnade_tools_serve_answers_signed_as_it_says(tmp_path):
    from colonnade.protocol.signing import new_keypair
    from toolproc import ServiceProcess

    key, _ = new_keypair("tools", tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with ServiceProcess("served_env", ["max_turns=2"], key, port) as svc:
        assert svc.url == f"http://127.0.0.1:{port}"
        client = ToolClient(svc.url, public_key(svc.key), FAST)
        assert client.call(_call("banana")).result == {"length": 6, "vowels": 3}


def test_colonnade_tools_serve_refuses_bad_input_in_one_line(tmp_path, capsys):
    from colonnade.cli.main import main

    assert main(["tools", "serve", "--env", "smoke", "--key", str(tmp_path / "none.key")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    args = ["tools", "serve", "--env", "searchqa", "--env-arg", "service=http://x", "--key", "k"]
    assert main(args) == 2
    assert "answers its tool itself" in capsys.readouterr().err


def test_a_service_that_answers_garbage_or_hangs_up_is_unavailable():
    import threading

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]

        def serve(answers):
            for answer in answers:
                conn, _ = srv.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(answer)

        answers = [b"garbage\r\n\r\n", b"", b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"]
        threading.Thread(target=serve, args=(answers,), daemon=True).start()
        client = ToolClient(f"http://127.0.0.1:{port}", None, Retry(tries=3, timeout=2.0,
                            first_wait=0.01))  # fmt: skip
        with pytest.raises(ToolFailed) as e:
            client.call(_call())
    assert e.value.reason == "unavailable" and client.retries == 2


def test_a_rehearsed_latency_picks_the_same_slow_calls_at_its_share():
    from colonnade.tools.service import Latency

    lat = Latency(0.2, 2.0, 0.25)
    waits = [lat.of(_call(f"q{i}")) for i in range(800)]
    assert set(waits) == {0.2, 2.0}
    assert 0.19 < waits.count(2.0) / len(waits) < 0.31
    assert waits == [lat.of(_call(f"q{i}")) for i in range(800)]  # a call asked again waits alike
    assert Latency(0.2).of(_call()) == 0.2 and Latency().of(_call()) == 0.0
    for bad in [(-0.1, 0, 0), (0, -1, 0.5), (0, 1, 1.5)]:
        with pytest.raises(ValueError):
            Latency(*bad)


def test_a_slow_service_waits_before_it_replies():
    import time

    from colonnade.tools.service import Latency

    svc = ToolService(lambda q: q, Ed25519PrivateKey.generate(), latency=Latency(0.3)).start()
    try:
        client = ToolClient(svc.url, public_key(svc.public_hex), FAST)
        t = time.monotonic()
        assert client.call(_call("slow")).result == "slow"
        assert time.monotonic() - t >= 0.3
    finally:
        svc.close()


@pytest.mark.parametrize("flags", [["--latency-ms", "-5"], ["--tail-share", "1.5"],
                                   ["--tail-ms", "-1", "--tail-share", "0.1"]])  # fmt: skip
def test_colonnade_tools_serve_refuses_a_latency_out_of_range(tmp_path, capsys, flags):
    from colonnade.cli.main import main
    from colonnade.protocol.signing import new_keypair

    key, _ = new_keypair("tools", tmp_path)
    assert main(["tools", "serve", "--env", "smoke", "--key", str(key), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --latency-ms") and err.count("\n") == 1


def test_a_worker_s_calls_out_at_once_are_all_answered_first_time():
    """64 calls connect together (a worker's pool): none is reset by a short
    listen backlog, so none waits out a retry."""
    from concurrent.futures import ThreadPoolExecutor

    from colonnade.tools.service import Latency

    svc = ToolService(lambda q: q, Ed25519PrivateKey.generate(), latency=Latency(0.2)).start()
    try:
        client = ToolClient(svc.url, public_key(svc.public_hex), Retry(tries=1, timeout=10.0))
        with ThreadPoolExecutor(64) as pool:
            replies = list(pool.map(lambda i: client.call(_call(f"q{i}")), range(64)))
        assert [r.result for r in replies] == [f"q{i}" for i in range(64)]
        assert client.retries == 0 and svc.calls == 64
    finally:
        svc.close()
