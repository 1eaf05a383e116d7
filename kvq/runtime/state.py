"""Row storage with prepare/publish semantics (article 0x05D, 0x0CA).

Forks (`QuantizedKVCache.fork`) share snapshots: a store marked `shared` never writes
into its buffers again, so each side's next append copies (copy on write).

A `RowStore` is an immutable snapshot: named buffers `[B, H, capacity, ...]`
and a committed length. Readers only ever look at rows `[:length]`.

`RowStore.prepared(rows)` builds the successor snapshot. When capacity allows
it writes the new rows *beyond* the committed frontier of the shared buffers,
which no reader of the predecessor can see; otherwise it copies into larger
buffers. Either way the predecessor stays valid and unchanged, so an aborted
transaction is dropped by simply forgetting its successor, and publication is
a single reference assignment per layer done by the cache once every layer is
prepared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

Rows = dict[str, Tensor]
RowSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (per-row shape, dtype)
Writer = Callable[[dict[str, Tensor], int], None]  # (buffers [B, H, cap, ...], start row)


@dataclass(frozen=True)
class RowStore:
    buffers: dict[str, Tensor]  # name -> [B, H, capacity, ...]
    length: int  # committed rows
    positions: Tensor | None  # [B, capacity] int64 RoPE position of each row
    shared: bool = False  # buffers also seen by a fork: the next append copies (see `fork`)

    @staticmethod
    def empty() -> RowStore:
        return RowStore(buffers={}, length=0, positions=None)

    def rows(self, start: int = 0, stop: int | None = None) -> Rows:
        """A view of committed rows [start, stop)."""
        stop = self.length if stop is None else stop
        return {name: buf[:, :, start:stop] for name, buf in self.buffers.items()}

    def row_positions(self, start: int = 0, stop: int | None = None) -> Tensor:
        stop = self.length if stop is None else stop
        assert self.positions is not None
        return self.positions[:, start:stop]

    def prepared(self, rows: Rows, positions: Tensor) -> RowStore:
        """Successor with `rows` (each [B, H, T, ...]) appended at positions [B, T]."""
        spec = {n: (tuple(r.shape[3:]), r.dtype) for n, r in rows.items()}
        first = next(iter(rows.values()))

        def copy(buffers: dict[str, Tensor], start: int) -> None:
            for name, r in rows.items():
                buffers[name][:, :, start : start + r.shape[2]] = r

        return self.prepared_into(spec, first.shape[:2], positions, copy)

    def prepared_into(
        self, spec: RowSpec, lead: tuple[int, int], positions: Tensor, write: Writer
    ) -> RowStore:
        """Successor with T = positions.shape[1] new rows that `write` stores in place.

        spec: the stored tensors' per-row shapes and dtypes; lead: (B, H). `write` gets the
        successor's buffers and the first new row and must fill rows [start, start + T) of
        every buffer (e.g. an append kernel writing codes and qparams into the pages).
        """
        t = positions.shape[1]
        need = self.length + t
        if self.buffers and need <= self.capacity and not self.shared:
            buffers, pos = self.buffers, self.positions
        else:
            cap = max(need, 2 * self.capacity, 64)
            buffers = {
                n: _grow(
                    self.buffers.get(n), lead, shape, dtype, positions.device, self.length, cap
                )
                for n, (shape, dtype) in spec.items()
            }
            pos = _grow_pos(self.positions, positions, self.length, cap)
        write(buffers, self.length)
        assert pos is not None
        pos[:, self.length : need] = positions
        return RowStore(buffers=buffers, length=need, positions=pos)

    def appended_at(self, rows: Rows, positions: Tensor, at: Tensor) -> RowStore:
        """Successor with `rows` (each [B, H, T, ...]) at positions [B, T] written at rows
        `at` ([T] int64 on the device: the committed length as the device counts it) of
        the buffers themselves, which must hold them (`fits`): no host offset reaches the
        device, so the same ops append row after row (a replayable decode step)."""
        for name, r in rows.items():
            self.buffers[name].index_copy_(2, at, r)
        self.positions.index_copy_(1, at, positions)
        return RowStore(self.buffers, self.length + positions.shape[1], self.positions)

    def reserved(self, rows: int) -> RowStore:
        """Successor whose buffers hold `rows` more rows without growing: itself when they
        do, else a copy into buffers of exactly that capacity (writes never touch the
        predecessor's, like `prepared_into`)."""
        need = self.length + rows
        if not self.buffers or (need <= self.capacity and not self.shared):
            return self
        buffers = {
            n: _grow(b, b.shape[:2], b.shape[3:], b.dtype, b.device, self.length, need)
            for n, b in self.buffers.items()
        }
        return RowStore(buffers, self.length, _grow_pos(self.positions, self.positions,
                                                        self.length, need))  # fmt: skip

    def fits(self, rows: int) -> bool:
        """Whether `rows` more rows go into the buffers themselves (no growth, no copy)."""
        return bool(self.buffers) and not self.shared and self.length + rows <= self.capacity

    def dropped_front(self, count: int, copy: bool = False) -> RowStore:
        """Successor without the oldest `count` rows (sliding-window eviction): views that
        start `count` rows later in the same buffers, so evicting costs no copy and the
        free rows past the frontier stay free; the dropped rows' memory is released when
        the buffers next grow (`_grow` copies only the committed rows). copy: a compact
        copy of the rows kept instead (the residual window, whose buffers a replayable
        step re-reads at the shapes it was planned with)."""
        if count <= 0:
            return self
        assert self.positions is not None
        if copy:
            bufs = {n: b[:, :, count : self.length].clone() for n, b in self.buffers.items()}
            positions = self.positions[:, count : self.length].clone()
            return RowStore(bufs, self.length - count, positions)
        bufs = {n: b[:, :, count:] for n, b in self.buffers.items()}
        return RowStore(bufs, self.length - count, self.positions[:, count:], self.shared)

    def select_batch(self, index: Tensor) -> RowStore:
        """Successor with batch rows reordered (beam search): codes, qparams and positions move together."""
        if not self.buffers:
            return self
        assert self.positions is not None
        bufs = {n: b.index_select(0, index) for n, b in self.buffers.items()}
        return RowStore(bufs, self.length, self.positions.index_select(0, index))

    def truncated(self, length: int) -> RowStore:
        """Successor keeping the first `length` rows; later rows become invisible and are overwritten."""
        return RowStore(self.buffers, min(length, self.length), self.positions, self.shared)

    @property
    def capacity(self) -> int:
        if not self.buffers:
            return 0
        return next(iter(self.buffers.values())).shape[2]

    def nbytes(self) -> dict[str, int]:
        """Bytes of the committed rows of each stored tensor, measured from the tensors."""
        return {n: b[:, :, : self.length].nbytes for n, b in self.buffers.items()}

    def allocated_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())


def _grow(old, lead, shape, dtype, device, keep: int, cap: int) -> Tensor:
    new = torch.empty((*lead, cap, *shape), dtype=dtype, device=device)
    if old is not None and keep:
        new[:, :, :keep] = old[:, :, :keep]
    return new


def _grow_pos(old: Tensor | None, like: Tensor, keep: int, cap: int) -> Tensor:
    new = torch.empty((like.shape[0], cap), dtype=torch.long, device=like.device)
    if old is not None and keep:
        new[:, :keep] = old[:, :keep]
    return new


@dataclass(frozen=True)
class FlatStore:
    """Variable-length per-row entries (sparse exceptions), ordered by row.

    Entries of all (batch, head) pairs of row r come before those of row r+1;
    within a row they are ordered by batch, then head, then channel. The
    per-(batch, head, row) entry counts live in the matching `RowStore`, so the
    entries of any row range are one contiguous slice found by a prefix sum.
    Same snapshot discipline as `RowStore`: successors write beyond the
    committed frontier or into grown copies.
    """

    buffers: dict[str, Tensor]  # name -> [capacity]
    length: int
    shared: bool = False  # as RowStore.shared

    @staticmethod
    def empty() -> FlatStore:
        return FlatStore(buffers={}, length=0)

    def entries(self, start: int, stop: int) -> dict[str, Tensor]:
        return {n: b[start:stop] for n, b in self.buffers.items()}

    def prepared(self, entries: dict[str, Tensor]) -> FlatStore:
        n = next(iter(entries.values())).shape[0] if entries else 0
        if n == 0:
            return self
        need = self.length + n
        cap = next(iter(self.buffers.values())).shape[0] if self.buffers else 0
        if self.buffers and need <= cap and not self.shared:
            buffers = self.buffers
        else:
            cap = max(need, 2 * cap, 256)
            buffers = {}
            for name, e in entries.items():
                new = torch.empty((cap, *e.shape[1:]), dtype=e.dtype, device=e.device)
                if name in self.buffers and self.length:
                    new[: self.length] = self.buffers[name][: self.length]
                buffers[name] = new
        for name, e in entries.items():
            buffers[name][self.length : need] = e
        return FlatStore(buffers=buffers, length=need)

    def dropped_front(self, count: int) -> FlatStore:
        """Successor without the oldest `count` entries: views, as `RowStore.dropped_front`."""
        if count <= 0:
            return self
        bufs = {n: b[count:] for n, b in self.buffers.items()}
        return FlatStore(bufs, self.length - count, self.shared)

    def truncated(self, length: int) -> FlatStore:
        return FlatStore(self.buffers, min(length, self.length), self.shared)

    def reordered(self, order: Tensor) -> FlatStore:
        """Successor with committed entries permuted by `order` (a LongTensor of entry indices)."""
        bufs = {n: b[: self.length].index_select(0, order) for n, b in self.buffers.items()}
        return FlatStore(bufs, order.numel())  # repeated or dropped batch rows change the count

    def nbytes(self) -> dict[str, int]:
        return {n: b[: self.length].nbytes for n, b in self.buffers.items()}

    def allocated_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())
