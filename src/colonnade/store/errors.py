"""Typed errors of the object store: what went wrong, on which store and key."""


class StoreError(Exception):
    """Base of every store failure."""


class NotFound(StoreError, KeyError):
    """The key does not exist."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "not found"


class InvalidObject(StoreError):
    """What lies under a key is not an object: a FIFO, socket, device or
    symlink in a local store, or a path that leads out of it."""


class ObjectTooLarge(StoreError):
    """An object exceeds the size bound of the read or write."""


class InvalidKey(StoreError, ValueError):
    """A key that is not a clean relative '/'-separated path."""


class BucketNotFound(StoreError):
    """The S3 bucket does not exist."""


class AccessDenied(StoreError):
    """Bad credentials, or the credentials may not do this."""


class StoreUnavailable(StoreError):
    """The store could not be reached within its retries and timeouts."""
