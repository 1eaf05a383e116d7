"""Vector codebooks over channel groups (coupled quantization): NUQ in m dimensions.

Rows are normalised exactly as for NUQ (`kvq.quant.nuq`: per channel for K, per row for
V, into [-1, 1]), then cut into groups of m channels and each group coded jointly as the
index of the nearest of 2^(bits * m) centroids of a codebook shared by the layer, nearest
in the Fisher-weighted distance sum_i w_i (x_i - c_i)^2 (w the static channel weights).
The index is stored as m digits of `bits` bits, so a row costs exactly what a scalar
`bits`-bit NUQ row costs; codes pack with `kvq.quant.packing`:

    digits[g * m + i] = (index_g >> (bits * i)) & (2^bits - 1)

Groups: for pre-RoPE keys, RoPE pairs (c, c + D/2) (m = 2) or two neighbouring pairs
(c, c + 1, c + D/2, c + 1 + D/2) (m = 4), channels of one rotation frequency together;
for values, neighbouring channels. A group layout is a function of (D, m, pairs) only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant.qparams import check_finite

DIMS = (2, 4)
MAX_CENTROIDS = 4096
_CHUNK = 1 << 24  # distance-matrix elements per encode chunk (64 MiB of float32)


def check_dims(bits: int, dim: int) -> int:
    """Number of centroids of a (bits, dim) codebook; refuses unsupported combinations."""
    if dim not in DIMS:
        raise KvqError(f"vector dimension must be one of {DIMS}, got {dim}")
    if not 1 <= bits <= 8 or 2 ** (bits * dim) > MAX_CENTROIDS:
        raise KvqError(
            f"a {dim}-D codebook at {bits} bits has {2 ** (bits * dim)} centroids; "
            f"at most {MAX_CENTROIDS}"
        )
    return 2 ** (bits * dim)


def channel_groups(head_dim: int, dim: int, pairs: bool) -> Tensor:
    """[D / dim, dim] int64 channels of each group (see the module doc)."""
    if head_dim % dim or (pairs and head_dim % 2):
        raise KvqError(f"head_dim {head_dim} does not split into {dim}-channel groups")
    if not pairs:
        return torch.arange(head_dim).view(-1, dim)
    half = head_dim // 2
    first = torch.arange(half).view(-1, dim // 2)  # [D/dim, dim/2]
    return torch.cat([first, first + half], 1)


def _assign(x: Tensor, w: Tensor, c: Tensor) -> Tensor:
    """Nearest centroid of each vector: x, w [N, m], c [K, m] -> [N] int64."""
    out = []
    step = max(1, _CHUNK // c.shape[0])
    for i in range(0, x.shape[0], step):
        xs, ws = x[i : i + step], w[i : i + step]
        d = ws @ (c * c).T - 2 * (ws * xs) @ c.T  # [n, K]; sum w x^2 is constant per row
        out.append(d.argmin(-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def fit_codebook(
    vectors: Tensor,
    weights: Tensor,
    bits: int,
    seed: int = 0,
    max_samples: int = 60_000,
    iters: int = 25,
) -> Tensor:
    """Weighted k-means (Lloyd): vectors, weights [N, m] (normalised values, clamped to
    [-1, 1]; non-negative per-coordinate weights) -> centroids float32 [2^(bits m), m].

    Deterministic: the subsample and the initial centroids come from a generator seeded by
    `seed`. Rows with zero total weight are dropped; a centroid left without members keeps
    its place.
    """
    n_vec, dim = vectors.shape
    k = check_dims(bits, dim)
    check_finite(vectors, "codebook vectors")
    check_finite(weights, "codebook weights")
    x, w = vectors.float().clamp(-1.0, 1.0), weights.float()
    keep = w.sum(-1) > 0
    x, w = x[keep], w[keep]
    gen = torch.Generator().manual_seed(seed)
    if x.shape[0] > max_samples:
        pick = torch.randperm(x.shape[0], generator=gen)[:max_samples]
        x, w = x[pick], w[pick]
    if torch.unique(x, dim=0).shape[0] < k:
        raise KvqError(
            f"cannot fit {k} centroids to {x.shape[0]} vectors with fewer distinct values; "
            "use more calibration data or fewer bits"
        )
    c = x[torch.randperm(x.shape[0], generator=gen)[:k]].clone()
    for _ in range(iters):
        a = _assign(x, w, c)
        num = torch.zeros_like(c).index_add_(0, a, w * x)
        den = torch.zeros_like(c).index_add_(0, a, w)
        c = torch.where(den > 0, num / den.clamp_min(1e-30), c)
    return c.contiguous()


def encode(x_norm: Tensor, codebook: Tensor, weight: Tensor, groups: Tensor, bits: int) -> Tensor:
    """x_norm [B, H, T, D] normalised rows, weight [H, D] -> uint8 digits [B, H, T, D]."""
    check_finite(x_norm, "normalised input")
    b, h, t, d = x_norm.shape
    g, m = groups.shape
    c = codebook.float()
    xg = x_norm.float().clamp(-1.0, 1.0)[..., groups]  # [B, H, T, G, m]
    wg = weight.float()[:, groups]  # [H, G, m]
    idx = torch.empty(b, h, t, g, dtype=torch.int64, device=x_norm.device)
    step = max(1, _CHUNK // max(1, b * g * c.shape[0]))
    for i in range(0, t, step):
        xs = xg[:, :, i : i + step]  # [B, H, C, G, m]
        dist = (wg @ (c * c).T)[None, :, None] - 2 * (xs * wg[None, :, None]) @ c.T
        idx[:, :, i : i + step] = dist.argmin(-1)
    shifts = torch.arange(m, device=x_norm.device) * bits
    digits = (idx[..., None] >> shifts) & ((1 << bits) - 1)  # [B, H, T, G, m]
    return digits.reshape(b, h, t, g * m).to(torch.uint8)


def decode(digits: Tensor, codebook: Tensor, groups: Tensor, bits: int) -> Tensor:
    """uint8 digits [B, H, T, D] -> normalised rows float32 [B, H, T, D].

    Every decode step of a vq cache runs this over all its rows, so it avoids a scatter:
    the calibrator's groups are either columnar (key RoPE pairs: coordinate j of every
    group is one run of channels) or contiguous (values: neighbouring channels), and each
    has a gather-only form; any other grouping takes a permuting gather. Exact: integer
    index arithmetic and table lookups only."""
    g, m = groups.shape
    shape = digits.shape
    d = digits.view(*shape[:-1], g, m)
    idx = d[..., 0].to(torch.int32)  # [B, H, T, G] the centroid each group's digits name
    for j in range(1, m):
        idx = idx | (d[..., j].to(torch.int32) << (j * bits))
    short = codebook.shape[0] < 1 << (m * bits)  # else no index can overflow
    if short and idx.numel() and int(idx.max()) >= codebook.shape[0]:
        raise KvqError(f"code out of range for a {codebook.shape[0]}-centroid codebook")
    order = torch.arange(g * m, device=groups.device)
    if torch.equal(groups.T.reshape(-1), order):  # columnar: channels [j G, (j+1) G)
        columns = codebook.float().T.contiguous()  # [m, K]
        return torch.cat([columns[j][idx] for j in range(m)], dim=-1)  # [B, H, T, D]
    vec = codebook.float()[idx].reshape(*shape[:-1], g * m)  # [B, H, T, D] in group order
    flat = groups.reshape(-1)
    if torch.equal(flat, order):
        return vec
    return vec.index_select(-1, torch.argsort(flat).to(digits.device))


def check_codebook(codebook: Tensor, bits: int, dim: int, where: str) -> None:
    """Refuse a stored codebook of the wrong shape or with non-finite entries."""
    k = check_dims(bits, dim)
    if tuple(codebook.shape) != (k, dim):
        raise KvqError(
            f"{where}.vq_codebook: expected shape [{k}, {dim}], found {list(codebook.shape)}"
        )
    check_finite(codebook.float(), f"{where}.vq_codebook")
