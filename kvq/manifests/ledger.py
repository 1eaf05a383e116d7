"""The byte ledger: where every byte of a quantized cache or artifact goes.

A ledger is *measured*, never estimated: the caller counts the bytes of the
buffers it actually holds and puts each byte in exactly one category, so that
`total` is the real footprint and `ratio` the real compression against fp16.

    codes           packed quantized payload (int/nuq indices, fp8 values)
    qparams         scales, offsets, codebooks stored next to the codes
    sparse          outliers kept aside in a sparse side structure
    sink            sink rows (each sequence's first real tokens) kept in full precision
    prefix          declared prefix rows (IntactKV / PrefixQuant) seeded before them
    residual        a KIVI-style recent window not yet quantized
    full_precision  whole layers (or rows) the policy leaves unquantized

`tokens` is the number of retained sequence positions the bytes cover. It is
not summed over layers: every layer of one cache holds the same positions, so a
whole-cache ledger (the sum of its layer ledgers) covers the same `tokens`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from kvq.errors import IncompatibleArtifact, KvqError

CATEGORIES = ("codes", "qparams", "sparse", "sink", "residual", "full_precision", "prefix")


@dataclass(frozen=True)
class ByteLedger:
    """Measured bytes per category, the positions they cover and their fp16 cost."""

    codes: int
    qparams: int
    sparse: int
    sink: int
    residual: int
    full_precision: int
    tokens: int  # retained sequence positions (not per layer, not summed over layers)
    fp16_bytes: int  # the same retained rows stored as fp16 K and V, from real lengths
    prefix: int = 0  # declared prefix rows (counted apart from the user's tokens)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            # bool is an int subclass; a True byte count is a bug, not a count.
            if type(value) is not int or value < 0:
                raise KvqError(f"ledger {f.name} must be a non-negative int, got {value!r}")

    @classmethod
    def zero(cls) -> ByteLedger:
        """The empty ledger: the identity of `+`."""
        return cls(**{f.name: 0 for f in fields(cls)})

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in CATEGORIES)

    @property
    def bytes_per_token(self) -> float:
        return self.total / self._positions()

    @property
    def fp16_bytes_per_token(self) -> float:
        return self.fp16_bytes / self._positions()

    @property
    def ratio(self) -> float:
        """Stored bytes over fp16 bytes: 0.25 means four times smaller."""
        if self.fp16_bytes == 0:
            raise KvqError("ledger has no fp16 reference bytes; ratio is undefined")
        return self.total / self.fp16_bytes

    def _positions(self) -> int:
        if self.tokens == 0:
            raise KvqError("ledger covers no tokens; per-token bytes are undefined")
        return self.tokens

    def __add__(self, other: ByteLedger) -> ByteLedger:
        """Sum two ledgers of the same positions, e.g. two layers of one cache.

        Bytes and fp16 bytes add up; `tokens` does not, because every layer
        covers the same positions. A ledger with zero tokens (say the static
        qparams of a calibrated scheme, which exist before any token) adds its
        bytes without changing the positions. Ledgers of different non-zero
        lengths describe different sequences and cannot be summed.
        """
        if not isinstance(other, ByteLedger):
            return NotImplemented
        if self.tokens and other.tokens and self.tokens != other.tokens:
            raise KvqError(
                f"cannot add ledgers covering {self.tokens} and {other.tokens} tokens: "
                "a sum is over layers of one sequence"
            )
        summed = {name: getattr(self, name) + getattr(other, name) for name in CATEGORIES}
        return ByteLedger(
            **summed,
            tokens=max(self.tokens, other.tokens),
            fp16_bytes=self.fp16_bytes + other.fp16_bytes,
        )

    def __radd__(self, other: object) -> ByteLedger:
        # Lets the builtin sum() start from its default 0.
        if other == 0:
            return self
        return NotImplemented

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> ByteLedger:
        """Exactly the fields of `ByteLedger`; anything else is refused by name."""
        names = [f.name for f in fields(cls)]
        for key in d:
            if key not in names:
                raise IncompatibleArtifact(f"ledger.{key}", "no such field", d[key])
        for name in names:
            if name not in d and name != "prefix":  # ledgers written before prefixes
                raise IncompatibleArtifact(f"ledger.{name}", "int", "missing")
        return cls(**d)
