"""Declared prefix state: K/V rows seeded before each sequence's first real token.

IntactKV and PrefixQuant both serve a user sequence x as prefix + x, where the prefix's
K/V rows come from the artifact (exact or calibrated, never quantized) rather than from
running its tokens. The user's tokens and positions stay their own: `get_seq_length`,
the mask columns and `position_ids` count only them, so `model.generate(cache=...)`
works unchanged. The prefix sits right before each sequence's first real token *in
position terms*: when that token arrives at position p, the prefix rows take positions
p - P .. p - 1 (negative for an unpadded batch starting at 0: RoPE only sees differences,
so attention is that of a plain forward over prefix + prompt). A left-padded sequence's
prefix therefore sits after its padding, exactly where it sits for the sequence alone.
Only exact rows are blind to the offset: a post-RoPE codec quantizes each key at its own
absolute angle, so x's codes match those of a plain run over prefix + x (where x starts at
P) only when x is given `position_ids` from P on. Either placement is as good: rounding
error does not prefer an angle.

The artifact stores pre-RoPE keys ([H_kv, P, D], position-free); a layer rotates them at
the sequence's prefix positions when the sequence is placed and keeps them post-RoPE.
Immutable like the sink rows: every change returns a successor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant.schemes import PrefixSpec

RotateFn = Callable[[Tensor, Tensor], Tensor]  # (x [B, H, T, D], positions [B, T]) -> rotated


@dataclass(frozen=True)
class PrefixKV:
    """One layer's prefix rows as the artifact stores them."""

    key: Tensor  # [H_kv, P, D] pre-RoPE
    value: Tensor  # [H_kv, P, D]


@dataclass(frozen=True)
class Prefix:
    """An artifact's prefix: its tokens (and tokenizer) and every layer's rows."""

    spec: PrefixSpec
    layers: tuple[PrefixKV, ...]

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.spec.token_ids

    @property
    def length(self) -> int:
        return self.spec.length

    def tensors(self) -> dict[str, Tensor]:
        """The artifact tensors of this prefix (`layers.{i}.prefix.key|value`)."""
        out = {}
        for i, kv in enumerate(self.layers):
            out[f"layers.{i}.prefix.key"] = kv.key.contiguous()
            out[f"layers.{i}.prefix.value"] = kv.value.contiguous()
        return out


def prefix_from_tensors(spec: PrefixSpec | None, tensors: dict[str, Tensor], layers: int):
    """The `Prefix` of a policy's spec and an artifact's tensors (None without a spec);
    refuses missing or inconsistent rows by name."""
    if spec is None:
        if any(".prefix." in n for n in tensors):
            raise KvqError("the artifact holds prefix rows but its policy declares no prefix")
        return None
    rows = []
    for i in range(layers):
        k, v = tensors.get(f"layers.{i}.prefix.key"), tensors.get(f"layers.{i}.prefix.value")
        if k is None or v is None:
            raise KvqError(f"the policy declares a prefix, but layers.{i}.prefix rows are missing")
        if k.dim() != 3 or k.shape != v.shape or k.shape[1] != spec.length:
            raise KvqError(
                f"layers.{i}.prefix rows have shape {tuple(k.shape)} / {tuple(v.shape)}, "
                f"expected [H_kv, {spec.length}, D] for both"
            )
        rows.append(PrefixKV(k, v))
    return Prefix(spec, tuple(rows))


def load_prefix(artifact) -> Prefix | None:
    """The declared prefix of an artifact (a `kvq.artifacts.store.Artifact` or its
    path): token ids, the tokenizer fingerprint and per-layer pre-RoPE K and V
    ([H_kv, P, D]); None when the artifact declares none. Calibrators use it to observe
    statistics with the prefix in place (see `prefix_dynamic_cache`)."""
    from pathlib import Path

    if isinstance(artifact, (str, Path)):
        from kvq.artifacts.store import read_artifact

        artifact = read_artifact(Path(artifact))
    policy = artifact.manifest.policy
    return prefix_from_tensors(policy.prefix, artifact.tensors, policy.num_layers)


def check_tokenizer(spec: PrefixSpec, tokenizer_sha256: str) -> None:
    """Prefix token ids mean nothing under another tokenizer: refuse them."""
    if spec.tokenizer_sha256 != tokenizer_sha256:
        raise KvqError(
            f"the prefix was made with another tokenizer ({spec.tokenizer_sha256[:16]}, "
            f"this model's is {tokenizer_sha256[:16]})"
        )


@dataclass(frozen=True)
class PrefixRows:
    """A layer's prefix rows, per sequence, once its first real token has placed them."""

    rows: dict[str, Tensor]  # "k" (post-RoPE at `positions`), "v": [B, H, P, D]
    positions: Tensor  # [B, P] int64 RoPE positions: first real token's position - P + j
    placed: Tensor  # [B] bool: the sequence's first real token has arrived
    first_col: Tensor  # [B] int64 absolute mask column (evictions included) of that token

    @staticmethod
    def empty(batch: int, heads: int, length: int, head_dim: int, dtype, device) -> PrefixRows:
        zeros = torch.zeros((batch, heads, length, head_dim), dtype=dtype, device=device)
        return PrefixRows(
            rows={"k": zeros, "v": zeros.clone()},
            positions=torch.zeros((batch, length), dtype=torch.long, device=device),
            placed=torch.zeros(batch, dtype=torch.bool, device=device),
            first_col=torch.zeros(batch, dtype=torch.long, device=device),
        )

    @property
    def length(self) -> int:
        return self.positions.shape[1]

    @property
    def all_placed(self) -> bool:
        return bool(self.placed.all())

    def placed_for(
        self, kv: PrefixKV, rotate: RotateFn, positions: Tensor, real: Tensor, first_col: int
    ) -> PrefixRows:
        """Successor with the sequences whose first real token is among the new rows placed.

        positions: [B, T] RoPE positions of the new rows; real: [B, T] bool (not padding);
        first_col: absolute mask column of the first new row.
        """
        new = real.any(1) & ~self.placed  # [B]
        if not bool(new.any()):
            return self
        b = new.nonzero(as_tuple=True)[0]
        t0 = real[b].long().argmax(1)  # first real row of each newly placed sequence
        p = self.length
        pos = positions[b, t0][:, None] - p + torch.arange(p, device=positions.device)  # [n, P]
        heads, _, d = kv.key.shape
        key = kv.key.to(positions.device).float()[None].expand(len(b), heads, p, d)
        rows = {n: r.clone() for n, r in self.rows.items()}
        rows["k"][b] = rotate(key, pos).to(rows["k"].dtype)
        rows["v"][b] = kv.value.to(device=positions.device, dtype=rows["v"].dtype)[None]
        all_pos, placed, cols = self.positions.clone(), self.placed.clone(), self.first_col.clone()
        all_pos[b], placed[b], cols[b] = pos, True, first_col + t0
        return PrefixRows(rows, all_pos, placed, cols)

    def cropped(self, columns: int) -> PrefixRows:
        """After the mask shrank to `columns` absolute columns: a sequence whose first real
        token is gone is unplaced (its next first real token places the prefix again)."""
        return replace(self, placed=self.placed & (self.first_col < columns))

    def selected(self, index: Tensor) -> PrefixRows:
        """Batch rows picked by `index` (beam reorder, repeat, select; duplicates allowed)."""
        return PrefixRows(
            rows={n: r.index_select(0, index) for n, r in self.rows.items()},
            positions=self.positions.index_select(0, index),
            placed=self.placed.index_select(0, index),
            first_col=self.first_col.index_select(0, index),
        )

    def visible(self, query_positions: Tensor, window: int | None) -> Tensor:
        """[B, 1, Q, P] bool: which queries (positions [B, Q]) see which prefix rows: all of
        a placed sequence's, within `window` positions on a sliding-window layer."""
        see = self.placed[:, None, None, None].expand(-1, 1, query_positions.shape[1], self.length)
        if window is not None:
            gap = query_positions[:, None, :, None] - self.positions[:, None, None, :]
            see = see & (gap < window)
        return see

    def nbytes(self) -> int:
        """Bytes of the placed sequences' rows, K and V."""
        n = int(self.placed.sum())
        return sum(n * r[0].nbytes for r in self.rows.values())

    def allocated_bytes(self) -> int:
        return sum(r.nbytes for r in self.rows.values())


def user_tokens(ids: Tensor, spec: PrefixSpec | None, bos: int | None) -> Tensor:
    """ids [N, L] as the user's part of prefix + ids: a leading BOS goes when the prefix
    starts with it (the prefix supplies the sequence's start; a second BOS would not be
    the text the prefix was made for)."""
    if spec is None or bos is None or spec.token_ids[0] != bos:
        return ids
    if ids.shape[1] > 1 and bool((ids[:, 0] == bos).all()):
        return ids[:, 1:]
    return ids


def prefix_dynamic_cache(model, adapter, prefix: Prefix, batch: int = 1):
    """A transformers `DynamicCache` holding `prefix`'s rows at positions 0 .. P-1 (keys
    rotated there, in the model's dtype), for `batch` sequences: `model(ids, cache=it)`
    then runs ids at positions P .. with the prefix in place, as served, while forward
    hooks see only the ids' own activations (what a calibrator that excludes the prefix
    from its statistics wants)."""
    from transformers import DynamicCache

    dtype = next(model.parameters()).dtype
    cache = DynamicCache(config=model.config)
    positions = torch.arange(prefix.length)
    layers = adapter.decoder_layers()
    for i, kv in enumerate(prefix.layers):
        device = next(layers[i].parameters()).device  # a model spread over devices too
        cos, sin = adapter.rope_cos_sin(i, positions)
        key = adapter.apply_rope(kv.key.float()[None], cos.to(kv.key.device), sin.to(kv.key.device))
        key = key.expand(batch, -1, -1, -1).to(device=device, dtype=dtype).contiguous()
        value = kv.value[None].expand(batch, -1, -1, -1).to(device=device, dtype=dtype)
        cache.update(key, value.contiguous(), i)
    return cache
