"""One error type for everything a user can get wrong.

The CLI turns a `KvqError` into a one-line message and exit code 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations


class KvqError(Exception):
    """A user-facing error: bad input, an incompatible artifact, a missing file."""


class IncompatibleArtifact(KvqError):
    """An artifact that does not match the model, schema or its own tensors.

    The message always names the field, the expected value and the found value.
    """

    def __init__(self, field: str, expected: object, found: object, hint: str = ""):
        self.field, self.expected, self.found = field, expected, found
        msg = f"incompatible artifact: {field}: expected {expected!r}, found {found!r}"
        super().__init__(msg + (f" ({hint})" if hint else ""))
