"""Join strings: `colonnade invite` prints one, `colonnade worker --join` uses it.

What an invite holds comes from the run's signed run.json; it never holds a
secret; a bad string is refused in one line saying why; the worker pins the
key the string names and refuses a run.json signed by another.
"""

import base64
import json
import logging
import signal

import pytest

from colonnade.cli.main import main
from colonnade.config import WorkerConfig
from colonnade.operate.join import PREFIX, Invite, JoinError, apply_join, make_invite
from colonnade.protocol.signing import fingerprint, load_private, new_keypair, trusted_fingerprint
from colonnade.store import LocalStore

FP = "SHA256:" + "A" * 43


def _doc(text: str) -> dict:
    body = text.removeprefix(PREFIX)
    return json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))


def _string(doc: dict, prefix: str = PREFIX) -> str:
    raw = json.dumps(doc).encode()
    return prefix + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def test_an_invite_round_trips_and_wrapping_is_harmless():
    invite = Invite("s3://run-bucket/run1", FP, "rg:basic_arithmetic",
                    endpoint="https://acct.r2.cloudflarestorage.com",
                    inbox="s3://inbox-bucket/run1")  # fmt: skip
    text = invite.encode()
    assert text.startswith("colonnade1:") and text.isascii() and " " not in text
    assert Invite.decode(text) == invite
    wrapped = "  " + "\n".join(text[i : i + 30] for i in range(0, len(text), 30)) + "\n"
    assert Invite.decode(wrapped) == invite
    # Defaults are left out: the short form of a run without a second bucket.
    short = Invite("s3://b/r", FP, "smoke")
    assert set(_doc(short.encode())) == {"store", "trainer_key", "env"}
    assert Invite.decode(short.encode()) == short


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "not a join string"),
        ("s3://bucket/run1", "not a join string"),
        (_string({"store": "s3://b/r", "trainer_key": FP, "env": "smoke"}, "colonnade2:"),
         "format 2; this colonnade reads format 1"),
        (PREFIX + "eyJzdG9y!ZSI6", "not URL-safe base64"),
        (PREFIX + "eyJzdG9yZSI6", "cut short or altered"),
        (PREFIX + "x" * 5000, "more than 4096"),
        (_string({"store": "s3://b/r", "trainer_key": FP}), "missing field(s) env"),
        (_string({"store": "s3://b/r", "trainer_key": FP, "env": "smoke", "secret": "x"}),
         "unknown field(s) secret"),
        (_string({"store": "s3://b/r", "trainer_key": FP, "env": 3}), "must be strings"),
        (_string({"store": "s3://b/r", "trainer_key": "SHA256:short", "env": "smoke"}),
         "fingerprint"),
        (_string({"store": "s3://b/r", "trainer_key": FP, "env": "smoke; rm -rf"}),
         "no environment name"),
        (_string({"store": "s3://", "trainer_key": FP, "env": "smoke"}), "names a bucket"),
        (_string({"store": "gs://b/r", "trainer_key": FP, "env": "smoke"}), "s3://bucket"),
        (_string({"store": "s3://b/r", "trainer_key": FP, "env": "smoke",
                  "endpoint": "ftp://host"}), "http:// or https://"),
        # URLs that would carry a secret are refused on both sides.
        (_string({"store": "s3://b/r", "trainer_key": FP, "env": "smoke",
                  "endpoint": "https://AKIA:hunter2@minio.lan:9000"}), "may carry a secret"),
        (_string({"store": "s3://b/r?X-Amz-Signature=abc", "trainer_key": FP,
                  "env": "smoke"}), "may carry a secret"),
        ('{"store": "s3://b/r"}', "not a join string"),
    ],
)  # fmt: skip
def test_a_bad_join_string_is_refused_saying_why(text, says):
    with pytest.raises(JoinError) as e:
        Invite.decode(text)
    assert says in str(e.value)


def test_an_invite_with_a_secret_in_a_url_is_never_made():
    with pytest.raises(JoinError, match="may carry a secret"):
        Invite("s3://b/r", FP, "smoke", endpoint="https://user:pw@host").encode()


def test_invite_reads_the_signed_run_and_holds_no_secret(tmp_path, signed_run, capsys, monkeypatch):
    secrets = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEYID0001",
               "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMIsecretEXAMPLEKEY000",
               "AWS_SESSION_TOKEN": "FwoGZXIvYXdzEXAMPLEsessiontoken"}  # fmt: skip
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    store = LocalStore(tmp_path / "run")
    signer = signed_run(store, env="smoke", inbox="s3://inbox-bucket/run1",
                        inbox_endpoint_url="https://inbox.example")  # fmt: skip
    # The operator also has the trainer's key file at hand: only its public half is read.
    key_path, _ = new_keypair("trainer", tmp_path / "tkey")
    _, other = load_private(key_path)

    assert main(["invite", "--store", str(tmp_path / "run")]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 1 and "join string of the run" in err
    doc = _doc(lines[0])
    assert doc == {"store": str((tmp_path / "run").resolve()), "env": "smoke",
                   "trainer_key": fingerprint(signer.public), "inbox": "s3://inbox-bucket/run1",
                   "inbox_endpoint": "https://inbox.example"}  # fmt: skip
    private_hex = signer.private.private_bytes_raw().hex()
    for secret in (*secrets.values(), private_hex, other.private_bytes_raw().hex()):
        assert secret not in lines[0] and secret not in json.dumps(doc)
    # The trainer's key file is not run.json's signer: refused, in one line.
    assert main(["invite", "--store", str(tmp_path / "run"), "--key", str(key_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not the trusted" in err[0]


def test_invite_refuses_values_that_run_json_contradicts(tmp_path, signed_run, capsys):
    store = LocalStore(tmp_path / "run")
    signed_run(store, env="smoke")
    contradictions = [
        (["--env", "searchqa"], "--env searchqa but the run's run.json says smoke"),
        (["--inbox", "s3://x/y"], "--inbox s3://x/y but the run's run.json says none"),
    ]
    for flags, says in contradictions:
        assert main(["invite", "--store", str(tmp_path / "run"), *flags]) == 2
        assert says in capsys.readouterr().err


def test_invite_before_the_trainer_started_needs_its_key_and_env(tmp_path, capsys):
    _, pub = new_keypair("trainer", tmp_path / "tkey")
    run = str(tmp_path / "run")
    assert main(["invite", "--store", run, "--env", "smoke"]) == 2
    err = capsys.readouterr().err
    assert "no run.json" in err and "pass --key" in err
    assert not (tmp_path / "run").exists()  # nothing made: an invite only reads
    assert main(["invite", "--store", run, "--key", str(pub), "--env", "smoke"]) == 0
    invite = Invite.decode(capsys.readouterr().out)
    assert invite.trainer_key == trusted_fingerprint(str(pub)) and invite.env == "smoke"
    with pytest.raises(JoinError, match="--key"):
        make_invite(run, env="smoke")


def test_apply_join_fills_the_store_endpoint_and_pinned_key():
    invite = Invite("s3://run-bucket/run1", FP, "smoke", endpoint="https://r2.example")
    cfg = apply_join(WorkerConfig(join=invite.encode(), id="w1"))
    assert (cfg.store, cfg.endpoint_url, cfg.trust) == ("s3://run-bucket/run1",
                                                        "https://r2.example", FP)  # fmt: skip
    assert cfg.id == "w1" and apply_join(WorkerConfig(store="x")) == WorkerConfig(store="x")
    # An endpoint given beats the string's: the same store, reached another way.
    lan = apply_join(WorkerConfig(join=invite.encode(), endpoint_url="http://10.0.0.5:9000"))
    assert lan.endpoint_url == "http://10.0.0.5:9000" and lan.trust == FP
    # A store or a key given too must agree.
    same = apply_join(WorkerConfig(join=invite.encode(), store="s3://run-bucket/run1", trust=FP))
    assert same.store == "s3://run-bucket/run1"
    with pytest.raises(JoinError, match="--store s3://other/run"):
        apply_join(WorkerConfig(join=invite.encode(), store="s3://other/run"))
    with pytest.raises(JoinError, match="--trust names another key"):
        apply_join(WorkerConfig(join=invite.encode(), trust="SHA256:" + "B" * 43))


def test_a_worker_without_the_runs_plugin_says_so_at_once():
    join = Invite("s3://b/r", FP, "no_such_package_here.my_env").encode()
    with pytest.raises(JoinError, match=r"'no_such_package_here\.my_env' cannot be imported here"):
        apply_join(WorkerConfig(join=join))
    # Built-ins and families ship with colonnade; an importable module passes.
    for env in ("smoke", "rg:basic_arithmetic", "colonnade.envs.smoke"):
        apply_join(WorkerConfig(join=Invite("s3://b/r", FP, env).encode()))


def _worker(join: str) -> list[str]:
    return ["worker", "--join", join, "--id", "w1", "--join-timeout", "0.5",
            "--poll-seconds", "0.05", "--engine", "torch"]  # fmt: skip


@pytest.fixture
def keep_signals():
    """A worker run in-process installs its SIGINT/SIGTERM handlers: put pytest's back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_the_worker_pins_the_key_its_join_string_names(
    tmp_path, signed_run, capsys, caplog, keep_signals
):
    store = LocalStore(tmp_path / "run")
    # A model file the store lacks: a worker that accepts run.json waits for it.
    signer = signed_run(store, env="smoke", model_files={"config.json": "blake3:" + "0" * 64})
    _, pub = new_keypair("trainer", tmp_path / "tkey")  # another key than run.json's
    wrong = Invite(str(tmp_path / "run"), trusted_fingerprint(str(pub)), "smoke").encode()
    with caplog.at_level(logging.INFO):
        assert main(_worker(wrong)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no run.json signed by the trainer" in err[0]
    assert f"not the trusted {trusted_fingerprint(str(pub))}" in caplog.text
    assert "joining the run" in caplog.text
    # The right key: past run.json, to the model files this test run has none of.
    right = Invite(str(tmp_path / "run"), fingerprint(signer.public), "smoke").encode()
    caplog.clear()
    assert main(_worker(right)) == 2
    assert "model files" in capsys.readouterr().err
    assert "not the trusted" not in caplog.text


def test_a_bad_join_string_stops_the_worker_in_one_line(capsys):
    assert main(["worker", "--join", "colonnade1:%%%", "--engine", "torch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: join string: not URL-safe base64")
