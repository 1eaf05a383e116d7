"""One error type for everything a user can get wrong.

The CLI turns a `KvqError` into a one-line message and exit code 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

_MAX_SHOWN = 80  # characters of a found value shown in a message (10**30 digits stop here)


def shown(value: object) -> str:
    """repr(value), cut to a readable length: control characters come out escaped."""
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 1] + "…"


class KvqError(Exception):
    """A user-facing error: bad input, an incompatible artifact, a missing file."""


class CacheArgumentError(KvqError, ValueError):
    """A cache call's argument that transformers' own caches refuse with a ValueError
    (crop by a positive count): code written for their caches catches it here too."""


class FieldError(KvqError):
    """A well-typed value outside its allowed range: `field` must be `rule`, got `value`.

    Raised by the checks of the manifest dataclasses; the manifest decoder turns it into
    an `IncompatibleArtifact` whose field is the full path, e.g. "architecture.head_dim".
    """

    def __init__(self, field: str, rule: str, value: object):
        self.field, self.rule, self.value = field, rule, value
        super().__init__(f"{field} must be {rule}, got {shown(value)}")


def require(ok: bool, field: str, rule: str, value: object) -> None:
    """Raise `FieldError(field, rule, value)` unless `ok`."""
    if not ok:
        raise FieldError(field, rule, value)


class IncompatibleArtifact(KvqError):
    """An artifact that does not match the model, schema or its own tensors.

    The message always names the field, the expected value and the found value.
    """

    def __init__(self, field: str, expected: object, found: object, hint: str = ""):
        self.field, self.expected, self.found = field, expected, found
        msg = f"incompatible artifact: {field}: expected {shown(expected)}, found {shown(found)}"
        super().__init__(msg + (f" ({hint})" if hint else ""))
