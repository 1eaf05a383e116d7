"""One cache layer per policy entry: packed K/V rows, prefix and sink rows, positions.

A layer's public state is an immutable `LayerState`. `prepare` computes the
successor for new rows without touching the public one; the owning cache
publishes all layers' successors together (see `cache.py`). A single-token decode step
of a fixed-width layout may instead be *replayable* (`KvqLayer._replayable`): it appends
at row counts the device holds and hands attention the buffers with those counts, so a
CUDA graph captured once replays it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from kvq.errors import KvqError
from kvq.quant.qparams import deferred_checks
from kvq.quant.schemes import LayerPolicy
from kvq.runtime.codecs import Codec
from kvq.runtime.kernels.backend import resolve_backend
from kvq.runtime.kernels.decode.segments import Rope, Segment, rotate
from kvq.runtime.layer_edits import LayerEdits, row_ptr, strip_part
from kvq.runtime.packed import PackedRows, decode_packed
from kvq.runtime.prefix import PrefixKV, PrefixRows
from kvq.runtime.sink import SinkRows, kernel_mask
from kvq.runtime.state import FlatStore, RowStore

RopeFn = Callable[[Tensor, Tensor], Tensor]  # (x [B, H, T, D], positions [B, T]) -> x rotated
RopeTable = Callable[[int], Rope]  # n -> cos, sin [n, D/2] for positions 0..n-1


@dataclass(frozen=True)
class LayerState:
    """The committed rows of one layer, in mask columns 0 .. visible - 1.

    Columns run: `lead` columns held only by the sink (an unpadded batch's first tokens are
    every sequence's sink), then the main store's encoded rows, then the residual window's
    exact rows (the most recent tokens, KIVI).
    In a padded batch a sequence's sink rows lie past the lead: main holds them too
    (attention hides that copy), and the sink holds them exact.
    """

    sink: SinkRows | None  # each sequence's first real tokens, exact (None: no sink)
    main: RowStore  # encoded rows
    seen: int  # tokens appended so far (including evicted ones)
    evicted: int  # columns dropped from the front (sliding-window eviction)
    lead: int = 0  # leading columns held only by the sink
    flat: dict[str, FlatStore] = field(default_factory=dict)  # "k"/"v" variable-length entries
    residual: RowStore = field(default_factory=RowStore.empty)  # "k"/"v" exact recent rows
    settled: int = 0  # leading residual rows already encoded in main, kept for a rollback
    skipped: int = 0  # rows ever held only by the sink (never entered main or the residual)
    # Token groups start at each sequence's first token after its sink, as they would for
    # the sequence alone: in a left-padded batch main row j of sequence b holds mask column
    # lead - phase[b] + j, so that every sequence's groups are whole groups of main rows
    # (rows before column lead are filler, never seen). None: no shift (an unpadded batch).
    phase: Tensor | None = None  # [B] int64 in [0, G)
    phase_max: int = 0  # phase.max() on the host: how far ahead of the columns main runs
    first_real: Tensor | None = None  # [B] int64 token index of each first real token (-1: none)
    # declared prefix rows, placed before each sequence's first real token; they hold no
    # mask column (transformers never sees them) and are never encoded (see kvq.runtime.prefix)
    prefix: PrefixRows | None = None

    @property
    def visible(self) -> int:
        """Mask columns: tokens still attended to (appended minus evicted)."""
        return self.lead + self.main.length + self.residual.length - self.settled

    def shared(self) -> LayerState:
        """The same rows, marked as seen by a fork: the next append copies them."""
        flat = {p: replace(f, shared=True) for p, f in self.flat.items()}
        main, residual = (replace(s, shared=True) for s in (self.main, self.residual))
        return replace(self, main=main, residual=residual, flat=flat)


EMPTY = LayerState(None, RowStore.empty(), 0, 0)

SEGMENT_SLOTS = 3  # row counts the planned kernel reads (`planned_layouts.MAX_SEGMENTS`)


@dataclass
class _DeviceRows:
    """A layer's segment row counts on the device, for replayable decode steps
    (`KvqLayer._replayable`): `counts` those of the committed `state`, `next` those of
    `pending`, the successor a step prepared in place (the kernel reads `next`; publishing
    copies it into `counts`), `delta` what a step adds; `bad` turns True once a row
    appended since was not finite or not storable (the deferred append checks)."""

    state: LayerState
    counts: Tensor  # int32 [SEGMENT_SLOTS]
    next: Tensor  # int32 [SEGMENT_SLOTS]
    delta: Tensor  # int32 [SEGMENT_SLOTS]
    bad: Tensor  # bool []
    pending: LayerState | None = None


@dataclass(frozen=True)
class Counted:
    """A replayable step's view for attention: the segments over the buffers' capacity
    and their row counts, on the device (for the kernel) and on the host (for any path
    that cuts the segments to their rows)."""

    segments: list[Segment]
    lengths: Tensor  # int32 [SEGMENT_SLOTS]
    rows: tuple[int, ...]


class KvqLayer(LayerEdits, CacheLayerMixin):
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
        prefix: PrefixKV | None = None,
        rotate: RopeFn | None = None,
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
        # rows wait exact in the residual window until a whole group of them can be encoded
        self.group_rows = key_codec.group_rows
        self.windowed = policy.residual_tokens > 0 or self.group_rows > 1
        self.is_sliding = sliding_window is not None
        self.unrotate, self.rope_table = unrotate, rope_table
        self.prefix_kv, self.rotate = prefix, rotate  # the artifact's prefix rows, RoPE
        self._rope: Rope | None = None
        self._in_lead: tuple | None = None  # (sink rows, lead, result) of `sink_in_lead`
        self._live: tuple | None = None  # (sink rows, result) of `live_sink`
        self._device_rows: _DeviceRows | None = None  # see `_replayable`
        self.replay = False  # replayable steps asked for (`QuantizedKVCache.prepare_replay`)
        self.state = EMPTY
        self.record_past = False  # see activate_past_recording
        self.is_initialized = True

    # --- append --------------------------------------------------------------------

    def prepare(
        self,
        key: Tensor,
        value: Tensor,
        positions: Tensor,
        real: Tensor | None = None,
        backend: str | None = None,
    ) -> LayerState:
        """Successor state with new rows appended.

        key, value: [B, H_kv, T, D] (key post-RoPE); positions: [B, T] RoPE positions;
        real: [B, T] bool, False for padding (None: all real); a sequence's first
        `sink_tokens` real rows are also kept exact. backend: where rows are quantized.
        """
        st = self.state
        if self._replayable(st, key, real, backend):
            return self._appended_in_place(st, key, value, positions)
        self._leave_device_rows()
        b, h, t, d = key.shape
        prefix = self._placed_prefix(st, b, positions, real, key.device)
        if self.policy.key_stage == "pre-rope":
            key = self.unrotate(key.float(), positions)
        sink, lead, skip = st.sink, st.lead, 0
        if self.policy.sink_tokens:
            if sink is None:
                sink = SinkRows.empty(b, h, self.policy.sink_tokens, d, self.sink_dtype, key.device)
            if not sink.full:
                real = torch.ones(b, t, dtype=torch.bool) if real is None else real
                sink, taken = sink.appended(key, value, positions, real.to(key.device), st.visible)
                if st.main.length == 0 and st.evicted == 0:
                    # still in the first columns, which every sequence has as its sink: rows
                    # taken in every sequence need no encoded copy
                    every = taken.all(0).long()  # [T]
                    skip = int(every.cumprod(0).sum())
                    lead += skip
        flat = dict(st.flat)
        main, residual = st.main, st.residual
        first_real, phase, phase_max = st.first_real, st.phase, st.phase_max
        if self.group_rows > 1 and not main.length:  # the groups' phase is not fixed yet
            first_real = _first_real(first_real, real, st.seen, b, key.device)
        key, value, positions = key[:, :, skip:], value[:, :, skip:], positions[:, skip:]
        settled = st.settled
        if t > skip and self.windowed:
            rows = {"k": key.to(self.sink_dtype), "v": value.to(self.sink_dtype)}
            residual = residual.prepared(rows, positions)
            columns = lead + main.length + residual.length - settled
            if not main.length and self.group_rows > 1:
                phase, phase_max = self._phase(first_real, lead, st.evicted)
            # encode the oldest whole groups beyond the R most recent rows
            move = self._encoded(columns - lead, phase_max) - main.length
            if move > 0:
                start = lead + main.length - settled  # column of the residual's first row
                first = self._group_start(first_real, lead, st.evicted)
                old, pos = _moved(residual, start, lead, phase, main.length, move, first)
                main = self._append_main(main, old["k"].float(), old["v"], flat, pos, backend)
                settled += move  # their exact rows stay until published (see kernel_mask)
        elif t > skip:
            main = self._append_main(main, key, value, flat, positions, backend)
        return replace(
            st, sink=sink, main=main, residual=residual, settled=settled, seen=st.seen + t,
            lead=lead, skipped=st.skipped + skip, flat=flat, prefix=prefix,
            phase=phase, phase_max=phase_max, first_real=first_real,
        )  # fmt: skip

    # --- the replayable decode step ------------------------------------------------------

    def _replayable(self, st: LayerState, key: Tensor, real: Tensor | None, backend) -> bool:
        """Whether this append is a replayable decode step: one token of every sequence
        (none padding) into the main rows' own buffers, keys after RoPE, rows of fixed
        width written by the Triton append kernels, and nothing else moving (no sink still
        filling, prefix, residual window or groups, sliding window). Decided from host
        values alone; any other append is host-driven (and the next replayable step then
        copies the row counts to the device afresh)."""
        if not self.replay:  # eager decoding keeps host counts and immediate checks
            return False
        if key.shape[2] != 1 or real is not None or self.windowed or self.is_sliding:
            return False
        if self.policy.key_stage != "post-rope" or self.prefix_kv is not None:
            return False
        if st.flat or st.phase is not None or st.settled or not st.main.fits(1):
            return False
        if st.sink is not None and not (st.sink.full and self.sink_in_lead(st)):
            return False
        for codec in (self.key_codec, self.value_codec):
            if not codec.fixed_width or codec.row_spec(key) is None:
                return False
        return resolve_backend(backend, key.device) == "triton"

    def _appended_in_place(self, st: LayerState, key: Tensor, value: Tensor, positions: Tensor):
        """The successor of a replayable step: the append kernels encode the new row into
        scratch rows, which go into the main buffers at the row the device counts
        (`RowStore.appended_at`); the device counts advance into their pending copy; the
        append checks are recorded on the device (`deferred_checks`). The same ops with
        the same host values, step after step: nothing reads the device."""
        dev = self._device_counts(st)
        seg = 0 if st.sink is None else 1  # the main rows' segment
        at = dev.counts[seg : seg + 1].long()  # [1] the first new row
        rows = {}
        with deferred_checks() as verdicts:
            for part, codec, x in (("k", self.key_codec, key), ("v", self.value_codec, value)):
                scratch = {
                    n: x.new_empty((*x.shape[:3], *shape), dtype=dtype)
                    for n, (shape, dtype) in codec.row_spec(x).items()
                }
                codec.append_into(x, scratch, 0)
                rows |= {f"{part}.{n}": r for n, r in scratch.items()}
        if verdicts:  # (uint8 and bool flags: cat promotes to uint8)
            dev.bad.logical_or_(torch.cat([v.reshape(-1) for v in verdicts]).any())
        main = st.main.appended_at(rows, positions, at)
        torch.add(dev.counts, dev.delta, out=dev.next)
        dev.pending = replace(st, main=main, seen=st.seen + 1)
        return dev.pending

    def _device_counts(self, st: LayerState) -> _DeviceRows:
        """The device row counts of committed state `st`: those of the last replayable step
        when `st` is the state it published, else new tensors made from the host counts (a
        catch-up step, after a prefill, growth, crop, reorder or fork: it alone copies
        counts to the device)."""
        dev = self._device_rows
        if dev is not None and dev.state is st:
            return dev
        self._leave_device_rows()
        seg = 0 if st.sink is None else 1
        host = [0] * SEGMENT_SLOTS
        host[seg] = st.main.length
        if st.sink is not None:
            host[0] = st.sink.slots
        device = st.main.positions.device
        counts = torch.tensor(host, dtype=torch.int32, device=device)
        delta = torch.tensor([int(i == seg) for i in range(SEGMENT_SLOTS)], dtype=torch.int32,
                             device=device)  # fmt: skip
        bad = torch.zeros((), dtype=torch.bool, device=device)
        self._device_rows = _DeviceRows(st, counts, torch.empty_like(counts), delta, bad)
        return self._device_rows

    def _leave_device_rows(self) -> None:
        """Before a host-driven append: read the deferred checks of the replayable steps
        since the counts were made (one sync, on a step that syncs anyway) and drop them."""
        dev, self._device_rows = self._device_rows, None
        if dev is not None and bool(dev.bad):
            raise KvqError(
                f"layer {self.layer_idx}: a row appended by a recent decode step holds NaN or "
                "Inf, or its scale overflows its dtype"
            )

    def committed(self, state: LayerState) -> LayerState:
        """`state`, about to be published by the cache: a successor prepared by a replayable
        step takes the device counts with it (a copy on the device)."""
        dev = self._device_rows
        if dev is not None and dev.pending is state:
            dev.counts.copy_(dev.next)
            dev.state, dev.pending = state, None
        return state

    def counted(self, state: LayerState) -> Counted | None:
        """For a successor a replayable step prepared: its segments over the buffers'
        capacity and their row counts (the sink slots, then the main rows); None for any
        other state (attention then reads `segments`)."""
        dev = self._device_rows
        if dev is None or dev.pending is not state:
            return None
        segments, main, d = [], state.main, self.key_codec.head_dim
        if state.sink is not None:
            r = state.sink.rows
            sink = (PackedRows("full", d, r["k"]), PackedRows("full", d, r["v"]))
            segments.append(Segment(*sink, state.sink.positions))
        key = self.key_codec.packed(strip_part(main.buffers, "k."), {})
        value = self.value_codec.packed(strip_part(main.buffers, "v."), {})
        segments.append(Segment(key, value, main.positions))
        rows = (*(s.rows for s in segments[:-1]), main.length)
        return Counted(segments, dev.next, rows)

    def replay_room(self) -> int:
        """Rows a captured replayable step may still append into the main buffers (0 when
        this layer's last step was host-driven)."""
        dev, st = self._device_rows, self.state
        if dev is None or dev.state is not st:
            return 0
        return st.main.capacity - st.main.length

    def reserve(self, tokens: int) -> None:
        """Room in the main buffers for `tokens` more single-token steps (see
        `QuantizedKVCache.reserve`); layers that never replay (rows waiting in a residual
        window, sliding windows) keep their own growth."""
        if not self.windowed and not self.is_sliding:
            st = self.state
            self.state = replace(st, main=st.main.reserved(tokens))

    def replayed(self, steps: int) -> None:
        """The host side of `steps` replayed replayable steps (`QuantizedKVCache.replayed`):
        the device already holds their rows and counts."""
        st = self.state
        main = replace(st.main, length=st.main.length + steps)
        self.state = self._device_rows.state = replace(st, main=main, seen=st.seen + steps)

    def _phase(self, first_real: Tensor | None, lead: int, evicted: int):
        """(phase [B] or None, its max): the shift that starts each sequence's groups at its
        first token after the sink (one device sync, when the first group is encoded)."""
        start = self._group_start(first_real, lead, evicted)
        if start is None:
            return None, 0
        phase = (lead - start) % self.group_rows
        top = int(phase.max())
        return (phase, top) if top else (None, 0)

    def _group_start(self, first_real: Tensor | None, lead: int, evicted: int) -> Tensor | None:
        """[B] each sequence's first column after its sink: where its groups start, and the
        first column it sees through main (the lead while no real token has arrived)."""
        if first_real is None:
            return None
        start = first_real + self.policy.sink_tokens - evicted
        return torch.where(first_real >= 0, start, torch.full_like(start, lead))

    def _placed_prefix(self, st: LayerState, batch: int, positions, real, device):
        """The prefix rows with every sequence whose first real token arrives now placed."""
        kv = self.prefix_kv
        if kv is None:
            return None
        prefix = st.prefix
        if prefix is None:
            heads, length, d = kv.key.shape
            prefix = PrefixRows.empty(batch, heads, length, d, self.sink_dtype, device)
        if prefix.all_placed:
            return prefix
        real = torch.ones(positions.shape, dtype=torch.bool) if real is None else real
        first_col = st.evicted + st.visible  # absolute column of the first new row
        return prefix.placed_for(kv, self.rotate, positions, real.to(device), first_col)

    def _encoded(self, columns: int, shift: int = 0) -> int:
        """Main rows encoded once `columns` columns follow the lead: whole groups beyond the
        R most recent, for a sequence whose groups are shifted by `shift` (its phase)."""
        if not self.windowed:
            return columns
        beyond = columns - self.policy.residual_tokens + shift
        # (never past the columns: with R < G a shifted sequence's rows may not exist yet)
        return max(0, min(beyond - beyond % self.group_rows, columns - columns % self.group_rows))

    def live_sink(self, state: LayerState) -> SinkRows | None:
        """state.sink, or None when no slot holds a row attention may still see (a sliding
        layer past its window has evicted them, or none is filled yet): attention then
        reads no sink segment and builds no sink mask. Read from the device once per
        change of the (immutable) sink rows."""
        sink = state.sink
        if sink is None:
            return None
        if self._live is None or self._live[0] is not sink:
            self._live = (sink, bool(sink.valid().any()))
        return sink if self._live[1] else None

    def sink_in_lead(self, state: LayerState) -> bool:
        """Every live sink slot holds a row in the lead columns (an unpadded batch, sinks
        filled and not evicted; or none live, `live_sink`), so a single query needs no
        mask. Read from the device once per change of the (immutable) sink rows, not at
        every decode step."""
        sink = self.live_sink(state)
        if sink is None:
            return True
        memo = self._in_lead
        if memo is None or memo[0] is not sink or memo[1] != state.lead:
            memo = (sink, state.lead, bool((sink.valid() & (sink.cols < state.lead)).all()))
            self._in_lead = memo
        return memo[2]

    def seen_encoded(self, state: LayerState, queries: int) -> Tensor | None:
        """[B or 1, Q]: how many main rows each of this forward's queries sees through their
        encoded copies (the main rows past that, it sees through their exact copies in the
        residual window); None when every query sees all of main and the residual once.

        Query i sees a row encoded iff that sequence, decoded alone one token at a time,
        would have encoded it by then: a forward of many tokens (prefill, chunked prefill,
        draft verification) and a padded batch then give every query what it gets alone.
        """
        if not state.settled:
            return None
        cols = state.visible - queries + 1 + torch.arange(queries)  # [Q] columns through query i
        x = cols - state.lead - self.policy.residual_tokens  # [Q]
        if state.phase is not None:
            x = x[None].to(state.phase.device) + state.phase[:, None]  # [B, Q]
        else:
            x = x[None]
        g = self.group_rows
        return (x - x % g).clamp(min=0, max=state.main.length)

    def _main_rows(self, rows: int) -> int:
        """Of `rows` tail rows (after the sink-only ones), how many are encoded: whole groups
        beyond the R most recent. A function of the count alone, however the rows arrived."""
        if not self.windowed:
            return rows
        beyond = max(0, rows - self.policy.residual_tokens)
        return beyond - beyond % self.group_rows

    def _append_main(self, main, key, value, flat, positions, backend) -> RowStore:
        """Encode new rows into the successor of `main`; flat entries are added to `flat`.

        On the triton backend a codec with an append kernel writes its codes and qparams
        straight into the store's pages (one launch per family and step); otherwise rows
        are encoded in torch and copied in.
        """
        kernels = resolve_backend(backend, key.device) == "triton"
        spec, encoded, direct = {}, {}, []
        together = self._encoded_together(key, value, kernels)
        for part, codec, x in (("k", self.key_codec, key), ("v", self.value_codec, value)):
            layout = codec.row_spec(x) if kernels else None
            if layout is not None:
                spec |= {f"{part}.{n}": s for n, s in layout.items()}
                direct.append((part, codec, x))
                continue
            rows, part_flat = together[part] if together else codec.encode(x)
            encoded |= {f"{part}.{n}": r for n, r in rows.items()}
            spec |= {f"{part}.{n}": (tuple(r.shape[3:]), r.dtype) for n, r in rows.items()}
            if part_flat:
                flat[part] = flat.get(part, FlatStore.empty()).prepared(part_flat)

        produced: dict[str, dict[str, Tensor]] = {}

        def write(buffers: dict[str, Tensor], start: int) -> None:
            for name, r in encoded.items():
                buffers[name][:, :, start : start + r.shape[2]] = r
            for part, codec, x in direct:
                produced[part] = codec.append_into(x, strip_part(buffers, f"{part}."), start)

        successor = main.prepared_into(spec, tuple(key.shape[:2]), positions, write)
        for part, part_flat in produced.items():
            if part_flat:
                flat[part] = flat.get(part, FlatStore.empty()).prepared(part_flat)
        return successor

    def _encoded_together(self, key: Tensor, value: Tensor, kernels: bool) -> dict | None:
        """{"k": (rows, flat), "v": ...} from one encode of keys and values stacked along the
        batch, when both sides encode alike row by row (`Codec.encodes_like`) and no append
        kernel takes them; else None."""
        if kernels or not self.key_codec.encodes_like(self.value_codec):
            return None
        if key.dtype != value.dtype or key.shape != value.shape:
            return None
        rows, flat = self.key_codec.encode(torch.cat([key, value]))  # [2B, H, T, D]
        assert not flat, "encodes_like promises rows only"
        b = key.shape[0]
        return {"k": ({n: r[:b] for n, r in rows.items()}, flat),
                "v": ({n: r[b:] for n, r in rows.items()}, flat)}  # fmt: skip

    def evict(self, state: LayerState) -> LayerState:
        """Drop columns a sliding-window layer can never attend to again.

        Keeps at least `window - 1` columns (what the next query needs) and only compacts
        once twice the window is stored; eviction is views into the same buffers
        (`RowStore.dropped_front`), so it costs no copy. While transformers records the
        past (assisted decoding may roll back), nothing is dropped until `crop`.
        """
        if self.record_past:
            return state
        return self._compacted(state)

    def _still_exact(self, state: LayerState) -> int:
        """Of the settled rows, how many some sequence still sees exact: none in an unpadded
        batch; in a padded one, the columns from lead + X - (G - 1) on, X = visible - lead - R,
        a bound on every sequence's first exact column whatever its phase."""
        if state.phase is None:
            return 0
        m = state.main.length
        x = state.visible - state.lead - self.policy.residual_tokens
        first = state.lead + max(0, min(m, x - self.group_rows + 1))
        return min(state.settled, state.lead + m - first)

    def _compacted(self, state: LayerState) -> LayerState:
        if state.settled and not self.record_past:  # no rollback can need the exact copies
            drop = state.settled - self._still_exact(state)
            state = replace(
                state,
                residual=state.residual.dropped_front(drop, copy=True),
                settled=state.settled - drop,
            )
        w = self.sliding_window
        if w is None or state.visible <= 2 * w:
            return state
        drop = state.visible - (w - 1)
        # main rows dropped: whole groups only (the mask hides what a group keeps too long);
        # the residual window is never evicted: it holds the most recent rows
        rows = min(max(0, drop - state.lead), state.main.length - state.settled)
        rows -= rows % self.group_rows
        drop = min(drop, state.lead) + rows
        flat = {
            p: f.dropped_front(int(row_ptr(state.main, p)[rows])) for p, f in state.flat.items()
        }
        return replace(
            state,
            sink=None if state.sink is None else state.sink.shifted(drop),
            main=state.main.dropped_front(rows),
            lead=max(0, state.lead - drop),
            evicted=state.evicted + drop,
            flat=flat,
        )

    # --- read ----------------------------------------------------------------------

    def segments(self, state: LayerState) -> list[Segment]:
        """The rows as attention segments: the prefix rows (post-RoPE, exact), the sink
        slots, then the encoded rows (see `kvq.runtime.sink.kernel_mask` for the mask)."""
        pre = self.policy.key_stage == "pre-rope"
        out = []
        if state.prefix is not None:
            r = state.prefix.rows
            key = PackedRows("full", self.key_codec.head_dim, r["k"])
            value = PackedRows("full", self.value_codec.head_dim, r["v"])
            out.append(Segment(key, value, state.prefix.positions))
        sink = self.live_sink(state)
        if sink is not None:
            key = PackedRows("full", self.key_codec.head_dim, sink.rows["k"], pre_rope=pre)
            value = PackedRows("full", self.value_codec.head_dim, sink.rows["v"])
            out.append(Segment(key, value, sink.positions))
        if state.main.length:
            rows = state.main.rows()
            flat = {p: f.entries(0, f.length) for p, f in state.flat.items()}
            key = self.key_codec.packed(strip_part(rows, "k."), flat.get("k", {}))
            if pre:
                key = replace(key, pre_rope=True)
            value = self.value_codec.packed(strip_part(rows, "v."), flat.get("v", {}))
            out.append(Segment(key, value, state.main.row_positions()))
        if state.residual.length:  # settled exact copies first, then the live window
            r = state.residual.rows()
            key = PackedRows("full", self.key_codec.head_dim, r["k"], pre_rope=pre)
            value = PackedRows("full", self.value_codec.head_dim, r["v"])
            out.append(Segment(key, value, state.residual.row_positions()))
        return out

    def rope(self, state: LayerState) -> Rope | None:
        """cos/sin tables covering every stored position (pre-RoPE keys only); grown on demand."""
        if self.policy.key_stage != "pre-rope" or not state.visible:
            return None
        tops = [s.row_positions().max() for s in (state.main, state.residual) if s.length]
        # (settled residual rows repeat main rows: their positions are already counted)
        if state.sink is not None:
            tops.append(state.sink.positions.max())
        top = int(torch.stack(tops).max())  # one device sync, not one per store
        if self._rope is None or self._rope[0].shape[0] <= top:
            self._rope = self.rope_table(max(1024, 1 << top.bit_length()))
        return self._rope

    def decoded(self, state: LayerState) -> tuple[Tensor, Tensor]:
        """The segments' rows decoded (prefix rows, sink slots, main rows, residual rows):
        key post-RoPE, value; each [B, H, kernel rows, D] float32."""
        rope = self.rope(state)
        keys, values = [], []
        for seg in self.segments(state):
            k = decode_packed(seg.key)
            keys.append(rotate(k, seg.positions, rope) if seg.key.pre_rope else k)
            values.append(decode_packed(seg.value))
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    def visible_rows(self, state: LayerState) -> tuple[Tensor, Tensor]:
        """The rows the next query sees, decoded, in mask-column order: key post-RoPE,
        value; each [B, H, visible, D] float32 (a sink row at its own column, each once)."""
        k, v = self.decoded(state)  # [B, H, kernel rows, D]
        if state.prefix is not None:  # the prefix holds no mask column (see `prefix_rows`)
            p = state.prefix.rows["k"].shape[2]
            k, v = k[:, :, p:], v[:, :, p:]
        b, h, _, d = k.shape
        c, m = state.visible, state.main.length
        everything = torch.ones(b, 1, 1, c, dtype=torch.bool, device=k.device)
        sink = self.live_sink(state)  # the sink slots `segments` read
        seen = kernel_mask(
            everything, sink, state.lead, m, state.residual.length, state.phase,
            self.seen_encoded(state, 1),
        )[:, 0, 0]  # fmt: skip  # [B, kernel rows]
        shift = 0 if state.phase is None else state.phase[:, None]
        cols = [(state.lead - shift + torch.arange(m, device=k.device)[None]).expand(b, m)]
        cols.append(torch.arange(c - state.residual.length, c, device=k.device)[None].expand(b, -1))
        if sink is not None:
            cols.insert(0, sink.cols)
        col = torch.cat(cols, dim=1)  # [B, kernel rows] mask column of each row
        bi, ri = seen.nonzero(as_tuple=True)
        out_k, out_v = k.new_zeros(b, h, c, d), v.new_zeros(b, h, c, d)
        out_k[bi, :, col[bi, ri]], out_v[bi, :, col[bi, ri]] = k[bi, :, ri], v[bi, :, ri]
        return out_k, out_v

    @staticmethod
    def prefix_rows(state: LayerState) -> tuple[Tensor, Tensor] | None:
        """The prefix rows as attention sees them: key post-RoPE, value, [B, H, P, D]
        float32 (a sequence not yet placed holds zeros); None without a prefix."""
        if state.prefix is None:
            return None
        return state.prefix.rows["k"].float(), state.prefix.rows["v"].float()

    # --- ledger --------------------------------------------------------------------

    def ledger_bytes(self, counted: set[int] | None = None) -> dict[str, int]:
        """Measured bytes per ledger category of the committed state. counted: addresses of
        static tensors already counted (a table the layers share is held, and counted, once)."""
        out = dict.fromkeys(
            ("codes", "qparams", "sparse", "sink", "residual", "full_precision", "prefix"), 0
        )
        if self.state.prefix is not None:
            out["prefix"] += self.state.prefix.nbytes()
        if self.state.sink is not None:
            out["sink"] += self.state.sink.nbytes()
        out["residual"] += sum(self.state.residual.nbytes().values())
        cats = {f"k.{n}": c for n, c in self.key_codec.categories().items()}
        cats |= {f"v.{n}": c for n, c in self.value_codec.categories().items()}
        for name, nbytes in self.state.main.nbytes().items():
            out[cats[name]] += nbytes
        for part, store in self.state.flat.items():
            for name, nbytes in store.nbytes().items():
                out[cats[f"{part}.{name}"]] += nbytes
        for codec in (self.key_codec, self.value_codec):
            for t in codec.static.values():
                if counted is None or t.data_ptr() not in counted:
                    out["qparams"] += t.nbytes
                    if counted is not None and t.nbytes:
                        counted.add(t.data_ptr())
        return out

    def allocated_bytes(self) -> int:
        st = self.state
        flat = sum(f.allocated_bytes() for f in st.flat.values())
        sink = 0 if st.sink is None else st.sink.allocated_bytes()
        sink += 0 if st.prefix is None else st.prefix.allocated_bytes()
        return sink + st.main.allocated_bytes() + st.residual.allocated_bytes() + flat

    # --- CacheLayerMixin -------------------------------------------------------------

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("KvqLayer is updated through QuantizedKVCache.update")

    def get_seq_length(self) -> int:
        return self.state.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if query_length < 1:  # the model would fail on empty tensors before any update()
            raise KvqError(
                f"a forward of no new tokens into a cache holding {self.state.seen}: generate "
                "continues a cache from a prompt that begins with the tokens it holds"
            )
        return self.state.visible + query_length, self.state.evicted

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state = EMPTY


def _first_real(known: Tensor | None, real: Tensor | None, seen: int, b: int, device) -> Tensor:
    """[B] token index of each sequence's first real token (-1: none yet), updated with a
    forward from token `seen` on; real: [B, T] bool (None: all real)."""
    if real is None:
        first = torch.full((b,), seen, dtype=torch.long, device=device)
    else:
        real = real.to(device)
        at = real.long().argmax(1)  # [B] first True (0 when none)
        first = torch.where(real.any(1), seen + at, torch.full_like(at, -1))
    if known is None:
        return first
    return torch.where(known >= 0, known, first)


def _moved(
    residual: RowStore,
    start: int,
    lead: int,
    phase: Tensor | None,
    main_rows: int,
    n: int,
    first: Tensor | None,
) -> tuple[dict[str, Tensor], Tensor]:
    """The residual rows that become main rows [main_rows, main_rows + n): rows {k, v}
    [B, H, n, D] and positions [B, n]. start: column of the residual's first row; with a
    phase, each sequence's rows come from its own columns. first: [B] each sequence's first
    column seen through main; rows before it (padding, sink rows, the filler before the lead)
    are stored as zeros, so that no group of them sets a scale from noise."""
    j = main_rows + torch.arange(n, device=residual.positions.device)[None]  # [1, n]
    col = lead + j if phase is None else lead - phase[:, None] + j  # [B or 1, n]
    if phase is None:
        at = lead + main_rows - start
        rows, pos = residual.rows(at, at + n), residual.row_positions(at, at + n)
    else:
        idx = (col - start).clamp(min=0)  # (filler: columns before the lead, zeroed below)
        rows = {}
        for name, r in residual.rows().items():  # [B, H, L, D]
            b, h, _, d = r.shape
            rows[name] = r.gather(2, idx[:, None, :, None].expand(b, h, n, d))
        pos = residual.row_positions().gather(1, idx)
        first = torch.full_like(phase, lead) if first is None else first.clamp(min=lead)
    if first is None:
        return rows, pos
    seen = col >= first[:, None]  # [B, n]
    keep = seen[:, None, :, None]
    return {name: r * keep.to(r.dtype) for name, r in rows.items()}, pos * seen
