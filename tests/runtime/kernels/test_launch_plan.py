"""The decode launch plan (kvq.runtime.kernels.planning.launch_plan): whole waves at the compiled
occupancy, exact tile-aligned cover of the rows, a minimum of rows per split."""

from __future__ import annotations

import pytest

from kvq.runtime.kernels.planning.launch_plan import (
    MIN_ROWS_PER_SPLIT,
    plan_splits,
    split_tiles,
    wave_fill,
)

SMS = 132  # H100 SXM / H200
SHAPES = {"llama-like": 8, "gemma3": 1}  # KV heads


def _cover(plan) -> list[tuple[int, int]]:
    return [plan.split_rows(s) for s in range(plan.splits)]


@pytest.mark.parametrize("per_sm", [1, 2, 3, 4])
@pytest.mark.parametrize("context", [4096, 32768, 131072])
@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_programs_fill_whole_waves_and_splits_cover_the_context(shape, batch, context, per_sm):
    work = batch * SHAPES[shape]
    plan = plan_splits(work, context, sms=SMS, programs_per_sm=per_sm, block_t=64)
    spans = _cover(plan)
    # exact cover: contiguous, from 0 to the last row, no split empty
    assert spans[0][0] == 0 and spans[-1][1] == context
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert all(stop - start >= MIN_ROWS_PER_SPLIT for start, stop in spans)
    assert all(start % 64 == 0 for start, _ in spans)  # tile-aligned
    if shape == "gemma3" and batch == 1 and context == 4096:
        # 4096 rows of one KV head hold 32 splits of the minimum: less than a quarter of
        # 132 SMs whatever the plan; it takes all 32
        assert plan.splits == context // MIN_ROWS_PER_SPLIT
    else:
        assert plan.fill >= 0.9, plan.as_dict()


def test_batch_adds_programs_instead_of_lengthening_them():
    """Batch 16 of a Llama-like layer fills the waves with fewer splits than batch 1."""
    one = plan_splits(8, 32768, sms=SMS, programs_per_sm=2, block_t=64)
    many = plan_splits(128, 32768, sms=SMS, programs_per_sm=2, block_t=64)
    assert many.splits < one.splits
    assert many.programs >= 0.9 * many.slots and one.programs >= 0.9 * one.slots


def test_the_grid_stays_the_same_within_a_context_bucket():
    """A decode step adds one row: the split count (the grid) changes only when the context
    crosses a power of two, so one captured graph serves a whole bucket."""
    grids = {
        plan_splits(128, rows, sms=SMS, programs_per_sm=2, block_t=64).splits
        for rows in range(16385, 32769, 997)
    }
    assert len(grids) == 1


def test_more_resident_programs_plan_more_programs():
    low = plan_splits(16, 131072, sms=SMS, programs_per_sm=1, block_t=64)
    high = plan_splits(16, 131072, sms=SMS, programs_per_sm=4, block_t=64)
    assert high.programs >= 4 * SMS * 0.9 > low.programs


def test_short_contexts_keep_one_split():
    plan = plan_splits(8, 100, sms=SMS, programs_per_sm=2, block_t=64)
    assert plan.splits == 1 and _cover(plan) == [(0, 100)]


def test_split_tiles_are_balanced():
    sizes = [hi - lo for lo, hi in (split_tiles(s, 7, 100) for s in range(7))]
    assert sum(sizes) == 100 and max(sizes) - min(sizes) <= 1


def test_wave_fill():
    assert wave_fill(264, 264) == 1.0
    assert wave_fill(265, 264) == pytest.approx(265 / 528)
    assert wave_fill(128, 528, 132) == pytest.approx(128 / 132)  # under a wave: 1 per SM
