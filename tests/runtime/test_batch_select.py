"""Batch reorders move every per-row state with its row, bit for bit.

`batch_repeat_interleave`, `reorder_cache` (repeated and dropped rows) and
`batch_select_indices` must leave exactly what a fresh cache holds after being fed the picked
sequences' same rows in the same forwards: main codes and qparams, sparse counts, the flat
exception entries (ordered by row, batch, head), sink rows, positions, the residual window,
the groups' phase. The reference is built by replaying the K/V rows the layers received
(recorded at `KvqLayer.prepare`), so model numerics at another batch size (which can flip a
code, and through it every later layer) play no part.
"""

from __future__ import annotations

import pytest
import torch

import kvq
from kvq.calibrators.options import ChannelScalesOptions, KVQuantOptions
from kvq.runtime.layer_edits import _batch_order
from kvq.runtime.state import RowStore
from tests.conftest import calibrate

# A left-padded prompt batch: sequences 1 and 2 start with padding. Sequence 1 starts the
# furthest into the columns: its KIVI groups run furthest ahead (the batch's phase_max); the
# selections below keep it, so a fresh cache of the picked sequences has the same layout.
LENGTHS = (10, 5, 7)


@pytest.fixture(scope="module")
def caches(tiny_model_dir, data, tmp_path_factory):
    """name -> (model, make_cache): KVQuant with sparse key exceptions (llama, and gemma3
    whose sliding window of 8 evicts rows after the reorders), channel scales, int8, KIVI."""
    out = {}
    for family in ("llama", "gemma3"):
        model_dir = tiny_model_dir(family)
        art = tmp_path_factory.mktemp(f"kvquant-{family}") / "ART"
        calibrate(model_dir, data, art, KVQuantOptions(bits=4, outliers=0.05, sink=2, fisher=False))
        model, _ = kvq.load_model(str(model_dir))
        out[f"kvquant-{family}"] = (model, lambda m=model, a=art: kvq.make_cache(m, artifact=a))
        if family == "llama":
            cs = tmp_path_factory.mktemp("channel-scales") / "ART"
            calibrate(model_dir, data, cs, ChannelScalesOptions(bits=4, value_group=8, sink=1))
            out["channel-scales"] = (model, lambda m=model, a=cs: kvq.make_cache(m, artifact=a))
            for policy in ("int8", "kivi4-g4-r4"):
                out[policy] = (model, lambda m=model, p=policy: kvq.make_cache(m, policy=p))
    return out


def _record(cache) -> list:
    """Every row a layer of `cache` is given: (layer, key, value, positions, real)."""
    calls = []
    for layer in cache.layers:

        def prepare(key, value, positions, real=None, backend=None, _orig=layer.prepare):
            calls.append((key.clone(), value.clone(), positions.clone(), real))
            return _orig(key, value, positions, real, backend)

        layer.prepare = prepare
    return calls


def _replayed(cache, calls: list, lineage: list) -> None:
    """Feed `cache` forward f's recorded rows lineage[f] (as `_publish` commits them)."""
    n = len(cache.layers)
    for f, index in enumerate(lineage):
        rows = calls[f * n : (f + 1) * n]
        for layer, (key, value, pos, real) in zip(cache.layers, rows, strict=True):
            real = None if real is None else real[index]
            st = layer.prepare(key[index], value[index], pos[index], real, cache.backend)
            layer.state = layer.evict(layer.committed(st))


def _stored(layer) -> dict:
    """Every committed per-row tensor of a layer, and its host counters."""
    st, out = layer.state, {}
    for tag, store in (("main", st.main), ("residual", st.residual)):
        out |= {f"{tag}.{n}": b for n, b in store.rows().items()}
        if store.positions is not None:
            out[f"{tag}.positions"] = store.row_positions()
    for part, flat in st.flat.items():
        out |= {f"flat.{part}.{n}": b for n, b in flat.entries(0, flat.length).items()}
    if st.sink is not None:
        out |= {f"sink.{n}": r for n, r in st.sink.rows.items()}
        out |= {"sink.positions": st.sink.positions, "sink.cols": st.sink.cols}
        out |= {"sink.filled": st.sink.filled}
    out |= {n: t for n in ("phase", "first_real") if (t := getattr(st, n)) is not None}
    counters = (st.seen, st.evicted, st.lead, st.settled, st.skipped, st.main.length)
    return out | {"counters": torch.tensor([*counters, st.residual.length])}


def _assert_same_state(got, want) -> None:
    for i, (a, b) in enumerate(zip(got.layers, want.layers, strict=True)):
        sa, sb = _stored(a), _stored(b)
        assert sa.keys() == sb.keys(), f"layer {i}"
        for name in sa:
            assert sa[name].shape == sb[name].shape, f"layer {i} {name}"
            assert torch.equal(sa[name], sb[name]), f"layer {i} {name} differs"


class _Run:
    """A cache driven through forwards and batch reorders, with each row's lineage: for
    every forward so far, which of that forward's rows each current row descends from."""

    def __init__(self, model, cache, ids, mask):
        self.model, self.cache, self.calls = model, cache, _record(cache)
        self.mask, self.lineage = mask, []
        self.forward(ids)

    def forward(self, ids):
        if self.lineage:
            self.mask = torch.cat([self.mask, torch.ones_like(ids)], dim=1)
        logits = self.model(ids, attention_mask=self.mask, cache=self.cache).logits
        self.lineage.append(torch.arange(ids.shape[0]))
        return logits

    def picked(self, index):
        index = torch.as_tensor(index)
        self.lineage = [rows[index] for rows in self.lineage]
        self.mask = self.mask[index]


def _prompt():
    g = torch.Generator().manual_seed(0)
    width = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(LENGTHS):
        ids[b, width - n :] = torch.randint(3, 500, (n,), generator=g)
        mask[b, width - n :] = 1
    return ids, mask


def _step(batch: int, seed: int):
    return torch.randint(3, 500, (batch, 1), generator=torch.Generator().manual_seed(seed))


def _check_against_replay(run: _Run, make) -> None:
    """The run's cache equals a fresh one replaying its rows; so do their next logits."""
    fresh = make()
    _replayed(fresh, run.calls, run.lineage)
    _assert_same_state(run.cache, fresh)
    step = _step(run.mask.shape[0], 99)
    mask = torch.cat([run.mask, torch.ones_like(step)], dim=1)
    want = run.model(step, attention_mask=mask, cache=fresh).logits
    assert torch.equal(run.forward(step), want)


NAMES = ["kvquant-llama", "kvquant-gemma3", "channel-scales", "int8", "kivi4-g4-r4"]


@torch.no_grad()
@pytest.mark.parametrize("name", NAMES)
def test_repeat_interleave_then_select(caches, name):
    """The issue's sequence: prompt, repeat_interleave(k), decode, batch_select_indices."""
    model, make = caches[name]
    ids, mask = _prompt()
    run = _Run(model, make(), ids, mask)
    run.cache.batch_repeat_interleave(2)
    run.picked(torch.arange(len(LENGTHS)).repeat_interleave(2))
    for seed in range(3):  # each beam its own token: rows differ after the repeat
        run.forward(_step(2 * len(LENGTHS), seed))
    run.cache.batch_select_indices([1, 2])
    run.picked([1, 2])
    if name.startswith("kvquant"):
        flat = run.cache.layers[0].state.flat["k"]
        assert flat.length > 0  # the exceptions under test exist
    _check_against_replay(run, make)


@torch.no_grad()
@pytest.mark.parametrize("name", NAMES)
def test_reorder_with_repeats_then_select(caches, name):
    """A beam reorder repeating and dropping rows, decode steps between, then a select."""
    model, make = caches[name]
    ids, mask = _prompt()
    run = _Run(model, make(), ids, mask)
    run.cache.batch_repeat_interleave(2)
    run.picked(torch.arange(len(LENGTHS)).repeat_interleave(2))
    run.forward(_step(6, 10))
    order = [5, 5, 0, 3, 2, 1]  # row 4 dropped, row 5 twice
    run.cache.reorder_cache(torch.tensor(order))
    run.picked(order)
    for seed in (11, 12, 13):
        run.forward(_step(6, seed))
    run.cache.batch_select_indices(torch.tensor([4, 0]))
    run.picked([4, 0])
    _check_against_replay(run, make)


@torch.no_grad()
@pytest.mark.parametrize("name", ["kvquant-llama", "kivi4-g4-r4"])
def test_select_into_another_layout_sees_the_same_rows(caches, name):
    """Selecting only the unpadded sequence: a fresh cache of just it has another layout
    (its sink rows in the lead columns alone, where the padded batch also kept them in main,
    hidden; its KIVI groups unshifted, where the batch encoded as far as its furthest
    sequence's phase allowed), legitimately, but every row attention sees has the same bits."""
    model, make = caches[name]
    ids, mask = _prompt()
    run = _Run(model, make(), ids, mask)
    run.cache.batch_repeat_interleave(3)
    run.picked(torch.arange(len(LENGTHS)).repeat_interleave(3))
    run.forward(_step(9, 20))
    run.cache.batch_select_indices([1, 2])  # both copies of sequence 0, unpadded
    run.picked([1, 2])
    fresh = make()
    _replayed(fresh, run.calls, run.lineage)
    a, b = run.cache.layers[0].state, fresh.layers[0].state
    assert (a.lead, a.phase_max, a.main.length) != (b.lead, b.phase_max, b.main.length)
    for a, b in zip(run.cache.layers, fresh.layers, strict=True):
        for x, y in zip(a.visible_rows(a.state), b.visible_rows(b.state), strict=True):
            assert torch.equal(x, y)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_batch_order_moves_entries_with_their_rows(device):
    """Flat entries (row, batch, head order) picked by a batch index with repeats, on the
    counts' own device."""
    g = torch.Generator().manual_seed(0)
    b, h, t = 3, 2, 4
    count = torch.randint(0, 4, (b, h, t), generator=g).to(torch.uint8)
    main = RowStore.empty().prepared(
        {"k.sparse_count": count.to(device)}, torch.zeros(b, t, dtype=torch.long, device=device)
    )
    # each entry labelled by its owner (row, batch, head) and rank
    labels = [(r, i, j, e) for r in range(t) for i in range(b) for j in range(h)
              for e in range(int(count[i, j, r]))]  # fmt: skip
    index = torch.tensor([2, 0, 2, 1])
    order = _batch_order(main, "k", index.to(device))
    assert order.device.type == device
    want = [(r, int(i), j, e) for r in range(t) for i in index for j in range(h)
            for e in range(int(count[i, j, r]))]  # fmt: skip
    got = [labels[k] for k in order.cpu().tolist()]
    assert got == want
