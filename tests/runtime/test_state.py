"""RowStore snapshots: successors write beyond the committed frontier, in place when they can."""

import torch

from kvq.runtime.state import RowStore


def _pos(a, b):
    return torch.arange(a, b)[None]


def test_prepared_into_writes_new_rows_in_place_beyond_the_frontier():
    spec = {"codes": ((4,), torch.uint8)}
    starts = []

    def writer(value):
        def write(buffers, start):
            starts.append(start)
            buffers["codes"][:, :, start : start + 3] = value

        return write

    first = RowStore.empty().prepared_into(spec, (1, 2), _pos(0, 3), writer(1))
    second = first.prepared_into(spec, (1, 2), _pos(3, 6), writer(2))
    assert starts == [0, 3]
    assert second.buffers["codes"] is first.buffers["codes"]  # capacity 64: same pages
    assert first.length == 3 and bool((first.rows()["codes"] == 1).all())  # predecessor intact
    assert second.rows()["codes"][:, :, 3:].eq(2).all()
    assert second.row_positions().tolist() == [[0, 1, 2, 3, 4, 5]]


def test_prepared_into_grows_by_copying_and_keeps_the_predecessor():
    store = RowStore.empty()
    for i in range(3):  # 3 x 40 rows: the second append outgrows the first capacity
        rows = {"x": torch.full((1, 1, 40), float(i))}
        before = store
        store = store.prepared(rows, _pos(40 * i, 40 * (i + 1)))
        assert before.length == 40 * i
    assert store.capacity >= 120
    assert store.rows()["x"][0, 0].tolist() == [0.0] * 40 + [1.0] * 40 + [2.0] * 40
