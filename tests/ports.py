"""A free local TCP port, for tests that start a server or a process group."""

import socket


def free_port() -> int:
    """A port nothing listens on now (the OS's pick; another process could
    take it before the caller binds, which tests accept)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
