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
    # every sequence has all its slots (no later token can become a sink); kept on the host
    # so that a decode step does not wait on the device to learn it
    full: bool = False

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

    def _checked(self) -> SinkRows:
        """Self with `full` read from the device (once per change of the slots, not per step)."""
        return replace(self, full=bool((self.filled >= self.slots).all()))

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
            return self._checked(), taken
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
        return SinkRows(rows, pos, cols, filled)._checked(), taken

    def shifted(self, dropped: int) -> SinkRows:
        """After `dropped` columns left the front (sliding-window eviction)."""
        return replace(self, cols=self.cols - dropped) if dropped else self

    def cropped(self, columns: int) -> SinkRows:
        """After the mask shrank to `columns` columns: slots past the end empty again."""
        n = torch.arange(self.slots, device=self.cols.device)
        kept = ((n[None] < self.filled[:, None]) & (self.cols < columns)).sum(1)
        return replace(self, filled=kept)._checked()

    def selected(self, index: Tensor) -> SinkRows:
        """Batch rows picked by `index` (beam reorder, repeat, select; duplicates allowed)."""
        return SinkRows(
            rows={n: r.index_select(0, index) for n, r in self.rows.items()},
            positions=self.positions.index_select(0, index),
            cols=self.cols.index_select(0, index),
            filled=self.filled.index_select(0, index),
            full=self.full,  # picked rows of full sequences are full (else appends re-check)
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
    main_rows: int,
    residual_rows: int,
    phase: Tensor | None = None,
    encoded: Tensor | None = None,
    prefix: Tensor | None = None,
    sink_in_lead: bool = False,
) -> Tensor:
    """transformers' mask [B, 1, Q, C] over mask columns -> the mask over the kernel's rows.

    The kernel reads the sink slots first, then the main rows, then the residual window's
    exact rows (the last `residual_rows` columns). Main row j of sequence b sits at column
    lead - phase[b] + j (phase None: 0; columns before the lead are filler). Where main and
    the residual hold the same column (rows just encoded, kept exact for a rollback or for
    a padded batch's other sequences), `encoded` [B or 1, Q] says which copy each query
    sees: main rows below it, residual columns from its main column on.
    A sink slot takes its row's column; a main or residual row that is also a sink row (a
    padded sequence's sink sits past the lead) is hidden, so each token is seen once.
    prefix: [B, 1, Q, P] bool over the declared prefix rows, which the kernel reads before
    everything else and which hold no mask column (`PrefixRows.visible`); None: no prefix.
    sink_in_lead: the caller knows every sink slot holds a row in the lead columns
    (`KvqLayer.sink_in_lead`), so no slot is empty and none repeats a later row.
    """
    rows = _sink_main_residual(
        mask, sink, lead, main_rows, residual_rows, phase, encoded, sink_in_lead
    )
    if prefix is None:
        return rows
    return torch.cat([prefix.to(rows.device).expand(rows.shape[0], 1, -1, -1), rows], dim=-1)


def _sink_main_residual(
    mask, sink, lead, main_rows, residual_rows, phase, encoded, sink_in_lead
) -> Tensor:
    b, _, q, c = mask.shape
    dev = mask.device
    start = c - residual_rows  # column of the first residual row
    j = torch.arange(main_rows, device=dev)
    if phase is None:
        main = mask[..., lead : lead + main_rows]
        shift = torch.zeros(1, dtype=torch.long, device=dev)
    else:
        shift = phase.to(dev)
        col = lead - shift[:, None] + j[None]  # [B, M]
        at = col.clamp(0, c - 1)[:, None, None, :].expand(b, 1, q, main_rows)
        main = mask.gather(-1, at) & (col >= lead)[:, None, None, :]
    res = mask[..., start:]
    if encoded is not None:
        enc = encoded.to(dev)[:, None, :, None]  # [B or 1, 1, Q, 1]
        main = main & (j < enc)
        first_exact = lead - shift[:, None, None, None] + enc  # column seen exact from
        res = res & (torch.arange(start, c, device=dev) >= first_exact)
    if sink is None:
        return torch.cat([main, res], dim=-1)
    at = sink.cols.clamp(min=0)[:, None, None, :].expand(b, 1, q, sink.slots)
    if sink_in_lead:  # the common case, ~20 ops fewer: nothing to hide
        return torch.cat([mask.gather(-1, at), main, res], dim=-1)
    valid = sink.valid()  # [B, N]
    head = mask.gather(-1, at) & valid[:, None, None, :]
    dup = valid & (sink.cols >= lead)  # [B, N] sink rows that main or the residual repeat
    main = main & ~_marked(dup, sink.cols - lead + shift[:, None], main_rows)[:, None, None]
    res = res & ~_marked(dup, sink.cols - start, residual_rows)[:, None, None]
    return torch.cat([head, main, res], dim=-1)


def _marked(which: Tensor, index: Tensor, n: int) -> Tensor:
    """[B, n] bool: True at index[b, s] where which[b, s] (indices outside [0, n) ignored);
    a scatter, so no device sync."""
    ok = which & (index >= 0) & (index < n)
    out = torch.zeros(which.shape[0], n + 1, dtype=torch.bool, device=which.device)
    out.scatter_(1, torch.where(ok, index, n), True)
    return out[:, :n]
