"""Measure before building: which low-bit method does the K/V of a model favour?

    .venv/bin/python bench/lowbit_probe.py [--samples 16] [--seqlen 512] [--bits 2,3]
                                           [--layers 0,1,...] [--json FILE]

Captures the calibration K (pre-RoPE) and V of every layer as `kvq calibrate kvquant`
does (sink rows left out), fits every statistic on the first half of the rows and
measures it on the second (held-out) half. Per layer and side:

  gain       transform-coding gain of the channel covariance (arithmetic over geometric
             mean of the held-out variances along the fitted eigenvectors): keys
             normalised per channel (mean, std), values per token (the NUQ row
             normaliser). 0.5 log2(gain) bits per element is what it is worth at high rate.
  gain_F     the same in Fisher units (rows times sqrt of the diagonal Fisher), raw
             values: what `transform_coding.py` codes.
  r2, r2_F   held-out R^2 of a ridge-regularised linear predictor of this layer's rows
             (normalised as for `gain`; Fisher-weighted raw for r2_F) from the previous
             layer's K and V (true, not reconstructed: an upper bound for AQUA-KV).
  err_1d/2d/4d  held-out Fisher-weighted error sum(F (x - x_hat)^2) of shared k-means
             codebooks over 1, 2 and 4 channels at equal bits (2^b, 2^2b, 2^4b
             centroids, at most --max-centroids), in the NUQ-normalised domain (keys: per-channel range from the
             0.5/99.5% quantiles; values: per-row range); keys' 2-D groups are RoPE pairs
             (i, i + D/2), 4-D two neighbouring pairs; values' groups are neighbours.
  err_tc     the same error for `transform_coding.py` (Fisher-weighted KLT, bits allocated over
             the coordinates, b * D code bits per row plus a 16-bit row scale).
  fisher     the layer-side's share of the total Fisher sum; share_1d its share of the
             total 1-D error (where the loss goes).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transform_coding as tc  # bench/transform_coding.py: the measured prototype
from _common import calibration_kv  # bench/_common.py
from rich.console import Console
from rich.table import Table

from kvq.quant import nuq, vq

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def vq_error(xn, f, n, bits, m, pairs):
    """xn [N, D] normalised rows, f [N, D] Fisher x scale^2 (error weights in raw units):
    the held-out error of a shared m-D codebook (`kvq.quant.vq`, what `kvq calibrate vq`
    fits), m = 1 being scalar NUQ's weighted k-means."""
    d = xn.shape[1]
    g = torch.arange(d)[:, None] if m == 1 else vq.channel_groups(d, m, pairs)
    vec, wv = xn[:, g].clamp(-1, 1), f[:, g]  # [N, D/m, m]
    c = vq.fit_codebook(vec[:n].reshape(-1, m), wv[:n].reshape(-1, m), bits) if m > 1 else None
    if m == 1:
        c = nuq.fit_codebook(vec[:n].reshape(-1), bits, wv[:n].reshape(-1), max_samples=60_000)
        c = c[:, None]
    hx, hw = vec[n:].reshape(-1, m), wv[n:].reshape(-1, m)
    rec = c[vq._assign(hx, hw, c)]
    # the clamp is part of the quantizer: error against the unclamped rows
    return float((hw * (rec - xn[n:, g].reshape(-1, m)) ** 2).sum())


def normalised(x: torch.Tensor, side: str, n: int):
    """x [N, D] -> (normalised rows for gain/R^2, NUQ-domain rows, raw-unit scale [N, D])."""
    if side == "key":
        mu, sd = x[:n].mean(0), x[:n].std(0).clamp_min(1e-6)
        lo, hi = x[:n].quantile(0.005, 0), x[:n].quantile(0.995, 0)
        scale, center = (t.float() for t in nuq.normalizer(lo, hi))
        return (x - mu) / sd, (x - center) / scale, scale.expand_as(x)
    scale, center = (t.float()[:, None] for t in nuq.normalizer(x.amin(-1), x.amax(-1)))
    xn = (x - center) / scale
    return xn, xn, scale.expand_as(x)


def held_gain(y: torch.Tensor, n: int) -> float:
    fit = y[:n] - y[:n].mean(0)
    _, vec = torch.linalg.eigh(fit.T @ fit)
    var = ((y[n:] - y[:n].mean(0)) @ vec).var(0)
    return tc.coding_gain(var)


def r_squared(prev: torch.Tensor, y: torch.Tensor, n: int, w: torch.Tensor | None = None):
    """Held-out R^2 of ridge regression y ~ [prev, 1]; w [D] error weights or None."""
    a = torch.cat([prev, torch.ones(prev.shape[0], 1, dtype=prev.dtype)], 1)
    ata = a[:n].T @ a[:n]
    ridge = 1e-3 * ata.diagonal().mean() * torch.eye(ata.shape[0], dtype=ata.dtype)
    coef = torch.linalg.solve(ata + ridge, a[:n].T @ y[:n])
    err = y[n:] - a[n:] @ coef
    dev = y[n:] - y[:n].mean(0)
    w = torch.ones(y.shape[1], dtype=y.dtype) if w is None else w
    return float(1 - (err.square() * w).sum() / (dev.square() * w).sum())


def tc_error(x: torch.Tensor, f: torch.Tensor, n: int, bits: int) -> float:
    """Held-out Fisher-weighted error of transform coding at bits * D code bits per row."""
    fitted = tc.fit_basis(x[:n, None], f[None])
    widths = tc.allocate([fitted["variance"][0]], [bits * x.shape[1]])[0]
    state = tc.stored_state(fitted, widths)
    zn = tc.row_normalised(x[:n, None], state)[:, 0]
    state |= tc.fit_levels(zn, state["widths"].long())
    w = state["widths"].long()
    codes, r = tc.encode(x[None, None, n:], state, w)
    rec = tc.decode(codes, r, state, w)[0, 0]
    return float(((rec - x[n:]) ** 2 * f).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--bits", default="2,3")
    ap.add_argument("--layers", default="", help="comma-separated layers (default: all)")
    ap.add_argument(
        "--max-centroids", type=int, default=256, help="skip codebooks larger than this"
    )
    ap.add_argument("--calibration", default=str(SHARED / "calibration" / "groups_merged.txt"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    console = Console(stderr=True)
    loaded, keys, values, fisher = calibration_kv(
        args.model, args.calibration, args.samples, args.seqlen, 1, "pre-rope"
    )
    n_layers = loaded.adapter.info.num_layers
    layers = [int(s) for s in args.layers.split(",")] if args.layers else list(range(n_layers))
    bits_list = [int(b) for b in args.bits.split(",")]
    total_f = float(fisher.key.sum() + fisher.value.sum())
    rows = []
    t0 = time.time()
    for layer in layers:
        for side, xs, fs in (("key", keys, fisher.key), ("value", values, fisher.value)):
            for head in range(xs[layer].shape[1]):
                x = xs[layer][:, head].double()
                f = fs[layer][head].double()
                n = x.shape[0] // 2
                y, xn, scale = normalised(x, side, n)
                row = {
                    "layer": layer, "side": side, "head": head,
                    "fisher": float(f.sum()) / total_f,
                    "gain": held_gain(y, n),
                    "gain_F": held_gain((x - x[:n].mean(0)) * f.sqrt(), n),
                }  # fmt: skip
                if layer > 0:
                    prev = torch.cat([keys[layer - 1][:, head], values[layer - 1][:, head]], 1)
                    row["r2"] = r_squared(prev.double(), y, n)
                    row["r2_F"] = r_squared(prev.double(), x, n, f)
                wf = (f * scale**2).float()
                for bits in bits_list:
                    dims = [m for m in (1, 2, 4) if 2 ** (bits * m) <= args.max_centroids]
                    for m in dims:
                        e = vq_error(xn.float(), wf, n, bits, m, side == "key")
                        row[f"err_{m}d_{bits}"] = e
                    row[f"err_tc_{bits}"] = tc_error(x.float(), f.float(), n, bits)
                rows.append(row)
        console.print(f"layer {layer} done ({time.time() - t0:.0f} s)")
    for bits in bits_list:
        for side in ("key", "value"):
            tot = sum(r[f"err_1d_{bits}"] for r in rows if r["side"] == side) or 1.0
            for r in rows:
                if r["side"] == side:
                    r[f"share_1d_{bits}"] = r[f"err_1d_{bits}"] / tot
    table = Table(title=f"{args.model}: held-out K/V statistics (errors relative to 1-D)")
    cols = ["layer", "side", "fisher", "gain", "gain_F", "r2", "r2_F"]
    for bits in bits_list:
        cols += [f"2d/1d@{bits}", f"4d/1d@{bits}", f"tc/1d@{bits}"]
    for c in cols:
        table.add_column(c)
    for r in rows:
        cells = [str(r["layer"]), r["side"], f"{r['fisher']:.3f}", f"{r['gain']:.2f}"]
        cells += [f"{r['gain_F']:.2f}", f"{r.get('r2', float('nan')):.3f}"]
        cells += [f"{r.get('r2_F', float('nan')):.3f}"]
        for bits in bits_list:
            one = r[f"err_1d_{bits}"]
            for m in ("2d", "4d", "tc"):
                e = r.get(f"err_{m}_{bits}")
                cells.append("-" if e is None else f"{e / one:.3f}")
        table.add_row(*cells)
    Console().print(table)
    summary = {}
    for side in ("key", "value"):
        mine = [r for r in rows if r["side"] == side]
        s = {"fisher": sum(r["fisher"] for r in mine)}
        for bits in bits_list:
            one = sum(r[f"err_1d_{bits}"] for r in mine)
            for m in ("2d", "4d", "tc"):
                if f"err_{m}_{bits}" in mine[0]:
                    s[f"{m}/1d@{bits}"] = sum(r[f"err_{m}_{bits}"] for r in mine) / one
        summary[side] = s
    Console().print(summary)
    if args.json:
        out = {"model": args.model, "samples": args.samples, "seqlen": args.seqlen}
        args.json.write_text(json.dumps(out | {"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
