"""One cache layer per policy entry: packed K/V rows, sink rows, positions.

A layer's public state is an immutable `LayerState`. `prepare` computes the
successor for new rows without touching the public one; the owning cache
publishes all layers' successors together (see `cache.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from kvq.quant.schemes import LayerPolicy
from kvq.runtime.codecs import Codec
from kvq.runtime.kernels.backend import resolve_backend
from kvq.runtime.kernels.decode_attention import Rope, Segment, rotate
from kvq.runtime.packed import PackedRows, decode_packed
from kvq.runtime.state import FlatStore, RowStore

RopeFn = Callable[[Tensor, Tensor], Tensor]  # (x [B, H, T, D], positions [B, T]) -> x rotated
RopeTable = Callable[[int], Rope]  # n -> cos, sin [n, D/2] for positions 0..n-1


@dataclass(frozen=True)
class LayerState:
    sink: RowStore  # full-precision rows of the first `sink_tokens` positions
    main: RowStore  # encoded rows
    seen: int  # tokens appended so far (including evicted ones)
    evicted: int  # rows dropped from the front (sliding-window layers)
    flat: dict[str, FlatStore] = field(default_factory=dict)  # "k"/"v" variable-length entries

    @property
    def visible(self) -> int:
        return self.sink.length + self.main.length


EMPTY = LayerState(RowStore.empty(), RowStore.empty(), 0, 0)


class KvqLayer(CacheLayerMixin):
    """A transformers cache layer whose rows are stored by a K codec and a V codec.

    Keys arrive post-RoPE from the model. For a pre-RoPE policy the rotation is
    undone at each row's own position before encoding, and re-applied after
    decoding, so the stored codes are pre-RoPE keys (article 0x03E).
    """

    is_compileable = False
    is_croppable = True

    def __init__(
        self,
        layer_idx: int,
        policy: LayerPolicy,
        key_codec: Codec,
        value_codec: Codec,
        activation_dtype: torch.dtype,
        sliding_window: int | None,
        unrotate: RopeFn,
        rope_table: RopeTable,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.policy = policy
        self.key_codec, self.value_codec = key_codec, value_codec
        self.activation_dtype = activation_dtype
        # Sink rows are kept as an fp16 cache would keep them (an fp32 model's would
        # otherwise cost twice the bytes of the unquantized reference); bf16 stays bf16.
        self.sink_dtype = torch.float16 if activation_dtype == torch.float32 else activation_dtype
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.unrotate, self.rope_table = unrotate, rope_table
        self._rope: Rope | None = None
        self.state = EMPTY
        self.is_initialized = True

    # --- append --------------------------------------------------------------------

    def prepare(
        self, key: Tensor, value: Tensor, positions: Tensor, backend: str | None = None
    ) -> LayerState:
        """Successor state with new rows appended.

        key, value: [B, H_kv, T, D] (key post-RoPE); positions: [B, T] RoPE positions.
        backend: where the rows are quantized (Triton append kernels or torch).
        """
        st = self.state
        t = key.shape[2]
        n_sink = max(0, min(self.policy.sink_tokens - st.seen, t))
        if self.policy.key_stage == "pre-rope":
            key = self.unrotate(key.float(), positions)
        sink, main = st.sink, st.main
        if n_sink:
            sink = sink.prepared(
                {
                    "k": key[:, :, :n_sink].to(self.sink_dtype),
                    "v": value[:, :, :n_sink].to(self.sink_dtype),
                },
                positions[:, :n_sink],
            )
        flat = dict(st.flat)
        if t > n_sink:
            main = self._append_main(
                main, key[:, :, n_sink:], value[:, :, n_sink:], flat, positions[:, n_sink:], backend
            )
        return LayerState(sink=sink, main=main, seen=st.seen + t, evicted=st.evicted, flat=flat)

    def _append_main(self, main, key, value, flat, positions, backend) -> RowStore:
        """Encode new rows into the successor of `main`; flat entries are added to `flat`.

        On the triton backend a codec with an append kernel writes its codes and qparams
        straight into the store's pages (one launch per family and step); otherwise rows
        are encoded in torch and copied in.
        """
        kernels = resolve_backend(backend, key.device) == "triton"
        spec, encoded, direct = {}, {}, []
        for part, codec, x in (("k", self.key_codec, key), ("v", self.value_codec, value)):
            layout = codec.row_spec(x) if kernels else None
            if layout is not None:
                spec |= {f"{part}.{n}": s for n, s in layout.items()}
                direct.append((part, codec, x))
                continue
            rows, part_flat = codec.encode(x)
            encoded |= {f"{part}.{n}": r for n, r in rows.items()}
            spec |= {f"{part}.{n}": (tuple(r.shape[3:]), r.dtype) for n, r in rows.items()}
            if part_flat:
                flat[part] = flat.get(part, FlatStore.empty()).prepared(part_flat)

        produced: dict[str, dict[str, Tensor]] = {}

        def write(buffers: dict[str, Tensor], start: int) -> None:
            for name, r in encoded.items():
                buffers[name][:, :, start : start + r.shape[2]] = r
            for part, codec, x in direct:
                produced[part] = codec.append_into(x, _strip(buffers, f"{part}."), start)

        successor = main.prepared_into(spec, tuple(key.shape[:2]), positions, write)
        for part, part_flat in produced.items():
            if part_flat:
                flat[part] = flat.get(part, FlatStore.empty()).prepared(part_flat)
        return successor

    def evict(self, state: LayerState) -> LayerState:
        """Drop rows a sliding-window layer can never attend to again.

        Keeps at least `window - 1` rows (what the next query needs) and only
        compacts once twice the window is stored, so eviction copies are rare.
        """
        w = self.sliding_window
        if w is None or state.visible <= 2 * w:
            return state
        drop = state.visible - (w - 1)
        if drop < state.sink.length:
            return state
        rows = drop - state.sink.length
        flat = {
            p: f.dropped_front(int(_row_ptr(state.main, p)[rows])) for p, f in state.flat.items()
        }
        main = state.main.dropped_front(rows)
        return replace(
            state, sink=RowStore.empty(), main=main, evicted=state.evicted + drop, flat=flat
        )

    # --- read ----------------------------------------------------------------------

    def segments(self, state: LayerState) -> list[Segment]:
        """The visible rows as attention segments: sink rows first, then encoded rows.

        Their order is the order of the mask columns.
        """
        pre = self.policy.key_stage == "pre-rope"
        out = []
        if state.sink.length:
            r = state.sink.rows()
            key = PackedRows("full", self.key_codec.head_dim, r["k"], pre_rope=pre)
            value = PackedRows("full", self.value_codec.head_dim, r["v"])
            out.append(Segment(key, value, state.sink.row_positions()))
        if state.main.length:
            rows = state.main.rows()
            flat = {p: f.entries(0, f.length) for p, f in state.flat.items()}
            key = self.key_codec.packed(_strip(rows, "k."), flat.get("k", {}))
            if pre:
                key = replace(key, pre_rope=True)
            value = self.value_codec.packed(_strip(rows, "v."), flat.get("v", {}))
            out.append(Segment(key, value, state.main.row_positions()))
        return out

    def rope(self, state: LayerState) -> Rope | None:
        """cos/sin tables covering every stored position (pre-RoPE keys only); grown on demand."""
        if self.policy.key_stage != "pre-rope" or not state.visible:
            return None
        tops = [s.row_positions().max() for s in (state.sink, state.main) if s.length]
        top = int(torch.stack(tops).max())  # one device sync, not one per store
        if self._rope is None or self._rope[0].shape[0] <= top:
            self._rope = self.rope_table(max(1024, 1 << top.bit_length()))
        return self._rope

    def decoded(self, state: LayerState) -> tuple[Tensor, Tensor]:
        """All visible rows decoded: key post-RoPE, value; each [B, H, visible, D] float32."""
        rope = self.rope(state)
        keys, values = [], []
        for seg in self.segments(state):
            k = decode_packed(seg.key)
            keys.append(rotate(k, seg.positions, rope) if seg.key.pre_rope else k)
            values.append(decode_packed(seg.value))
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    # --- ledger --------------------------------------------------------------------

    def ledger_bytes(self) -> dict[str, int]:
        """Measured bytes per ledger category of the committed state."""
        out = dict.fromkeys(("codes", "qparams", "sparse", "sink", "residual", "full_precision"), 0)
        out["sink"] += sum(self.state.sink.nbytes().values())
        cats = {f"k.{n}": c for n, c in self.key_codec.categories().items()}
        cats |= {f"v.{n}": c for n, c in self.value_codec.categories().items()}
        for name, nbytes in self.state.main.nbytes().items():
            out[cats[name]] += nbytes
        for part, store in self.state.flat.items():
            for name, nbytes in store.nbytes().items():
                out[cats[f"{part}.{name}"]] += nbytes
        for codec in (self.key_codec, self.value_codec):
            out["qparams"] += sum(t.nbytes for t in codec.static.values())
        return out

    def allocated_bytes(self) -> int:
        st = self.state
        flat = sum(f.allocated_bytes() for f in st.flat.values())
        return st.sink.allocated_bytes() + st.main.allocated_bytes() + flat

    # --- CacheLayerMixin -------------------------------------------------------------

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("KvqLayer is updated through QuantizedKVCache.update")

    def get_seq_length(self) -> int:
        return self.state.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.state.visible + query_length, self.state.evicted

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state = EMPTY

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        st = self.state
        flat = {p: f.reordered(_batch_order(st.main, p, beam_idx)) for p, f in st.flat.items()}
        self.state = replace(
            st, sink=st.sink.select_batch(beam_idx), main=st.main.select_batch(beam_idx), flat=flat
        )

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` tokens (negative: drop that many from the end)."""
        st = self.state
        keep = st.seen + max_length if max_length < 0 else max_length
        if keep >= st.seen:
            return
        if st.evicted:
            raise RuntimeError("cannot crop a sliding-window layer that has evicted rows")
        rows = max(0, keep - st.sink.length)
        self.state = LayerState(
            sink=st.sink.truncated(keep),
            main=st.main.truncated(rows),
            seen=keep,
            evicted=0,
            flat={p: f.truncated(int(_row_ptr(st.main, p)[rows])) for p, f in st.flat.items()},
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        index = torch.arange(self.batch_size()).repeat_interleave(repeats)
        self.reorder_cache(index)

    def batch_select_indices(self, indices: Tensor) -> None:
        self.reorder_cache(indices)

    def batch_size(self) -> int:
        for store in (self.state.main, self.state.sink):
            if store.positions is not None:
                return store.positions.shape[0]
        return 0


def _strip(rows: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {n[len(prefix) :]: t for n, t in rows.items() if n.startswith(prefix)}


def _row_ptr(main: RowStore, part: str) -> Tensor:
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
    within = torch.arange(int(lens.sum())) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    return torch.repeat_interleave(src, lens) + within
