"""How many programs a decode-attention launch uses, and which rows each one reads.

A decode step reads every cached row once; with one program per (batch, KV head)
the GPU is mostly idle (16 x 8 = 128 programs for 132 SMs that each hold several),
so each work item's rows are split between programs, flash-decoding style, and a
reduction merges their partial softmax states. The plan chooses the number of
splits so that batch x KV heads x splits fills whole waves of the programs the
GPU holds at once: SMs x the resident programs per SM that the *compiled* kernel
achieves (registers, shared memory, warps; `kvq.runtime.kernels.offline.cubin` reads
them without a GPU, `torch.cuda` occupancy with one). A partly filled last wave
leaves SMs idle for a whole program's time, and each split must keep enough rows
that its fixed cost (loading the query, writing a partial state, one more state
to reduce) stays small against its reads.

Only the number of splits is a host decision, and it depends on the context only
through a power-of-two bucket, so the grid stays the same from one decode step
to the next within a bucket. Where each split starts is computed by the program
itself from the row counts (`split_tiles`, mirrored in the kernel): tile-aligned
and balanced, every split of a work item gets floor or ceil of tiles / splits
tiles, so the splits cover the rows exactly, none is empty, and none is shorter
than the minimum.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# the fewest rows a split may read: below this the per-program fixed cost (query load,
# partial-state write and its share of the reduction, about one 64-row tile of reads)
# is a large part of its time
MIN_ROWS_PER_SPLIT = 128
MAX_SPLITS = 1024  # the reduction's partial states stay under 1024 per work item
FILL_TARGET = 0.9  # accept the fewest splits whose waves are at least this full


@dataclass(frozen=True)
class SplitPlan:
    """The launch of one decode-attention call: grid (work, splits)."""

    work: int  # batch x KV heads
    rows: int  # cached rows per work item (all segments)
    block_t: int  # rows per tile: split boundaries fall on tile boundaries
    splits: int  # programs per work item
    slots: int  # programs resident at once: SMs x resident programs per SM
    sms: int  # the SM count (for the fill of less than one wave)

    @property
    def programs(self) -> int:
        return self.work * self.splits

    @property
    def waves(self) -> int:
        return -(-self.programs // self.slots)

    @property
    def fill(self) -> float:
        """Share of the launched waves' program slots that hold a program. Below one wave
        the slots are those of the SMs in use at the residency the programs reach (a
        kernel cannot fill slots it has no programs for; what counts then is that every
        SM holds the same number)."""
        return wave_fill(self.programs, self.slots, self.sms)

    @property
    def tiles(self) -> int:
        return -(-self.rows // self.block_t)

    def split_rows(self, split: int) -> tuple[int, int]:
        """[start, stop) rows of split `split` (every work item splits the same way)."""
        lo, hi = split_tiles(split, self.splits, self.tiles)
        return lo * self.block_t, min(hi * self.block_t, self.rows)

    def as_dict(self) -> dict:
        return {
            "work": self.work,
            "rows": self.rows,
            "block_t": self.block_t,
            "splits": self.splits,
            "programs": self.programs,
            "slots": self.slots,
            "waves": self.waves,
            "fill": round(self.fill, 4),
        }


def split_tiles(split: int, splits: int, tiles: int) -> tuple[int, int]:
    """[first, last) tile of `split` of `splits` over `tiles` tiles: balanced, tile-aligned
    (the kernel computes the same with integer arithmetic on the device)."""
    return split * tiles // splits, (split + 1) * tiles // splits


def wave_fill(programs: int, slots: int, sms: int = 0) -> float:
    """Share of whole waves' slots that `programs` occupy; under one wave, of the slots
    of `sms` SMs at the residency the programs reach."""
    if programs >= slots or not sms:
        return programs / (-(-programs // slots) * slots)
    per_sm = -(-programs // sms)
    return programs / (per_sm * sms)


def plan_splits(
    work: int,
    rows: int,
    *,
    sms: int,
    programs_per_sm: int,
    block_t: int,
    min_rows: int = MIN_ROWS_PER_SPLIT,
) -> SplitPlan:
    """The plan for `work` items of `rows` rows each (see the module doc).

    Of the split counts that keep min_rows per split (whole tiles), the fewest whose
    programs make about a wave or more (FILL_TARGET x slots) and fill at least
    FILL_TARGET of their waves at the compiled occupancy (fewer splits: fewer partial
    states to write and reduce); with too few rows for a wave, as many splits as the
    minimum allows; otherwise the fullest waves. The context enters only through its power-of-two bucket (the grid of
    a decode step stays the same as the context grows), so the plan is cached.
    """
    bucket = 1 << max(rows - 1, 0).bit_length()
    splits = _splits_for(work, bucket, sms, programs_per_sm, block_t, min_rows)
    # the bucket's split count may leave the shorter real context under the minimum
    tiles = -(-rows // block_t)
    splits = max(1, min(splits, tiles // max(1, -(-min_rows // block_t))))
    return SplitPlan(work, rows, block_t, splits, sms * programs_per_sm, sms)


@functools.lru_cache(maxsize=4096)
def _splits_for(
    work: int, rows: int, sms: int, programs_per_sm: int, block_t: int, min_rows: int
) -> int:
    slots = sms * max(1, programs_per_sm)
    tiles = -(-rows // block_t)
    most = max(1, min(MAX_SPLITS, tiles // max(1, -(-min_rows // block_t))))
    best, best_fill = 1, -1.0
    for splits in range(1, most + 1):
        programs = work * splits
        fill = wave_fill(programs, slots, sms)
        if programs >= FILL_TARGET * slots and fill >= FILL_TARGET:
            return splits
        if fill > best_fill + 1e-9:
            best, best_fill = splits, fill
    # never a whole wave at the minimum rows per split: as many programs as rows allow
    return most if work * most < slots else best
