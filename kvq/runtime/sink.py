"""Sink rows: each sequence's first real tokens, kept exact (article 0x07E, 0x05).

The tokens that act as attention sinks are a sequence's first *real* tokens, not the
first columns of the batch: in a left-padded batch those are pad tokens. Each sequence
therefore owns N slots, filled in order as its real tokens arrive (the attention mask
says which rows are real), each remembering the mask column its row sits at.

Immutable like the row stores: every change returns a successor (the slots are a few
rows per sequence, so successors simply copy them), so the cache's append transaction
can discard a prepared successor without a trace.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor


@dataclass(frozen=True)
class SinkRows:
    rows: dict[str, Tensor]  # "k", "v": [B, H, N, D] exact rows (unfilled slots: zeros)
    positions: Tensor  # [B, N] int64 RoPE position of each slot's row
    cols: Tensor  # [B, N] int64 mask column of each slot's row (< 0 once evicted)
    filled: Tensor  # [B] int64 slots holding a row: real tokens seen so far, at most N

    @staticmethod
    def empty(batch: int, heads: int, slots: int, head_dim: int, dtype, device) -> SinkRows:
        zeros = torch.zeros((batch, heads, slots, head_dim), dtype=dtype, device=device)
        blank = torch.zeros((batch, slots), dtype=torch.long, device=device)
        return SinkRows(
            rows={"k": zeros, "v": zeros.clone()},
            positions=blank,
            cols=blank.clone(),
            filled=torch.zeros(batch, dtype=torch.long, device=device),
        )

    @property
    def slots(self) -> int:
        return self.cols.shape[1]

    @property
    def full(self) -> bool:
        """Every sequence has all its slots (no later token can become a sink)."""
        return bool((self.filled >= self.slots).all())

    def valid(self) -> Tensor:
        """[B, N] bool: slots holding a row that attention may still see."""
        n = torch.arange(self.slots, device=self.cols.device)
        return (n[None] < self.filled[:, None]) & (self.cols >= 0)

    def appended(
        self, key: Tensor, value: Tensor, positions: Tensor, real: Tensor, first_col: int
    ) -> tuple[SinkRows, Tensor]:
        """Successor with the new real rows that are among their sequence's first N.

        key, value: [B, H, T, D]; positions: [B, T]; real: [B, T] bool (not padding);
        first_col: mask column of the first new row. Returns (successor, taken [B, T]).
        """
        ordinal = self.filled[:, None] + real.long().cumsum(1) - 1  # [B, T] slot of a real row
        taken = real & (ordinal < self.slots)
        if not bool(taken.any()):
            return self, taken
        b, t = taken.nonzero(as_tuple=True)
        slot = ordinal[b, t]
        rows = {}
        for name, x in (("k", key), ("v", value)):
            r = self.rows[name].clone()
            r[b, :, slot] = x[b, :, t].to(r.dtype)
            rows[name] = r
        pos, cols = self.positions.clone(), self.cols.clone()
        pos[b, slot] = positions[b, t]
        cols[b, slot] = first_col + t
        filled = (self.filled + real.long().sum(1)).clamp(max=self.slots)
        return SinkRows(rows, pos, cols, filled), taken

    def shifted(self, dropped: int) -> SinkRows:
        """After `dropped` columns left the front (sliding-window eviction)."""
        return replace(self, cols=self.cols - dropped) if dropped else self

    def cropped(self, columns: int) -> SinkRows:
        """After the mask shrank to `columns` columns: slots past the end empty again."""
        n = torch.arange(self.slots, device=self.cols.device)
        kept = ((n[None] < self.filled[:, None]) & (self.cols < columns)).sum(1)
        return replace(self, filled=kept)

    def selected(self, index: Tensor) -> SinkRows:
        """Batch rows picked by `index` (beam reorder, repeat, select; duplicates allowed)."""
        return SinkRows(
            rows={n: r.index_select(0, index) for n, r in self.rows.items()},
            positions=self.positions.index_select(0, index),
            cols=self.cols.index_select(0, index),
            filled=self.filled.index_select(0, index),
        )

    def nbytes(self) -> int:
        """Bytes of the rows held (filled slots), K and V."""
        held = int(self.filled.sum())
        return sum(held * r.shape[1] * r.shape[3] * r.element_size() for r in self.rows.values())

    def allocated_bytes(self) -> int:
        return sum(r.nbytes for r in self.rows.values())


def kernel_mask(
    mask: Tensor,
    sink: SinkRows | None,
    lead: int,
    main_rows: int = 0,
    settled: Tensor | None = None,
    prefix: Tensor | None = None,
) -> Tensor:
    """transformers' mask [B, 1, Q, C] over mask columns -> the mask over the kernel's rows.

    The kernel reads the sink slots first, then the main rows (columns lead ..), then the
    residual window: its settled rows (exact copies of main's last S rows) and the live
    rows. A sink slot takes its row's column; a main row that is also a sink row (a padded
    sequence's sink sits past the lead) is hidden, so each token is seen exactly once.
    settled: [Q, S] bool, True where a query sees a settled row's encoded copy (else its
    exact one); None when nothing is settled.
    prefix: [B, 1, Q, P] bool over the declared prefix rows, which the kernel reads before
    everything else and which hold no mask column (`PrefixRows.visible`); None: no prefix.
    """
    rows = _sink_and_main(mask, sink, lead, main_rows, settled)
    if prefix is None:
        return rows
    return torch.cat([prefix.to(rows.device).expand(rows.shape[0], 1, -1, -1), rows], dim=-1)


def _sink_and_main(mask, sink, lead, main_rows, settled) -> Tensor:
    main = mask[..., lead:]
    if settled is not None:
        s = settled.shape[1]
        split = main_rows - s
        enc, exact = settled.to(mask.device)[None, None], main[..., split:main_rows]
        main = torch.cat(
            [main[..., :split], exact & enc, exact & ~enc, main[..., main_rows:]], dim=-1
        )
    if sink is None:
        return main
    b, _, q, _ = mask.shape
    valid = sink.valid()  # [B, N]
    at = sink.cols.clamp(min=0)[:, None, None, :].expand(b, 1, q, sink.slots)
    head = mask.gather(-1, at) & valid[:, None, None, :]
    dup = valid & (sink.cols >= lead)
    if bool(dup.any()):
        main = main.clone()
        bi, si = dup.nonzero(as_tuple=True)
        col = sink.cols[bi, si] - lead
        if settled is not None:  # a settled row has two copies; live rows moved right by S
            s = settled.shape[1]
            both = (col >= main_rows - s) & (col < main_rows)
            main[bi[both], :, :, col[both]] = False
            col = torch.where(col >= main_rows - s, col + s, col)
        main[bi, :, :, col] = False
    return torch.cat([head, main], dim=-1)
