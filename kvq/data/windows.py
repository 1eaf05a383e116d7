"""Fixed-length token windows drawn reproducibly from a text.

The text is tokenized once, cut into non-overlapping chunks, and `n` chunks are drawn with a
seeded torch.Generator. Each window starts with BOS when the tokenizer has one (chunks are then
seqlen - 1 tokens long), because models are trained and evaluated with BOS first and without
it the first positions behave as attention sinks in an untypical way.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from kvq.data.text import TextSource
from kvq.errors import KvqError


@dataclass(frozen=True)
class TokenWindows:
    """`n` windows of `seqlen` token ids, their fingerprint and provenance."""

    ids: torch.Tensor  # [N, L] int64
    fingerprint: str  # sha256 of ids as little-endian int64 bytes, row-major
    source: TextSource
    seed: int

    @property
    def n(self) -> int:
        return self.ids.shape[0]

    @property
    def seqlen(self) -> int:
        return self.ids.shape[1]


def ids_fingerprint(ids: torch.Tensor) -> str:
    """sha256 of a token id tensor as contiguous little-endian int64 bytes."""
    flat = ids.detach().to("cpu", torch.int64).contiguous().reshape(-1)
    return hashlib.sha256(flat.numpy().astype("<i8", copy=False).tobytes()).hexdigest()


def text_token_ids(tokenizer, text: str) -> list[int]:
    """The token ids of all of `text`, no special tokens. One call over the whole text:
    tokenizing pieces separately would change tokens at the seams and depend on how the
    text was split."""
    return tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]


def sample_windows(
    tokenizer, text: str, source: TextSource, n: int, seqlen: int, seed: int
) -> TokenWindows:
    """Draw `n` windows of `seqlen` tokens from `text`; same inputs -> same ids.

    Returns TokenWindows with ids [n, seqlen]; rows are ordered by their position in the text.
    """
    if n <= 0:
        raise KvqError(f"number of windows must be positive, got {n}")
    if seqlen < 2:
        raise KvqError(f"window length must be at least 2 tokens, got {seqlen}")
    bos = tokenizer.bos_token_id
    chunk = seqlen - 1 if bos is not None else seqlen
    ids = text_token_ids(tokenizer, text)
    available = len(ids) // chunk
    if available < n:
        raise KvqError(
            f"text {source.spec!r} has {len(ids)} tokens: only {available} windows of "
            f"{seqlen} tokens available, {n} requested"
        )
    stream = torch.tensor(ids[: available * chunk], dtype=torch.int64).view(available, chunk)
    gen = torch.Generator().manual_seed(seed)
    picked = torch.randperm(available, generator=gen)[:n].sort().values
    windows = stream[picked]  # [n, chunk]
    if bos is not None:
        windows = torch.cat((torch.full((n, 1), bos, dtype=torch.int64), windows), dim=1)
    return TokenWindows(ids=windows, fingerprint=ids_fingerprint(windows), source=source, seed=seed)
