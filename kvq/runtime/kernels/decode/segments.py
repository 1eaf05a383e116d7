"""What decode attention reads: a layer's cached rows as `Segment`s (packed rows, their
RoPE positions) sharing one softmax, the RoPE tables, and the checks both backends run."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.runtime.packed import (
    PackedRows,
)

Rope = tuple[Tensor, Tensor]  # cos, sin tables [P, D/2] float32, indexed by RoPE position


@dataclass(frozen=True)
class Segment:
    key: PackedRows
    value: PackedRows
    positions: Tensor | None = None  # [B, T] RoPE position of each row (pre-RoPE keys)

    @property
    def rows(self) -> int:
        return self.key.rows


def rotate(x: Tensor, positions: Tensor, rope: Rope, out: Tensor | None = None) -> Tensor:
    """Rotate-half RoPE of x [B, H, T, D] at positions [B, T] with half-width tables,
    into `out` (another [B, H, T, D] float buffer, not x) when given."""
    first = run_start(positions, rope[0].shape[0])  # one check for both tables
    cos, sin = (_rows_at(t, positions, first)[:, None] for t in rope)  # [B, 1, T, D/2]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x) if out is None else out
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)  # no temporaries
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    return out


def _rows_at(table: Tensor, positions: Tensor, first: int | None) -> Tensor:
    """table[positions] ([B, T, ...]); a view when every batch row is the contiguous run
    from `first` (`run_start`), None when not."""
    if first is None:
        return table[positions]
    t = positions.shape[1]
    return table[first : first + t].expand(positions.shape[0], t, *table.shape[1:])


def run_start(positions: Tensor, limit: int) -> int | None:
    """First position when every batch row of positions [B, T] is the run first, first + 1,
    ... below `limit`; else None."""
    first = int(positions[0, 0])
    t = positions.shape[1]
    run = torch.arange(first, first + t, device=positions.device)
    return first if first + t <= limit and bool((positions == run).all()) else None


def check_inputs(
    query: Tensor, segments: list[Segment], rope: Rope | None, mask: Tensor | None
) -> int:
    if query.dim() != 4:
        raise KvqError(f"query must be [B, H_q, Q, D], got {tuple(query.shape)}")
    if not segments:
        raise KvqError("attention over no segments")
    total = sum(s.rows for s in segments)
    for s in segments:
        if s.key.pre_rope and (rope is None or s.positions is None):
            raise KvqError("pre-RoPE keys need RoPE tables and row positions")
    if mask is not None and mask.shape[-1] != total:
        raise KvqError(f"mask covers {mask.shape[-1]} keys, the segments hold {total}")
    return total


def causal_mask(q_len: int, total: int, device) -> Tensor:
    q_pos = torch.arange(total - q_len, total, device=device)
    return (torch.arange(total, device=device)[None, :] <= q_pos[:, None])[None, None]
