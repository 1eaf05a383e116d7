"""Transform coding of K/V rows (a measured prototype, not a kvq format: on Gemma 3 270M
it lost to scalar NUQ on keys and to vector codebooks on values, see
`bench/lowbit_probe.py`): a calibrated decorrelating basis, then scalar codebook codes
with bits allocated across the transformed coordinates.

Per layer, side and KV head, from calibration rows x [N, D] and the diagonal Fisher f [D]:

    u = (x - mean) * weight                 # weight = sqrt(f) (floored): Fisher units
    cov(u) = U diag(stdev^2) U^T            # eigenvectors by decreasing variance
    z = u @ U[:, :K] / stdev[:K]            # the K kept coordinates, unit variance

so squared error in z, times stdev^2, is the Fisher-weighted error in x. Coordinate j is
stored with widths[j] bits (non-increasing in j; coordinates past K get 0 bits and decode
to the mean), chosen by `allocate`. Each row also stores one fp16 scale r (the rms of its
z), and z / r is coded per coordinate with the layer's codebook of that width:

    code_j = nuq_encode(z_j / r, levels[w_j])       z_hat_j = levels[w_j][code_j] * r
    x_hat  = mean + (z_hat * stdev) @ basis / weight

Codes of equal width sit together, widest first, each group packed by `kvq.quant.packing`.
Keys are coded before RoPE (the basis mixes channels of different rotation frequencies;
a runtime would rotate after decode). The stored basis is float16: encode and decode
both read the stored one.
"""

from __future__ import annotations

import heapq
import math

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant import nuq, packing
from kvq.quant.qparams import check_finite, store_scale

# widths a coordinate may get (packable; 5 and 7 bits are not)
WIDTHS = (0, 1, 2, 3, 4, 6, 8)
# mean squared error of a Lloyd-Max quantizer of a unit Gaussian, per width: the
# allocator's distortion model (the fitted codebooks do a little better on real rows)
GAUSS_MSE = {0: 1.0, 1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497, 6: 0.000660, 8: 0.0000414}
WEIGHT_FLOOR = 1e-3  # channel weights below this share of the mean are raised to it
SCALE_DTYPE = torch.float16


def fit_basis(x: Tensor, fisher: Tensor | None) -> dict[str, Tensor]:
    """x [N, H, D] calibration rows, fisher [H, D] or None -> mean [H, D], weight [H, D],
    basis [H, D, D] (float32, row j = coordinate j), variance [H, D] (decreasing)."""
    check_finite(x, "calibration rows")
    x64 = x.double()
    mean = x64.mean(0)  # [H, D]
    if fisher is None:
        weight = torch.ones_like(mean)
    else:
        f = fisher.double().clamp_min(0)
        floor = WEIGHT_FLOOR * f.mean(-1, keepdim=True).clamp_min(1e-30)
        weight = f.clamp_min(floor).sqrt()
        weight = weight / weight.mean(-1, keepdim=True)  # scale-free: mean weight 1
    u = (x64 - mean) * weight  # [N, H, D]
    cov = torch.einsum("nhd,nhe->hde", u, u) / max(u.shape[0] - 1, 1)
    var, vec = torch.linalg.eigh(cov)  # ascending
    var, vec = var.flip(-1).clamp_min(0), vec.flip(-1)
    return {
        "mean": mean.float(),
        "weight": weight.float(),
        "basis": vec.transpose(-1, -2).float().contiguous(),  # [H, D(coord), D(channel)]
        "variance": var.float(),
    }


def coding_gain(variance: Tensor, rel_floor: float = 1e-6) -> float:
    """Transform-coding gain: arithmetic over geometric mean of the variances [D]
    (floored at rel_floor of the largest, so a null direction does not read as infinite)."""
    v = variance.double().clamp_min(float(variance.max()) * rel_floor)
    return float(v.mean() / v.log().mean().exp())


def allocate(variances: list[Tensor], budgets: list[int] | int) -> list[Tensor]:
    """Bits per coordinate for each unit, by greedy marginal return (reverse water-filling
    in whole widths of `WIDTHS`).

    variances: per unit [D_u] coordinate variances in common (Fisher) units, decreasing.
    budgets: per unit code bits per row (each unit its own budget), or one int: a pool for
    all units together (mixed precision: bits go where the weighted error falls most).
    Returns per unit widths [D_u] int64, non-increasing. Each step takes the coordinate
    whose next width lowers variance * GAUSS_MSE the most per bit spent.
    """
    pooled = isinstance(budgets, int)
    left = [budgets] if pooled else list(budgets)
    widths = [[0] * v.numel() for v in variances]
    nxt = {w: WIDTHS[i + 1] for i, w in enumerate(WIDTHS[:-1])}
    heap = []

    def push(u: int, j: int) -> None:
        w = widths[u][j]
        if w in nxt:
            gain = float(variances[u][j]) * (GAUSS_MSE[w] - GAUSS_MSE[nxt[w]])
            heapq.heappush(heap, (-gain / (nxt[w] - w), u, j))

    for u, v in enumerate(variances):
        for j in range(v.numel()):
            push(u, j)
    while heap:
        _, u, j = heapq.heappop(heap)
        b = 0 if pooled else u
        cost = nxt[widths[u][j]] - widths[u][j]
        if cost > left[b]:
            continue  # this step does not fit; a cheaper one may
        left[b] -= cost
        widths[u][j] = nxt[widths[u][j]]
        push(u, j)
    out = []
    for w in widths:
        t = torch.tensor(w, dtype=torch.int64)
        out.append(t.sort(descending=True).values)  # ties can land out of order
    return out


def groups(widths: Tensor) -> list[tuple[int, int, int]]:
    """(width, first, stop) of each run of equal non-zero widths in widths [K]."""
    out, w = [], widths.tolist()
    start = 0
    for j in range(1, len(w) + 1):
        if j == len(w) or w[j] != w[start]:
            if w[start]:
                out.append((w[start], start, j))
            start = j
    return out


def packed_bytes(widths: Tensor) -> int:
    """Bytes of one row's codes."""
    return sum(packing.packed_len(b - a, w) for w, a, b in groups(widths))


def check_state(state: dict[str, Tensor], heads: int, head_dim: int, where: str) -> Tensor:
    """Refuse transform-coding state that does not fit [H, D] rows; returns widths [K]."""
    for name in ("mean", "weight", "basis", "stdev", "widths"):
        if name not in state:
            raise KvqError(f"{where}: the artifact has no {where}.{name}")
    widths = state["widths"]
    k = widths.numel()
    shapes = {
        "mean": (heads, head_dim),
        "weight": (heads, head_dim),
        "basis": (heads, k, head_dim),
        "stdev": (heads, k),
        "widths": (k,),
    }
    for name, shape in shapes.items():
        if tuple(state[name].shape) != shape:
            raise KvqError(
                f"{where}.{name}: expected shape {list(shape)}, found {list(state[name].shape)}"
            )
        check_finite(state[name].float(), f"{where}.{name}")
    w = widths.long()
    if not 0 < k <= head_dim or any(int(b) not in WIDTHS[1:] for b in w):
        raise KvqError(f"{where}.widths: 1..{head_dim} widths from {WIDTHS[1:]}, got {w.tolist()}")
    if bool((w[1:] > w[:-1]).any()):
        raise KvqError(f"{where}.widths must be non-increasing")
    if not bool((state["weight"].float() > 0).all() and (state["stdev"].float() > 0).all()):
        raise KvqError(f"{where}: weight and stdev must be positive")
    for width, _, _ in groups(w):
        name = f"levels{width}"
        if name not in state:
            raise KvqError(f"{where}: the artifact has no {where}.{name}")
        if state[name].numel() != 2**width:
            raise KvqError(f"{where}.{name}: expected {2**width} levels")
        nuq.decision_boundaries(state[name])  # finite, strictly increasing
    return w


def coordinates(x: Tensor, state: dict[str, Tensor]) -> Tensor:
    """x [B, H, T, D] -> z [B, H, T, K]: the kept coordinates, unit variance on calibration."""
    u = (x.float() - state["mean"].float()[:, None]) * state["weight"].float()[:, None]
    z = torch.einsum("bhtd,hkd->bhtk", u, state["basis"].float())
    return z / state["stdev"].float()[:, None]


def encode(x: Tensor, state: dict[str, Tensor], widths: Tensor) -> tuple[Tensor, Tensor]:
    """x [B, H, T, D] -> (codes uint8 [B, H, T, packed_bytes], row scale fp16 [B, H, T])."""
    check_finite(x, "rows")
    z = coordinates(x, state)
    rms = z.square().mean(-1).sqrt()
    r = store_scale(rms, SCALE_DTYPE, rms > 0)
    zn = z / r.float()[..., None]
    parts = [
        packing.pack_bits(nuq.nuq_encode(zn[..., a:b], state[f"levels{w}"]), w)
        for w, a, b in groups(widths)
    ]
    return torch.cat(parts, -1), r


def decode_coordinates(codes: Tensor, scale: Tensor, state, widths: Tensor) -> Tensor:
    """codes [B, H, T, bytes], scale [B, H, T] -> z_hat [B, H, T, K] float32."""
    parts, at = [], 0
    for w, a, b in groups(widths):
        n = packing.packed_len(b - a, w)
        idx = packing.unpack_bits(codes[..., at : at + n].contiguous(), w, b - a)
        parts.append(nuq.nuq_decode(idx, state[f"levels{w}"]))
        at += n
    return torch.cat(parts, -1) * scale.float()[..., None]


def decode(codes: Tensor, scale: Tensor, state: dict[str, Tensor], widths: Tensor) -> Tensor:
    """codes [B, H, T, bytes], scale [B, H, T] -> x_hat [B, H, T, D] float32."""
    z = decode_coordinates(codes, scale, state, widths) * state["stdev"].float()[:, None]
    u = torch.einsum("bhtk,hkd->bhtd", z, state["basis"].float())
    return u / state["weight"].float()[:, None] + state["mean"].float()[:, None]


def fit_levels(zn: Tensor, widths: Tensor, seed: int = 0) -> dict[str, Tensor]:
    """zn [N, K] row-normalised calibration coordinates -> levels{w} per width present:
    k-means over the coordinates of that width (pooled), as NUQ fits its codebook."""
    out = {}
    for w, a, b in groups(widths):
        out[f"levels{w}"] = nuq.fit_codebook(
            zn[:, a:b].reshape(-1), w, seed=seed, max_samples=60_000
        )
    return out


def stored_state(fitted: dict[str, Tensor], widths: Tensor) -> dict[str, Tensor]:
    """The artifact tensors of a fitted basis truncated to the coordinates with bits:
    basis in float16, stdev = sqrt(variance) in float32."""
    k = int((widths > 0).sum())
    if k == 0:
        raise KvqError("a transform-coded side needs at least one coordinate with bits")
    return {
        "mean": fitted["mean"].contiguous(),
        "weight": fitted["weight"].contiguous(),
        "basis": fitted["basis"][:, :k].half().contiguous(),
        "stdev": fitted["variance"][:, :k].clamp_min(1e-20).sqrt().contiguous(),
        "widths": widths[:k].to(torch.uint8).contiguous(),
    }


def row_normalised(x: Tensor, state: dict[str, Tensor]) -> Tensor:
    """x [N, H, D] -> the coordinates divided by their row scale [N, H, K] (what codes see)."""
    z = coordinates(x.permute(1, 0, 2)[None], state)[0]  # [H, N, K]
    rms = z.square().mean(-1).sqrt()
    r = store_scale(rms, SCALE_DTYPE, rms > 0).float()
    return (z / r[..., None]).permute(1, 0, 2)


def bits_per_row(widths: Tensor) -> int:
    """Stored bits of one row (codes padded to whole units + the fp16 row scale)."""
    return 8 * packed_bytes(widths) + 16


def log2_mse_gain(gain: float) -> float:
    """Bits per element a transform-coding gain is worth at high rate."""
    return 0.5 * math.log2(gain)
