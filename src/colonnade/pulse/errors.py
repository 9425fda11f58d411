"""The one error type the patch codec raises on bad input."""


class PatchError(ValueError):
    """A patch that cannot be applied: truncated, corrupted, wrong base, unknown format.

    The message always says which of these it is, so an operator can tell a
    flaky link (retry the download) from a protocol mismatch (upgrade).
    """
