"""What a cache layer does to rows it already holds: roll back the last tokens (`crop`,
for assisted decoding's rejected drafts), reorder or repeat its batch rows (beam search,
`batch_select_indices`). `KvqLayer` (`layers.py`) takes these from `LayerEdits`; they
only build successor `LayerState`s, like `prepare`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.runtime.packed import decode_packed
from kvq.runtime.state import RowStore

if TYPE_CHECKING:
    from kvq.runtime.layers import LayerState


class LayerEdits:
    """Rollback and batch edits of a `KvqLayer` (its attributes and `_compacted`,
    `_main_rows`, `_encoded` are used as they are there)."""

    def _rolled_back(self, st: LayerState, columns: int, lead: int, n: int) -> LayerState:
        """`st` without its last n tokens: the state greedy decoding would have at that length.

        Encoded groups that greedy would not yet have encoded go back to the residual window,
        exact when their rows were kept for the rollback (transformers' past recording), else
        as decoded (the values attention already saw).
        """
        if st.phase is not None:
            return self._rolled_back_shifted(st, columns, lead, n)
        skipped = min(st.skipped, st.seen - n)
        before, after = st.seen - st.skipped, st.seen - n - skipped  # tail rows
        keep = st.main.length - (self._main_rows(before) - self._main_rows(after))
        if keep < 0:
            raise KvqError(f"layer {self.layer_idx}: rollback past evicted rows")
        tail = columns - lead - keep  # rows the residual window keeps
        residual = st.residual.truncated(st.residual.length)
        if self.windowed:
            base = st.main.length - st.settled  # main row of the residual's first row
            if keep >= base:
                rows = st.residual.rows(keep - base, keep - base + tail)
                pos = st.residual.row_positions(keep - base, keep - base + tail)
            else:  # the exact rows are gone: decode what attention saw
                k, v = self._decoded_main(st, keep, base)
                live = st.residual.rows(0, tail - (base - keep))
                rows = {
                    "k": torch.cat([k.to(self.sink_dtype), live["k"]], dim=2),
                    "v": torch.cat([v.to(self.sink_dtype), live["v"]], dim=2),
                }
                pos = torch.cat(
                    [
                        st.main.row_positions(keep, base),
                        st.residual.row_positions(0, tail - (base - keep)),
                    ],
                    dim=1,
                )
            residual = RowStore.empty().prepared(rows, pos) if tail else RowStore.empty()
        return replace(
            st,
            sink=None if st.sink is None else st.sink.cropped(columns),
            prefix=None if st.prefix is None else st.prefix.cropped(st.evicted + columns),
            main=st.main.truncated(keep),
            residual=residual,
            settled=0,
            seen=st.seen - n,
            lead=lead,
            skipped=skipped,
            flat={p: f.truncated(int(row_ptr(st.main, p)[keep])) for p, f in st.flat.items()},
        )

    def _rolled_back_shifted(self, st: LayerState, columns: int, lead: int, n: int) -> LayerState:
        """`_rolled_back` for a padded batch's shifted groups: main keeps what the furthest
        sequence encodes at that length; every other row must still be held exact."""
        keep = min(st.main.length, self._encoded(columns - lead, st.phase_max))
        start = st.lead + st.main.length - st.settled  # column of the residual's first row
        x = columns - lead - self.policy.residual_tokens
        first_exact = lead + max(0, min(keep, x - self.group_rows + 1))
        if lead != st.lead or start > first_exact:
            raise KvqError(
                f"layer {self.layer_idx}: cannot remove {n} tokens of a padded batch, their "
                "exact rows are gone (call activate_past_recording before appending tokens "
                "that may be rolled back)"
            )
        return replace(
            st,
            sink=None if st.sink is None else st.sink.cropped(columns),
            prefix=None if st.prefix is None else st.prefix.cropped(st.evicted + columns),
            main=st.main.truncated(keep),
            residual=st.residual.truncated(max(0, columns - start)),
            settled=lead + keep - start,
            seen=st.seen - n,
            flat={p: f.truncated(int(row_ptr(st.main, p)[keep])) for p, f in st.flat.items()},
        )

    def _decoded_main(self, st: LayerState, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """Main rows [start, stop) decoded as stored (pre-RoPE keys stay unrotated)."""
        rows = st.main.rows()
        flat = {p: f.entries(0, f.length) for p, f in st.flat.items()}
        key = self.key_codec.packed(strip_part(rows, "k."), flat.get("k", {}))
        value = self.value_codec.packed(strip_part(rows, "v."), flat.get("v", {}))
        return decode_packed(key.narrow(start, stop)), decode_packed(value.narrow(start, stop))

    def activate_past_recording(self, **_recurrent) -> None:
        """Keep evictable rows until the next `crop` (transformers may roll back drafts).
        Keywords for recurrent layers (5.25's `recurrent_states_to_keep`) do not apply."""
        self.record_past = True

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Batch rows picked by `beam_idx`: any index, repeated or dropped rows included."""
        self.state = self._selected(self.state, beam_idx)

    def _selected(self, st: LayerState, index: Tensor) -> LayerState:
        if not self.batch_size:
            return st
        index = index.to(device=self._device(st), dtype=torch.long)
        flat = {p: f.reordered(_batch_order(st.main, p, index)) for p, f in st.flat.items()}
        sink = None if st.sink is None else st.sink.selected(index)
        prefix = None if st.prefix is None else st.prefix.selected(index)
        main, residual = st.main.select_batch(index), st.residual.select_batch(index)
        pick = {
            name: None if x is None else x.index_select(0, index)
            for name, x in (("phase", st.phase), ("first_real", st.first_real))
        }  # (phase_max stays: an upper bound is enough, see `_still_exact`)
        return replace(
            st, sink=sink, prefix=prefix, main=main, residual=residual, flat=flat, **pick
        )

    @staticmethod
    def _device(st: LayerState) -> torch.device:
        for t in (st.main.positions, st.residual.positions):
            if t is not None:
                return t.device
        return (st.sink.cols if st.sink is not None else st.prefix.placed).device

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (transformers 5 semantics: 0 removes
        nothing; a positive value, the legacy absolute length, is refused as transformers'
        own layers refuse it). A sliding layer then compacts back to its working size."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove, "
                "as transformers' caches expect"
            )
        st = self.state
        n = min(-tokens_to_remove, st.seen)
        if n:
            columns = st.visible - n
            w = self.sliding_window
            if st.evicted and (columns < 0 or (w is not None and columns < w - 1)):
                raise KvqError(
                    f"layer {self.layer_idx}: cannot remove {n} tokens, the sliding window "
                    "has already dropped the rows before them (call activate_past_recording "
                    "before appending tokens that may be rolled back)"
                )
            lead = min(st.lead, columns)
            st = self._rolled_back(st, columns, lead, n)
        self.state = self._compacted(st)

    def batch_repeat_interleave(self, repeats: int) -> None:
        index = torch.arange(self.batch_size).repeat_interleave(repeats)
        self.reorder_cache(index)

    def batch_select_indices(self, indices: Tensor) -> None:
        self.reorder_cache(indices)

    @property
    def batch_size(self) -> int:
        """Sequences held (0 before the first append)."""
        for store in (self.state.main, self.state.residual):
            if store.positions is not None:
                return store.positions.shape[0]
        if self.state.sink is not None:
            return self.state.sink.cols.shape[0]
        return 0 if self.state.prefix is None else self.state.prefix.placed.shape[0]


def strip_part(rows: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The rows of one part ("k." or "v."), named without the part."""
    return {n[len(prefix) :]: t for n, t in rows.items() if n.startswith(prefix)}


def row_ptr(main: RowStore, part: str) -> Tensor:
    """[rows + 1] start of each committed row's flat entries (prefix sum of the counts)."""
    count = main.rows()[f"{part}.sparse_count"]  # [B, H, T]
    per_row = count.long().sum(dim=(0, 1))
    return torch.cat([per_row.new_zeros(1), per_row.cumsum(0)])


def _batch_order(main: RowStore, part: str, index: Tensor) -> Tensor:
    """Entry order that moves flat entries with their batch rows (reorder / repeat)."""
    cnt = main.rows()[f"{part}.sparse_count"].long().permute(2, 0, 1)  # [T, B, H]
    starts = (cnt.flatten().cumsum(0) - cnt.flatten()).view(cnt.shape)
    lens = cnt[:, index].flatten()
    src = starts[:, index].flatten()
    # (on the counts' device: a host arange would not mix with CUDA counts)
    n = int(lens.sum())
    within = torch.arange(n, device=lens.device)
    within -= torch.repeat_interleave(lens.cumsum(0) - lens, lens, output_size=n)
    return torch.repeat_interleave(src, lens, output_size=n) + within
