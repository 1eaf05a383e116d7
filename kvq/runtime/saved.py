"""A cache's committed state in a safetensors file, and back (article 0x05E).

Saved state is only meaningful for the model, artifact and layout that wrote it: a
prefix reused under another schema silently decodes garbage. The header therefore
records the cache's identity (model config, layout, static tensors), and loading
refuses any mismatch with a one-line error before reading a single row.

File layout: tensors `layers.{i}.main.{name}` [B, H, T, ...] (committed rows only),
`layers.{i}.main.positions` [B, T], `layers.{i}.residual.{k|v|positions}` (exact recent rows), `layers.{i}.flat.{k|v}.{name}` [E],
`layers.{i}.sink.{k|v|positions|cols|filled}`, `layers.{i}.{phase|first_real}` [B] (a
padded batch's group shifts), `layers.{i}.prefix.{k|v|positions|placed|first_col}` (the
placed prefix rows: the prefix's own tensors are part of the artifact, which the identity
names); metadata "kvq" = JSON of the identity (model config and weights, artifact,
layout), each layer's index and counters, and every tensor's sha256 (dtype, shape, bytes);
metadata "kvq_sha256" = the sha256 of that JSON text. Loading checks all of them, so a
flipped byte anywhere, layers swapped or a state saved by other weights is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvq.artifacts.paths import is_artifact_dir
from kvq.errors import KvqError
from kvq.models.fingerprint import tensor_sha256
from kvq.quant import sparse
from kvq.runtime.prefix import PrefixRows
from kvq.runtime.sink import SinkRows
from kvq.runtime.state import FlatStore, RowStore

FORMAT = "kvq-cache-state/2"  # /1 (no checksums) is refused: save it again
COUNTERS = ("seen", "evicted", "lead", "settled", "skipped")  # LayerState's integers


def save_cache(cache, path) -> None:
    """Write `cache`'s committed state to `path` (a .safetensors file), atomically."""
    if cache._txn is not None and cache._txn.prepared:
        raise KvqError("cannot save a cache in the middle of a forward")
    path = _check_destination(path)
    tensors, layers = {}, []
    for i, layer in enumerate(cache.layers):
        st = layer.state
        pre = f"layers.{i}."
        for name, rows in st.main.rows().items():
            tensors[f"{pre}main.{name}"] = rows
        if st.main.positions is not None:
            tensors[f"{pre}main.positions"] = st.main.row_positions()
        for name, rows in st.residual.rows().items():
            tensors[f"{pre}residual.{name}"] = rows
        if st.residual.positions is not None:
            tensors[f"{pre}residual.positions"] = st.residual.row_positions()
        for part, store in st.flat.items():
            for name, entries in store.entries(0, store.length).items():
                tensors[f"{pre}flat.{part}.{name}"] = entries
        if st.sink is not None:
            tensors |= {f"{pre}sink.{n}": r for n, r in st.sink.rows.items()}
            for n in ("positions", "cols", "filled"):
                tensors[f"{pre}sink.{n}"] = getattr(st.sink, n)
        for n in ("phase", "first_real"):
            if getattr(st, n) is not None:
                tensors[f"{pre}{n}"] = getattr(st, n)
        if st.prefix is not None:
            tensors |= {f"{pre}prefix.{n}": r for n, r in st.prefix.rows.items()}
            for n in ("positions", "placed", "first_col"):
                tensors[f"{pre}prefix.{n}"] = getattr(st.prefix, n)
        layers.append({"layer": i} | {k: getattr(st, k) for k in COUNTERS})
    tensors = {n: t.detach().to("cpu").contiguous().clone() for n, t in tensors.items()}
    meta = {
        "format": FORMAT,
        "identity": _identity(cache),
        "layers": layers,
        "tensors": {n: tensor_sha256(t) for n, t in sorted(tensors.items())},
    }
    header = json.dumps(meta, sort_keys=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"kvq": header, "kvq_sha256": _sha(header)})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _check_destination(path: Path) -> Path:
    """Where a cache may be saved: a file (new or replaced) in an existing folder that is
    not a kvq artifact (its files are hashed: a cache written there would ruin it)."""
    if not isinstance(path, (str, os.PathLike)):
        raise KvqError(f"a cache is saved to a file path (str or Path), got {type(path).__name__}")
    path = Path(os.path.abspath(path))
    if path.is_dir():
        raise KvqError(f"cannot save a cache to {path}: it is a directory; give a file name")
    if not path.parent.is_dir():
        raise KvqError(f"cannot save a cache to {path}: the folder {path.parent} does not exist")
    inside = next((p for p in path.parents if is_artifact_dir(p)), None)
    if inside is not None:
        raise KvqError(f"cannot save a cache to {path}: it lies inside the kvq artifact {inside}")
    return path


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _identity(cache) -> dict:
    """What saved state must match: model config and weights, artifact, layout."""
    return dict(cache.identity) | {"weights": cache.weights_identity()}


def restore_cache(cache, path):
    """Fill the fresh `cache` with the state saved at `path`; returns `cache`."""
    if not isinstance(path, (str, os.PathLike)):
        raise KvqError(f"a saved cache is a file path (str or Path), got {type(path).__name__}")
    path = Path(path)
    if not path.is_file():
        raise KvqError(f"no saved cache state at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = _header(f.metadata() or {}, path)
            _check_identity(meta.get("identity"), _identity(cache), path)
            names = set(f.keys())
            hashes = meta.get("tensors")
            if not isinstance(hashes, dict) or set(hashes) != names:
                raise KvqError(f"{path}: its tensors are not the ones its header lists")
            tensors = {n: f.get_tensor(n) for n in sorted(names)}
    except (OSError, ValueError, SafetensorError) as e:  # JSON errors are ValueErrors
        raise KvqError(f"cannot read saved cache state {path}: {e}") from None
    bad = next((n for n, t in tensors.items() if tensor_sha256(t) != hashes[n]), None)
    if bad is not None:
        raise KvqError(f"{path}: tensor {bad} does not match its checksum (the file was modified)")
    layers = meta.get("layers")
    if not isinstance(layers, list) or len(layers) != len(cache.layers):
        raise KvqError(f"{path}: saved state has the wrong number of layers")
    device = _device(cache)
    for i, (layer, counters) in enumerate(zip(cache.layers, layers, strict=True)):
        where = f"{path}: layer {i}"
        if not isinstance(counters, dict) or counters.get("layer") != i:
            raise KvqError(f"{where}: the header's layers are out of order")
        pre = f"layers.{i}."
        mine = {n[len(pre) :]: t.to(device) for n, t in tensors.items() if n.startswith(pre)}
        _check_positions(mine, cache.max_position, where)
        layer.state = _layer_state(layer, counters, mine, where)
    return cache


def _header(metadata: dict, path: Path) -> dict:
    """The checked JSON header of a saved state, or a one-line KvqError."""
    text = metadata.get("kvq")
    try:
        meta = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or not str(meta.get("format", "")).startswith("kvq-cache-state/"):
        raise KvqError(f"{path} is not a saved kvq cache state ({FORMAT})")
    if meta["format"] != FORMAT:
        raise KvqError(f"{path} is a {meta['format']} state without checksums; save it again")
    if metadata.get("kvq_sha256") != _sha(text):
        raise KvqError(f"{path}: its header does not match its checksum (the file was modified)")
    return meta


def _check_positions(t: dict, limit: int | None, where: str) -> None:
    """RoPE positions of held rows are token indices: non-negative, within the model's
    context (a prefix's rows sit before the first token: theirs may be negative)."""
    for name, x in t.items():
        if name.endswith("positions") and not name.startswith("prefix.") and x.numel():
            low, high = int(x.min()), int(x.max())
            if x.dtype != torch.long or low < 0 or (limit is not None and high >= limit):
                raise KvqError(
                    f"{where}: {name} holds positions {low}..{high} outside the model's context"
                )


def _check_identity(saved, expected: dict, path: Path) -> None:
    if not isinstance(saved, dict):
        raise KvqError(f"{path}: saved state records no identity")
    fields = (("model", "model"), ("weights", "model's weights"), ("artifact", "artifact"),
              ("policy", "cache layout"))  # fmt: skip
    for field, what in fields:
        if saved.get(field) != expected.get(field):
            raise KvqError(
                f"{path} was saved for another {what} ({field} {str(saved.get(field))[:16]}, "
                f"this cache has {str(expected.get(field))[:16]}); it cannot be reused here"
            )


def _device(cache):
    for layer in cache.layers:
        for t in layer.key_codec.static.values():
            return t.device
    return torch.device("cpu")


def _layer_state(layer, counters: dict, t: dict, where: str):
    """One layer's `LayerState` from its saved tensors, checked against the layer's codecs."""
    from kvq.runtime.layers import EMPTY

    try:
        seen, evicted, lead, settled, skipped = (int(counters[k]) for k in COUNTERS)
    except (KeyError, TypeError, ValueError):
        raise KvqError(f"{where}: counters are missing") from None
    main = RowStore.empty()
    rows = {n[len("main.") :]: x for n, x in t.items() if n.startswith("main.")}
    positions = rows.pop("positions", None)
    if rows:
        spec = _row_spec(layer, next(iter(rows.values())).shape[1])
        if set(rows) != set(spec):
            raise KvqError(f"{where}: stored tensors {sorted(rows)} do not match the layout")
        lead_dims = positions.shape if positions is not None else None
        for name, x in rows.items():
            shape, dtype = spec[name]
            if x.dtype != dtype or tuple(x.shape[3:]) != shape or x.shape[0:3:2] != lead_dims:
                raise KvqError(f"{where}: {name} has the wrong shape or dtype")
            if name.endswith(".sparse_index"):  # exception slots: decode trusts them
                codec = layer.key_codec if name.startswith("k.") else layer.value_codec
                try:
                    sparse.check_slots(x, codec.head_dim)
                except KvqError as e:
                    raise KvqError(f"{where}: {name}: {e}") from None
        main = RowStore(rows, positions.shape[1], positions)
    residual = RowStore.empty()
    res = {n[len("residual.") :]: x for n, x in t.items() if n.startswith("residual.")}
    if res:
        res_pos = res.pop("positions", None)
        if set(res) != {"k", "v"} or res_pos is None:
            raise KvqError(f"{where}: residual rows are incomplete")
        for x in res.values():
            if x.dtype != layer.sink_dtype or x.shape[0:3:2] != res_pos.shape:
                raise KvqError(f"{where}: residual rows have the wrong shape or dtype")
        residual = RowStore(res, res_pos.shape[1], res_pos)
    flat = {}
    for part in ("k", "v"):
        entries = {n.split(".", 2)[2]: x for n, x in t.items() if n.startswith(f"flat.{part}.")}
        if entries:
            flat[part] = FlatStore(entries, next(iter(entries.values())).shape[0])
    sink = None
    if "sink.k" in t:
        sink = SinkRows(
            rows={"k": t["sink.k"], "v": t["sink.v"]},
            positions=t["sink.positions"],
            cols=t["sink.cols"],
            filled=t["sink.filled"],
        )._checked()
        if sink.slots != layer.policy.sink_tokens:
            raise KvqError(f"{where}: saved with {sink.slots} sink tokens, the layout has "
                           f"{layer.policy.sink_tokens}")  # fmt: skip
    prefix = None
    if "prefix.k" in t:
        prefix = PrefixRows(
            rows={"k": t["prefix.k"], "v": t["prefix.v"]},
            positions=t["prefix.positions"],
            placed=t["prefix.placed"],
            first_col=t["prefix.first_col"],
        )
    kv = layer.prefix_kv
    if (prefix is not None and (kv is None or prefix.length != kv.key.shape[1])) or (
        prefix is None and kv is not None and seen
    ):
        raise KvqError(f"{where}: the saved prefix rows do not match the layout's prefix")
    state = replace(
        EMPTY, sink=sink, prefix=prefix, main=main, residual=residual, seen=seen, evicted=evicted, lead=lead,
        flat=flat, settled=settled, skipped=skipped,
        **_phase(t, layer, where),
    )  # fmt: skip
    if not (
        0 <= lead <= state.visible <= seen - evicted
        and min(evicted, settled, skipped) >= 0
        and settled <= residual.length
    ):
        raise KvqError(f"{where}: inconsistent counters {counters}")
    return state


def _phase(t: dict, layer, where: str) -> dict:
    """A padded batch's group shifts (absent: none), checked against the layout's groups."""
    out = {n: t.get(n) for n in ("phase", "first_real")}
    phase = out["phase"]
    out["phase_max"] = 0 if phase is None else int(phase.max())
    if phase is not None and (phase.dim() != 1 or int(phase.min()) < 0
                              or out["phase_max"] >= layer.group_rows):  # fmt: skip
        raise KvqError(f"{where}: group shifts do not fit groups of {layer.group_rows} tokens")
    return out


def _row_spec(layer, heads: int) -> dict:
    """Per-row shape and dtype of each stored tensor, from encoding one group of zero rows."""
    spec = {}
    for part, codec in (("k", layer.key_codec), ("v", layer.value_codec)):
        try:
            rows, _ = codec.encode(torch.zeros(1, heads, codec.group_rows, codec.head_dim))
        except (KvqError, RuntimeError):
            raise KvqError(f"saved rows have {heads} heads, the layout has another") from None
        spec |= {f"{part}.{n}": (tuple(r.shape[3:]), r.dtype) for n, r in rows.items()}
    return spec
