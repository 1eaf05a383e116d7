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

from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from kvq.errors import KvqError
from kvq.manifests.ledger import ByteLedger
from kvq.quant.schemes import CachePolicy
from kvq.runtime.attention import install_attention
from kvq.runtime.codecs import make_codec
from kvq.runtime.kernels.backend import check_choice
from kvq.runtime.kernels.decode_attention import Rope
from kvq.runtime.layers import KvqLayer, LayerState


@dataclass
class _Transaction:
    """Private successors of the layers prepared so far in one forward."""

    base_seen: int
    prepared: dict[int, LayerState] = field(default_factory=dict)
    query_len: int = 0


@dataclass(frozen=True)
class LayerView:
    """What `update` hands to the attention function instead of K/V tensors.

    It carries the layer and the transaction-private successor state so the
    kvq attention function can decode the packed rows chunk by chunk.
    """

    cache: QuantizedKVCache
    layer: KvqLayer
    state: LayerState

    @property
    def shape(self) -> tuple[int, ...]:  # informative only; never a real tensor
        return (-1, -1, self.state.visible, -1)


class QuantizedKVCache(Cache):
    """A K/V cache storing packed codes and qparams per a `CachePolicy`.

    Build it with `kvq.runtime.build_cache` (from an artifact or a named policy)
    rather than directly: that also installs the kvq attention function.
    """

    def __init__(self, layers: list[KvqLayer], policy: CachePolicy, backend: str | None = None):
        super().__init__(layers=layers)
        self.policy = policy
        self.backend = None if backend is None else check_choice(backend)  # None: KVQ_BACKEND
        self._txn: _Transaction | None = None
        self.publications = 0  # number of published appends, for tests and telemetry

    # --- the append transaction ----------------------------------------------------------

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Prepare new rows for `layer_idx`; returns views for the kvq attention function."""
        extra = kwargs.get("kwargs") or {}
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
        layer = self.layers[layer_idx]
        txn.prepared[layer_idx] = layer.prepare(key_states, value_states, positions, self.backend)
        view = LayerView(self, layer, txn.prepared[layer_idx])
        return view, view

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
            layer.state = layer.evict(txn.prepared[idx])
        self._txn = None
        self.publications += 1

    def abort(self) -> None:
        """Forget the pending transaction (the committed state is untouched)."""
        self._txn = None

    # --- measurements ----------------------------------------------------------------

    def nbytes(self) -> ByteLedger:
        """The byte ledger measured from the stored tensors of the committed state."""
        totals = dict.fromkeys(
            ("codes", "qparams", "sparse", "sink", "residual", "full_precision"), 0
        )
        fp16 = 0
        for layer in self.layers:
            for cat, n in layer.ledger_bytes().items():
                totals[cat] += n
            b = layer.batch_size()
            head_dim = layer.key_codec.head_dim
            heads = _heads(layer)
            # what the same retained rows would cost as fp16 K and V
            fp16 += 2 * 2 * b * heads * layer.state.visible * head_dim
        tokens = max((layer.state.seen for layer in self.layers), default=0)
        batch = max((layer.batch_size() for layer in self.layers), default=0)
        return ByteLedger(tokens=tokens * batch, fp16_bytes=fp16, **totals)

    def allocated_bytes(self) -> int:
        return sum(layer.allocated_bytes() for layer in self.layers)


def _heads(layer: KvqLayer) -> int:
    for store in (layer.state.main, layer.state.sink):
        for buf in store.buffers.values():
            return buf.shape[1]
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


def build_cache(
    model, policy: CachePolicy, static: dict[str, Tensor], adapter, backend: str | None = None
) -> QuantizedKVCache:
    """A fresh cache for `model` following `policy`.

    static: artifact tensors named "layers.{i}.{key|value}.{name}" (static qparams).
    adapter: the model's `ArchitectureAdapter` (RoPE, head layout, windows).
    backend: "auto" | "triton" | "reference" for attention; None reads KVQ_BACKEND.
    """
    info = adapter.info
    if policy.num_layers != info.num_layers:
        raise KvqError(f"policy has {policy.num_layers} layers, model has {info.num_layers}")
    install_attention(model)
    dtype = next(model.parameters()).dtype
    ropes = _RopeTables(adapter, info.head_dim)
    layers = []
    for i, lp in enumerate(policy.layers):
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
                unrotate=_rope_fn(adapter, i, inverse=True),
                rope_table=ropes.for_layer(i, needed=lp.key_stage == "pre-rope"),
            )
        )
    return QuantizedKVCache(layers, policy, backend)


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


def _rope_fn(adapter, layer_idx: int, inverse: bool):
    def fn(x: Tensor, positions: Tensor) -> Tensor:
        # positions [B, T] -> cos/sin [B, 1, T, rotary_dim]
        b, t = positions.shape
        cos, sin = adapter.rope_cos_sin(layer_idx, positions.reshape(-1))
        cos = cos.view(b, 1, t, -1).to(x.device)
        sin = sin.view(b, 1, t, -1).to(x.device)
        op = adapter.invert_rope if inverse else adapter.apply_rope
        return op(x, cos, sin)

    return fn
