"""Objects of any size: multipart uploads, ranged downloads, streamed files, and
what a writer killed mid-upload leaves behind (nothing a reader can see)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from colonnade.store import LocalStore, NotFound, ObjectTooLarge
from s3server import make_s3_store

PART = 5 << 20


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def small_parts(request, tmp_path):
    """A store whose multipart threshold is S3's smallest part."""
    if request.param == "local":
        return LocalStore(tmp_path / "store", multipart_bytes=PART)
    request.getfixturevalue("s3_env")
    return make_s3_store(request.getfixturevalue("seaweed"), multipart_bytes=PART)


def test_files_and_bytes_above_the_threshold_round_trip(small_parts, tmp_path):
    blob = os.urandom(2 * PART + 12345)  # three parts, the last a short one
    src = tmp_path / "src.bin"
    src.write_bytes(blob)
    small_parts.put_file("trainer/checkpoints/1/shard.safetensors", src)
    small_parts.put("weights/00000001/full.safetensors", blob)
    for key in ("trainer/checkpoints/1/shard.safetensors", "weights/00000001/full.safetensors"):
        assert small_parts.size(key) == len(blob)
        assert small_parts.get(key) == blob
        out = tmp_path / "down" / key.replace("/", "_")
        assert small_parts.get_file(key, out, max_bytes=len(blob)) == len(blob)
        assert out.read_bytes() == blob
    with pytest.raises(ObjectTooLarge):
        small_parts.get_file("weights/00000001/full.safetensors", tmp_path / "x", max_bytes=100)
    assert not (tmp_path / "x").exists()
    with pytest.raises(NotFound):
        small_parts.get_file("weights/missing", tmp_path / "y")
    assert not list((tmp_path / "down").glob(".tmp-*"))


def test_multipart_bytes_below_s3_minimum_is_refused(tmp_path):
    with pytest.raises(ValueError, match="multipart_bytes"):
        LocalStore(tmp_path, multipart_bytes=1 << 20)


UPLOADER = textwrap.dedent(
    """
    import io, sys, time
    sys.path.insert(0, {tests!r})
    from s3server import make_s3_store
    from colonnade.store import S3Store

    class Slow(io.RawIOBase):
        # 4 parts' worth of bytes, handed out slowly after the first part.
        def __init__(self, n): self.n, self.pos = n, 0
        def readable(self): return True
        def readinto(self, b):
            if self.pos >= self.n: return 0
            if self.pos >= {part}: time.sleep(0.5)
            k = min(len(b), self.n - self.pos, 1 << 20)
            b[:k] = bytes(k); self.pos += k
            return k

    store = S3Store({bucket!r}, {prefix!r}, endpoint_url={endpoint!r}, multipart_bytes={part})
    store.transfer.max_concurrency = 1
    print("uploading", flush=True)
    # Buffered: the transfer manager needs whole parts from each read.
    body = io.BufferedReader(Slow(4 * {part}), buffer_size={part})
    store.client.upload_fileobj(body, store.bucket, store._k("weights/big"), Config=store.transfer)
    print("finished", flush=True)
    """
)


@pytest.mark.s3
def test_a_kill_mid_upload_leaves_no_visible_object(seaweed, s3_env, tmp_path):
    store = make_s3_store(seaweed, multipart_bytes=PART)
    script = UPLOADER.format(
        tests=os.path.dirname(__file__).rsplit("/", 1)[0],
        part=PART,
        bucket=store.bucket,
        prefix=store.prefix,
        endpoint=store.endpoint_url,
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # until the upload has begun and holds at least one part
            uploads = store.client.list_multipart_uploads(
                Bucket=store.bucket, Prefix=store.prefix
            ).get("Uploads", [])
            if uploads:
                parts = store.client.list_parts(
                    Bucket=store.bucket, Key=uploads[0]["Key"], UploadId=uploads[0]["UploadId"]
                ).get("Parts", [])
                if parts:
                    break
            assert proc.poll() is None, "the uploader ended before it was killed"
            assert time.monotonic() < deadline, "no multipart upload with a part appeared"
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not store.exists("weights/big")
    assert store.list("weights/") == []
    assert store.clean_partial("weights/", before=time.time() + 1) == 1
    assert not store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix).get(
        "Uploads"
    )


def test_local_clean_partial_removes_only_old_temp_files(tmp_path):
    store = LocalStore(tmp_path / "s")
    store.put("trainer/checkpoints/1/a", b"x")
    stale = tmp_path / "s" / "trainer" / "checkpoints" / "1" / ".tmp-dead"
    stale.write_bytes(b"half")
    os.utime(stale, (time.time() - 100, time.time() - 100))
    fresh = tmp_path / "s" / "weights" / ".tmp-live"
    fresh.parent.mkdir(parents=True)
    fresh.write_bytes(b"writing")
    assert store.clean_partial("trainer/", before=time.time() - 10) == 1
    assert store.clean_partial("weights/", before=time.time() - 10) == 0
    assert not stale.exists() and fresh.exists() and store.get("trainer/checkpoints/1/a") == b"x"
