"""QuantizedKVCache: a transformers `Cache` whose layers store packed codes.

The cache is the state machine of article 0x05: a forward pass appends the
same positions to every layer. Each layer's new rows are *prepared* into a
private successor state (the current forward attends through it), and the
successors of all layers are *published* together only after the last layer
has attended. A forward that fails midway publishes nothing: the next forward
discards the stale transaction and starts again from the committed state, so
an append is visible in all layers at once or not at all.
"""

from __future__ import annotations

import copy
import hashlib
import json
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from kvq.errors import CacheArgumentError, KvqError
from kvq.manifests.ledger import ByteLedger
from kvq.models.fingerprint import config_sha256, tensor_sha256, weights_sha256
from kvq.quant.schemes import CachePolicy
from kvq.runtime.attention import install_attention
from kvq.runtime.codecs import make_codec
from kvq.runtime.kernels.backend import check_choice
from kvq.runtime.kernels.decode.segments import Rope
from kvq.runtime.layers import KvqLayer, LayerState
from kvq.runtime.prefix import Prefix
from kvq.runtime.view import LayerView


@dataclass
class _Transaction:
    """New rows of one forward: waiting for their layer's attention call (`pending`,
    which brings the mask that tells padding apart), then private successors."""

    base_seen: int
    pending: dict[int, tuple[Tensor, Tensor, Tensor]] = field(default_factory=dict)
    prepared: dict[int, LayerState] = field(default_factory=dict)
    query_len: int = 0
    positions: Tensor | None = None  # [B, T] RoPE positions of the new rows (all layers)


class QuantizedKVCache(Cache):
    """A K/V cache storing packed codes and qparams per a `CachePolicy`.

    Build it with `kvq.runtime.build_cache` (from an artifact or a named policy)
    rather than directly: that also installs the kvq attention function.
    """

    def __init__(
        self,
        layers: list[KvqLayer],
        policy: CachePolicy,
        backend: str | None = None,
        identity: dict[str, str] | None = None,
    ):
        super().__init__(layers=layers)
        self.policy = policy
        # what saved state must match: model config, artifact, layout (see kvq.runtime.saved)
        self.identity = dict(identity or {})
        self.max_position: int | None = None  # the model's context, set by build_cache
        self._pre_rope = any(lp.key_stage == "pre-rope" for lp in policy.layers)
        self.backend = None if backend is None else check_choice(backend)  # None: KVQ_BACKEND
        self._txn: _Transaction | None = None
        self.publications = 0  # number of published appends, for tests and telemetry
        self.kv_heads: int | None = None  # the model's KV heads, set by `bind`
        self._model: weakref.ref | None = None
        self._modules: weakref.WeakSet = weakref.WeakSet()

    def bind(self, model, kv_heads: int) -> None:
        """Serve `model` only: its attention modules may use this cache, no other's."""
        self._model, self.kv_heads = weakref.ref(model), kv_heads
        self._modules = weakref.WeakSet(m for m in model.modules() if hasattr(m, "layer_idx"))

    @property
    def model(self):
        """The model this cache was built for (None when unbound or collected)."""
        return None if self._model is None else self._model()

    def serves(self, module: torch.nn.Module) -> bool:
        """Whether an attention `module` belongs to the model this cache was built for
        (None: a direct call with no module, which has nothing to check)."""
        return self._model is None or module is None or module in self._modules

    def weights_identity(self) -> str:
        """The bound model's weights fingerprint now (kvq.models.fingerprint.weights_sha256)."""
        model = self.model
        if model is None:
            raise KvqError("the model this cache was built for is gone; its rows cannot be named")
        return weights_sha256(model)

    # --- the append transaction ----------------------------------------------------------

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Prepare new rows for `layer_idx`; returns views for the kvq attention function."""
        extra = kwargs.get("kwargs") or {}
        self._check_rows(key_states, value_states, layer_idx)
        t = key_states.shape[2]
        if layer_idx == 0 or self._txn is None:
            # a new forward; a leftover transaction belongs to a failed one: discard it
            self._txn = _Transaction(base_seen=self.get_seq_length(), query_len=t)
        txn = self._txn
        if layer_idx in txn.prepared:
            raise KvqError(f"layer {layer_idx} prepared twice in one forward")
        if t != txn.query_len:
            raise KvqError(f"layer {layer_idx} appends {t} rows, expected {txn.query_len}")
        positions = extra.get("position_ids")
        if positions is None:
            positions = torch.arange(txn.base_seen, txn.base_seen + t, device=key_states.device)
        positions = positions.to(torch.long).expand(key_states.shape[0], t)
        txn.positions = positions
        if layer_idx == 0 and self.max_position is not None and self._pre_rope:
            top = int(positions.max())  # pre-RoPE keys re-rotate from tables that stop there
            if top >= self.max_position:
                self._txn = None
                raise KvqError(
                    f"position {top} is past the model's context of {self.max_position} "
                    "tokens; this cache stores pre-RoPE keys only within it"
                )
        txn.pending[layer_idx] = (key_states, value_states, positions)
        view = LayerView(self, self.layers[layer_idx])
        return view, view

    def _check_rows(self, key: Tensor, value: Tensor, layer_idx: int) -> None:
        """Refuse rows this cache cannot hold, in one sentence, before anything changes.

        A cache serves one batch for its life, as transformers' own caches do (theirs fail
        in torch.cat): a forward of another batch size is refused; change the batch first
        with batch_select_indices / batch_repeat_interleave, or start a new cache."""
        if type(layer_idx) is not int or not 0 <= layer_idx < len(self.layers):
            raise KvqError(
                f"layer_idx {layer_idx!r} is not a layer of this {len(self.layers)}-layer cache"
            )
        layer = self.layers[layer_idx]
        for name, x, d in (
            ("key", key, layer.key_codec.head_dim),
            ("value", value, layer.value_codec.head_dim),
        ):
            if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
                what = f"{x.dtype} {list(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
                raise KvqError(
                    f"{name}_states must be a floating-point [batch, kv_heads, tokens, head_dim] "
                    f"tensor, got {what}"
                )
            heads = x.shape[1] if self.kv_heads is None else self.kv_heads
            if x.shape[1] != heads or x.shape[3] != d or x.shape[2] == 0:
                raise KvqError(
                    f"{name}_states are [{', '.join(map(str, x.shape))}]; layer {layer_idx} "
                    f"holds rows of {heads} KV heads × {d} channels (and needs at least a token)"
                )
        if key.shape[:3] != value.shape[:3]:
            raise KvqError(
                f"key_states {list(key.shape)} and value_states {list(value.shape)} differ"
            )
        held = layer.batch_size
        if held and key.shape[0] != held:
            raise KvqError(
                f"this cache holds {held} sequences, the forward brings {key.shape[0]}; a cache "
                "serves one batch (batch_select_indices / batch_repeat_interleave change it, or "
                "start a new cache)"
            )

    def _prepare(self, layer_idx: int, mask: Tensor | None) -> LayerState:
        """The pending rows of `layer_idx` as its private successor.

        mask: [B, 1, Q, C] bool over the mask columns (None: causal, nothing padded); a new
        row is real (not padding) when its own query may attend to it.
        """
        txn = self._txn
        if txn is None or layer_idx not in txn.pending:
            raise KvqError(f"layer {layer_idx} has no rows waiting for attention")
        key, value, positions = txn.pending.pop(layer_idx)
        real = None
        if mask is not None:
            b, t = key.shape[0], key.shape[2]
            diag = torch.arange(t, device=mask.device)
            cols = mask.shape[-1] - t + diag
            real = mask.expand(b, 1, t, mask.shape[-1])[:, 0, diag, cols]  # [B, T]
        layer = self.layers[layer_idx]
        txn.prepared[layer_idx] = layer.prepare(key, value, positions, real, self.backend)
        return txn.prepared[layer_idx]

    def attended(self, layer_idx: int) -> None:
        """Called by the attention function once a layer has read its private view."""
        txn = self._txn
        if (
            txn is not None
            and len(txn.prepared) == len(self.layers)
            and layer_idx == len(self.layers) - 1
        ):
            self._publish(txn)

    def _publish(self, txn: _Transaction) -> None:
        # every layer's successor exists; swap them in together, then evict
        for idx, layer in enumerate(self.layers):
            layer.state = layer.evict(layer.committed(txn.prepared[idx]))
        self._txn = None
        self.publications += 1

    def abort(self) -> None:
        """Forget the pending transaction (the committed state is untouched)."""
        self._txn = None

    # --- CUDA graphs ----------------------------------------------------------------------

    def replay_room(self) -> int:
        """Single-token decode steps that a captured step may still replay: the rows left
        in the fullest layer's main buffers; 0 when some layer's last step was host-driven
        (`KvqLayer._replayable`: then nothing is captured that replays)."""
        return min((layer.replay_room() for layer in self.layers), default=0)

    def prepare_replay(self, tokens: int = 0) -> None:
        """Take replayable decode steps from now on (the prelude to capturing one in a
        CUDA graph: README "Decode steps in CUDA graphs"), with room for `tokens` more
        (`reserve`). Until then every step is host-driven: eager decoding keeps its host
        row counts and refuses a non-finite row at the step that appends it."""
        for layer in self.layers:
            layer.replay = True
        if tokens:
            self.reserve(tokens)

    def reserve(self, tokens: int) -> None:
        """Grow every layer's main buffers now to hold `tokens` more tokens, so that a
        captured decode step replays that many times (`replay_room`) without an eager step
        growing them in between (a copy of the rows held; no-op where they fit). The
        next step copies the row counts to the device again: capture after it."""
        if self._txn is not None:
            raise KvqError("reserve() in the middle of a forward")
        for layer in self.layers:
            layer.reserve(tokens)

    def replayed(self, steps: int) -> None:
        """The host side of `steps` decode steps that a CUDA graph replayed.

        A captured step (every layer's append and attention, each replayable) holds its
        device side — rows written where the device row counts say, counts moved on — but
        a replay runs no Python, so the committed host state (tokens seen, rows held)
        stays where the capture left it. A runner calls this after its replays; the
        capture itself ran the host side of one step, so after n replays, `replayed(n -
        1)`. Refused past `replay_room` (the buffers would have overflowed: re-capture
        after an eager step grows them) or in the middle of a forward."""
        if self._txn is not None:
            raise KvqError("replayed() in the middle of a forward")
        room = self.replay_room()
        if not 0 <= steps <= room:
            raise KvqError(f"{steps} replayed steps, but a captured step has room for {room}")
        for layer in self.layers:
            layer.replayed(steps)
        self.publications += steps

    # --- state beyond one request -------------------------------------------------------

    def fork(self) -> QuantizedKVCache:
        """A second cache over the same rows (a shared prompt, two continuations).

        Copy on write: both caches share the stored pages until either side appends,
        which copies that side's rows first; neither ever sees the other's tokens.
        """
        if self._txn is not None:
            raise KvqError("cannot fork a cache in the middle of a forward")
        twin = copy.copy(self)
        twin.layers = [copy.copy(layer) for layer in self.layers]
        for mine, theirs in zip(self.layers, twin.layers, strict=True):
            mine.state = theirs.state = mine.state.shared()
        return twin

    def release(self, finished: Tensor) -> Tensor:
        """Free the rows of sequences that finished inside a batch.

        finished: [B] bool. Returns the batch indices kept, in order (index the caller's
        own per-sequence tensors with it).
        """
        if (
            not isinstance(finished, Tensor)
            or finished.dtype != torch.bool
            or finished.shape != (self.batch_size,)
        ):
            raise KvqError(f"release needs a [{self.batch_size}] bool tensor of finished rows")
        keep = (~finished).nonzero(as_tuple=True)[0]
        self.batch_select_indices(keep)
        return keep

    def reorder_cache(self, beam_idx) -> None:
        """Batch rows picked by `beam_idx` ([B'] integer indices, repeats allowed)."""
        super().reorder_cache(self._batch_index(beam_idx, "reorder_cache"))

    def batch_select_indices(self, indices) -> None:
        super().batch_select_indices(self._batch_index(indices, "batch_select_indices"))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if type(repeats) is not int or repeats < 1:
            raise KvqError(f"batch_repeat_interleave needs a positive int, got {repeats!r}")
        super().batch_repeat_interleave(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (transformers 5: a negative count)."""
        if type(tokens_to_remove) is not int or tokens_to_remove > 0:
            raise CacheArgumentError(
                f"crop({tokens_to_remove!r}): pass a negative int, the tokens to remove, as "
                "transformers' caches expect"
            )
        if self._txn is not None and self._txn.prepared:
            raise KvqError("cannot crop a cache in the middle of a forward")
        self._txn = None
        super().crop(tokens_to_remove)

    def _batch_index(self, index, what: str) -> Tensor:
        """`index` as a [B'] long tensor of the held sequences, or a one-line KvqError."""
        if isinstance(index, (list, tuple)):
            if not all(type(i) is int for i in index):
                raise KvqError(f"{what} needs integer indices, got {index!r}"[:200])
            index = torch.tensor(index, dtype=torch.long)
        if (
            not isinstance(index, Tensor)
            or index.dim() != 1
            or index.is_floating_point()
            or index.dtype == torch.bool
        ):
            what_got = (
                f"{index.dtype} {list(index.shape)}"
                if isinstance(index, Tensor)
                else type(index).__name__
            )
            raise KvqError(f"{what} needs a 1-D integer tensor of batch indices, got {what_got}")
        held = self.batch_size
        if held and index.numel() and not (int(index.min()) >= 0 and int(index.max()) < held):
            raise KvqError(
                f"{what}: indices {int(index.min())}..{int(index.max())} are outside the "
                f"{held} sequences this cache holds"
            )
        if self._txn is not None and self._txn.prepared:
            raise KvqError(f"cannot {what} in the middle of a forward")
        self._txn = None
        return index

    def save(self, path) -> None:
        """Write the committed state to a safetensors file (see `kvq.runtime.saved`); read it
        back with `kvq.load_cache`."""
        from kvq.runtime.saved import save_cache

        save_cache(self, path)

    # --- measurements ----------------------------------------------------------------

    def nbytes(self) -> ByteLedger:
        """The byte ledger measured from the stored tensors of the committed state."""
        totals = dict.fromkeys(
            ("codes", "qparams", "sparse", "sink", "residual", "full_precision", "prefix"), 0
        )
        fp16, counted = 0, set()  # static tensors the layers share: counted once
        for layer in self.layers:
            for cat, n in layer.ledger_bytes(counted).items():
                totals[cat] += n
            b = layer.batch_size
            head_dim = layer.key_codec.head_dim
            heads = _heads(layer)
            # what the same retained rows would cost as fp16 K and V (the user's rows: the
            # prefix's bytes are the cost of the method, counted in `prefix`)
            fp16 += 2 * 2 * b * heads * layer.state.visible * head_dim
        tokens = max((layer.state.seen for layer in self.layers), default=0)
        batch = max((layer.batch_size for layer in self.layers), default=0)
        return ByteLedger(tokens=tokens * batch, fp16_bytes=fp16, **totals)

    def allocated_bytes(self) -> int:
        return sum(layer.allocated_bytes() for layer in self.layers)

    @property
    def max_batch_size(self) -> int:
        """Sequences the cache holds (it grows on demand: no fixed maximum)."""
        return max((layer.batch_size for layer in self.layers), default=0)


def _heads(layer: KvqLayer) -> int:
    for buf in layer.state.main.buffers.values():
        return buf.shape[1]
    for rows in (layer.state.sink, layer.state.prefix):
        if rows is not None:
            return rows.rows["k"].shape[1]
    return 0


def unit_scales(policy: CachePolicy) -> dict[str, Tensor]:
    """Static scales of exactly 1.0 for every per-tensor static scheme of `policy`: the
    state of a calibration-free policy such as "fp8-e4m3" (what engines use uncalibrated)."""
    from kvq.quant.qparams import storage_dtype

    state = {}
    for i, layer in enumerate(policy.layers):
        for part, scheme in (("key", layer.key), ("value", layer.value)):
            if scheme.stored and scheme.lifetime == "static":
                if scheme.axis != "tensor":
                    raise KvqError(f"layers.{i}.{part}: unit scales are per tensor only")
                state[f"layers.{i}.{part}.scale"] = torch.ones(
                    1, dtype=storage_dtype(scheme.scale_dtype)
                )
    return state


def _share_equal_tables(layers: list[KvqLayer]) -> None:
    """Trellis tables fitted once for many layers are stored per layer in the artifact (each
    layer's state is self-contained); in the cache equal tables become one tensor, held and
    counted in the ledger once."""
    seen: list[tuple[Tensor, Tensor]] = []  # (stored table, the codecs' float32 copy)
    for layer in layers:
        for codec in (layer.key_codec, layer.value_codec):
            table = codec.static.get("trellis_table")
            if table is None:
                continue
            same = [s for s in seen if s[0].dtype == table.dtype and torch.equal(s[0], table)]
            if same:
                codec.static["trellis_table"], codec.table = same[0]
            else:
                seen.append((table, codec.table))


def build_cache(
    model,
    policy: CachePolicy,
    static: dict[str, Tensor],
    adapter,
    backend: str | None = None,
    prefix: Prefix | None = None,
) -> QuantizedKVCache:
    """A fresh cache for `model` following `policy`.

    static: artifact tensors named "layers.{i}.{key|value}.{name}" (static qparams).
    prefix: the rows of `policy.prefix` (`kvq.runtime.prefix.load_prefix`), seeded before
    each sequence's first real token; required exactly when the policy declares one.
    adapter: the model's `ArchitectureAdapter` (RoPE, head layout, windows).
    backend: "auto" | "triton" | "reference" for attention; None reads KVQ_BACKEND.
    """
    info = adapter.info
    seeded = prefix  # (`prefix` names tensor name prefixes below)
    if policy.num_layers != info.num_layers:
        raise KvqError(f"policy has {policy.num_layers} layers, model has {info.num_layers}")
    if (prefix is None) != (policy.prefix is None):
        raise KvqError("a policy with a prefix needs its rows, and rows need such a policy")
    if prefix is not None:
        if prefix.spec != policy.prefix or len(prefix.layers) != info.num_layers:
            raise KvqError("the prefix rows do not belong to this policy")
        for i, kv in enumerate(prefix.layers):
            if kv.key.shape[0] != info.num_kv_heads or kv.key.shape[2] != info.head_dim:
                raise KvqError(
                    f"layers.{i}.prefix rows are [{kv.key.shape[0]}, P, {kv.key.shape[2]}], "
                    f"the model has {info.num_kv_heads} KV heads of {info.head_dim}"
                )
    install_attention(model)
    dtype = next(model.parameters()).dtype
    ropes = _RopeTables(adapter, info.head_dim)
    layers = []
    for i, lp in enumerate(policy.layers):
        pre_rope = lp.key_stage == "pre-rope"
        rope_table = ropes.for_layer(i, needed=pre_rope)
        codecs = []
        for part, scheme in (("key", lp.key), ("value", lp.value)):
            prefix = f"layers.{i}.{part}."
            state = {n[len(prefix) :]: t for n, t in static.items() if n.startswith(prefix)}
            codecs.append(make_codec(scheme, info.head_dim, dtype, state, prefix[:-1]))
        layers.append(
            KvqLayer(
                layer_idx=i,
                policy=lp,
                key_codec=codecs[0],
                value_codec=codecs[1],
                activation_dtype=dtype,
                sliding_window=adapter.sliding_window(i),
                unrotate=_rope_fn(adapter, i, inverse=True, table=rope_table if pre_rope else None),
                rope_table=rope_table,
                prefix=None if seeded is None else seeded.layers[i],
                rotate=_rope_fn(adapter, i, inverse=False),
            )
        )
    _share_equal_tables(layers)
    named = dict(static) | ({} if seeded is None else seeded.tensors())
    identity = {
        "model": config_sha256(model.config),
        "policy": _digest(policy.to_json()),
        "artifact": _digest({n: tensor_sha256(t) for n, t in sorted(named.items())}),
    }
    cache = QuantizedKVCache(layers, policy, backend, identity)
    cache.max_position = adapter.max_positions
    cache.bind(model, info.num_kv_heads)
    return cache


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


class _RopeTables:
    """cos/sin tables [n, D/2] for pre-RoPE keys, one per distinct RoPE of the model.

    Layers with the same RoPE (Gemma 3's 15 sliding layers, say) share one table, grown
    by doubling and filled a chunk of positions at a time: a sequence at position 100,000
    costs two tables of 131,072 rows (268 MB for Gemma 3 270M), not one per layer plus a
    dense [n, D] intermediate each (5 GB). Rotate-half pairs share their angle, so half
    the table suffices.
    """

    CHUNK = 8192  # positions computed per call of the model's rotary module

    def __init__(self, adapter, head_dim: int):
        self.adapter, self.head_dim = adapter, head_dim
        self.tables: dict[object, Rope] = {}

    def for_layer(self, layer_idx: int, needed: bool):
        """n -> the layer's (cos, sin), covering at least positions 0..n-1."""
        key = self.adapter.info.rope[layer_idx]

        def table(n: int) -> Rope:
            limit = self.adapter.max_positions  # never past the context (refused earlier)
            n = min(n, limit) if limit else n
            have = self.tables.get(key)
            if have is None or have[0].shape[0] < n:
                self.tables[key] = have = self._build(layer_idx, n)
            return have

        if needed:
            table(1)  # refuse a partial-rotary model when the cache is built, not mid-forward
        return table

    def _build(self, layer_idx: int, n: int) -> Rope:
        half = self.head_dim // 2
        cos, sin = torch.empty(n, half), torch.empty(n, half)
        for start in range(0, n, self.CHUNK):
            stop = min(n, start + self.CHUNK)
            c, s = self.adapter.rope_cos_sin(layer_idx, torch.arange(start, stop))
            if c.shape[-1] != self.head_dim:
                raise KvqError(
                    f"layer {layer_idx}: pre-RoPE keys need RoPE over the whole head "
                    f"({c.shape[-1]} of {self.head_dim} channels rotate)"
                )
            cos[start:stop], sin[start:stop] = c[:, :half], s[:, :half]
        return cos.to(c.device), sin.to(c.device)


def _rope_fn(adapter, layer_idx: int, inverse: bool, table=None):
    """(x [B, H, T, D], positions [B, T]) -> x rotated (or back). table: the layer's cos/sin
    table (`_RopeTables`, whole-head RoPE), read instead of calling the model's rotary
    module on every append: the same values, as the module fills the table."""

    def fn(x: Tensor, positions: Tensor) -> Tensor:
        # positions [B, T] -> cos/sin [B, 1, T, rotary_dim]
        b, t = positions.shape
        lo, top = torch.stack(positions.aminmax()).tolist() if table is not None else (0, 0)
        if table is not None and lo >= 0:  # (a table has no negative positions)
            half = table(max(1024, 1 << top.bit_length()))  # what decode attention asks
            cos, sin = (torch.cat((h, h), -1) for h in (c[positions] for c in half))
            cos, sin = cos[:, None].to(x.device), sin[:, None].to(x.device)
        else:
            cos, sin = adapter.rope_cos_sin(layer_idx, positions.reshape(-1))
            cos = cos.view(b, 1, t, -1).to(x.device)
            sin = sin.view(b, 1, t, -1).to(x.device)
        op = adapter.invert_rope if inverse else adapter.apply_rope
        return op(x, cos, sin)

    return fn
