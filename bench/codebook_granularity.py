"""Codebook granularity of scalar KVQuant NUQ: one codebook per layer-side (today), per
channel, or per group of channels with a similar shape?

    OMP_NUM_THREADS=1 .venv/bin/python bench/codebook_granularity.py [--bits 2,3,4]
        [--layers 0,1,...] [--cache /tmp/kvq_cbgran_kv.safetensors] [--json FILE]

Captures the calibration K (pre-RoPE) and V of `kvq calibrate kvquant`'s windows (16 x 512
of groups_merged, seed 0, sink 1: so the Fisher sums come from kvq's cache) once, caches
them under /tmp, and per layer, side and width fits on the first half of the rows and
measures on the held-out second half, with kvquant's own normalisers and exceptions
(keys: Fisher-allocated thresholds at the held-out-scaled fraction; values: per-row range
with round(1% D) exceptions) and kvq's own weighted k-means (`nuq.fit_codebook`):

  today     one codebook per layer-side: `kvquant._levels` (inliers pooled, weights =
            the diagonal Fisher)
  today_s2  the same pool weighted by Fisher x scale^2 (the error's own weights)
  channel   one codebook per (head, channel)
  std{k}    k groups of channels by the std of their normalised inliers (equal counts)
  hist{k}   k groups by k-means over the channels' normalised inlier histograms

The error is the held-out Fisher-weighted squared error in original units over inliers
(exceptions are exact): sum F[h, d] scale^2 (x_norm - level)^2, as `vq._error` weighs it,
with levels as fitted ("err") and after Q-Norm ("err_q", what the runtime decodes with).
Side "value_rot" is the values rotated by the randomized Hadamard `kvq calibrate rotate`
folds into v_proj/o_proj (seed 0); its diagonal Fisher is diag(R^T diag(F) R) = mean(F)
for every channel (a Hadamard spreads each channel evenly), ignoring off-diagonal Fisher.
Static bytes: fp16 levels (and as many Q-Norm levels) per codebook, plus one uint8 group
id per channel for the grouped variants, per element of a T-token cache.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from _common import calibration_kv  # bench/_common.py
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file, save_file
from sklearn.cluster import KMeans

from kvq.calibrators.kvquant import (
    KVQuantOptions,
    _key_thresholds,
    _levels,
    _qnorm_levels,
    key_fraction,
    value_rows,
)
from kvq.calibrators.rotation import random_rotation
from kvq.errors import KvqError
from kvq.quant import nuq, sparse

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
GROUP_COUNTS = (4, 16)
HIST_BINS = 32


def captured(args, opts: KVQuantOptions):
    """(keys, values, fisher_key, fisher_value): per layer [N, H, D] and [L, H, D], from
    --cache when it was written for the same windows, else captured (and cached)."""
    if args.cache.exists():
        t = load_file(args.cache)
        n = int(t["layers"])
        return [t[f"k{i}"] for i in range(n)], [t[f"v{i}"] for i in range(n)], t["fk"], t["fv"]
    _, keys, values, fisher = calibration_kv(
        args.model, args.calibration, args.samples, args.seqlen, opts.sink, opts.key_stage
    )
    t = {f"k{i}": k.contiguous() for i, k in enumerate(keys)}
    t |= {f"v{i}": v.contiguous() for i, v in enumerate(values)}
    t |= {"fk": fisher.key.float(), "fv": fisher.value.float()}
    save_file(t | {"layers": torch.tensor(len(keys))}, args.cache)
    return keys, values, fisher.key.float(), fisher.value.float()


def key_split(x: torch.Tensor, f: torch.Tensor, opts: KVQuantOptions, n: int):
    """Keys [N, H, D]: kvquant's static normaliser and thresholds fitted on rows [:n];
    per half (normalised rows, inlier mask, error weights F x scale^2 [.., H, D])."""
    fit = x[:n]
    lower, upper = _key_thresholds(fit, f, opts, key_fraction(fit, f, opts))
    scale, center = nuq.normalizer(lower, upper)
    w = f * scale.float() ** 2  # [H, D]
    out = []
    for part in (x[:n], x[n:]):
        inlier = ~sparse.threshold_outliers(part, lower, upper)
        out.append((nuq.normalize(part, scale, center), inlier, w.expand_as(part)))
    return out


def value_split(x: torch.Tensor, f: torch.Tensor, opts: KVQuantOptions, n: int):
    """Values [N, H, D]: the runtime's per-row normaliser and exceptions, per half."""
    out = []
    for part in (x[:n], x[n:]):
        inlier, scale, center = value_rows(part, opts.value_outliers)
        xn = nuq.normalize(part, scale[..., None], center[..., None])
        out.append((xn, inlier, f * scale.float()[..., None] ** 2))
    return out


def held_error(xn, inlier, w, codebook, levels) -> float:
    """Fisher-weighted squared error of encoding xn [M] with codebook, decoding with levels."""
    # a lookup, not nuq_decode: Q-Norm levels of a constant channel are all equal
    rec = levels.float()[nuq.nuq_encode(xn, codebook).long()]
    return float((w * inlier * (rec - xn) ** 2).sum())


def fit_or_fallback(vals, bits, wts, opts) -> torch.Tensor:
    """kvq's weighted k-means; a channel with fewer positively weighted distinct values
    than levels (zero Fisher: it weighs nothing in the error) gets the unweighted fit, or
    the uniform levels if the channel is (nearly) constant."""
    for w in (wts, None):
        try:
            return nuq.fit_codebook(vals, bits, w, seed=opts.seed, max_samples=opts.max_samples)
        except KvqError:
            pass
    return nuq.uniform_codebook(bits)


def grouped(fit, held, f, labels, opts, bits, weight_s2=False) -> tuple[float, float]:
    """(err, err_q) on the held-out half of codebooks fitted per group: labels [H, D] ints."""
    (xf, mf, wf), (xh, mh, wh) = fit, held
    fisher = f.expand_as(xf)
    err = err_q = 0.0
    for g in labels.unique().tolist():
        sel = labels == g  # [H, D]
        vals, m = xf[:, sel], mf[:, sel]
        wts = (wf if weight_s2 else fisher)[:, sel][m]
        cb = fit_or_fallback(vals[m], bits, wts, opts)
        q = _qnorm_levels(vals[m], cb) if opts.qnorm else cb
        hx, hm, hw = xh[:, sel], mh[:, sel], wh[:, sel]
        err += held_error(hx, hm, hw, cb, cb)
        err_q += held_error(hx, hm, hw, cb, q)
    return err, err_q


def channel_labels(fit, kind: str, k: int, seed: int) -> torch.Tensor:
    """[H, D] group ids: k equal-count std bands, or k-means over inlier histograms."""
    xf, mf, _ = fit
    h, d = xf.shape[1:]
    feats, stds = [], []
    for hi in range(h):
        for di in range(d):
            v = xf[:, hi, di][mf[:, hi, di]]
            stds.append(float(v.std()))
            hist = torch.histc(v.clamp(-1, 1), HIST_BINS, -1.0, 1.0)
            feats.append(hist / hist.sum().clamp_min(1))
    if kind == "std":
        order = torch.tensor(stds).argsort()
        labels = torch.empty(h * d, dtype=torch.long)
        labels[order] = torch.arange(h * d) * k // (h * d)
        return labels.reshape(h, d)
    km = KMeans(n_clusters=k, n_init=4, random_state=seed).fit(torch.stack(feats).numpy())
    return torch.from_numpy(km.labels_).long().reshape(h, d)


def measure(fit, held, f, opts, bits, variants) -> dict[str, float]:
    """Per variant err and err_q of one layer-side at one width."""
    (xf, mf, _), (xh, mh, wh) = fit, held
    h, d = xf.shape[1:]
    out = {}
    lv = _levels(xf, mf, f, opts, bits)
    cb = lv["codebook"]
    out["today"] = held_error(xh, mh, wh, cb, cb)
    out["today_q"] = held_error(xh, mh, wh, cb, lv.get("qnorm_levels", cb))
    one = torch.zeros(h, d, dtype=torch.long)
    out["today_s2"], out["today_s2_q"] = grouped(fit, held, f, one, opts, bits, True)
    if "channel" in variants:
        labels = torch.arange(h * d).reshape(h, d)
        out["channel"], out["channel_q"] = grouped(fit, held, f, labels, opts, bits)
    for kind in ("std", "hist"):
        if kind not in variants:
            continue
        for k in GROUP_COUNTS:
            labels = channel_labels(fit, kind, k, opts.seed)
            out[f"{kind}{k}"], out[f"{kind}{k}_q"] = grouped(fit, held, f, labels, opts, bits)
    return out


def static_bits(variant: str, bits: int, head_dim: int, tokens: int, qnorm: bool) -> float:
    """Static bits per cached element (one KV head) a variant adds beyond today's."""
    per_book = 2**bits * 16 * (2 if qnorm else 1)  # fp16 levels (+ Q-Norm levels)
    books = {"today": 1, "today_s2": 1, "channel": head_dim}
    if variant in books:
        extra = (books[variant] - 1) * per_book
    else:
        extra = (int(variant.lstrip("stdhi")) - 1) * per_book + 8 * head_dim  # + uint8 ids
    return extra / (tokens * head_dim)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--calibration", default=str(SHARED / "calibration" / "groups_merged.txt"))
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--layers", default="", help="comma-separated layers (default: all)")
    ap.add_argument("--sides", default="key,value,value_rot")
    ap.add_argument("--variants", default="channel,std,hist")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/kvq_cbgran_kv.safetensors"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path, help="also write the tables as Markdown")
    ap.add_argument("--render", type=Path, help="only print (and --md) a --json written before")
    args = ap.parse_args()
    if args.render:
        payload = json.loads(args.render.read_text())
        return write(args, payload["rows"], 0, KVQuantOptions(), payload)
    torch.set_num_threads(1)
    opts = KVQuantOptions()
    keys, values, fk, fv = captured(args, opts)
    n_layers, head_dim = len(keys), keys[0].shape[-1]
    layers = [int(s) for s in args.layers.split(",")] if args.layers else list(range(n_layers))
    bits_list = [int(b) for b in args.bits.split(",")]
    variants = set(args.variants.split(","))
    gen = torch.Generator().manual_seed(0)  # `kvq calibrate rotate --seed 0`: layer-major draws
    rot = [torch.stack([random_rotation(head_dim, gen) for _ in range(keys[0].shape[1])])
           for _ in range(n_layers)]  # fmt: skip
    rows, t0 = [], time.time()
    for layer in layers:
        n = keys[layer].shape[0] // 2
        for side in args.sides.split(","):
            if side == "key":
                f = fk[layer]
                fit, held = key_split(keys[layer], f, opts, n)
            elif side == "value":
                f = fv[layer]
                fit, held = value_split(values[layer], f, opts, n)
            else:  # rotated values: x R per head; diag(R^T diag(F) R) = mean(F)
                x = torch.einsum("nhd,hde->nhe", values[layer], rot[layer])
                f = fv[layer].mean(-1, keepdim=True).expand_as(fv[layer]).contiguous()
                fit, held = value_split(x, f, opts, n)
            for bits in bits_list:
                row = {"layer": layer, "side": side, "bits": bits}
                rows.append(row | measure(fit, held, f, opts, bits, variants))
        Console(stderr=True).print(f"layer {layer} done ({time.time() - t0:.0f} s)")
        if args.json:
            write(args, rows, head_dim, opts, show=False)  # keep what is done if stopped
    write(args, rows, head_dim, opts)


def variant_names(rows) -> list[str]:
    return [k for k in rows[0] if k not in ("layer", "side", "bits") and not k.endswith("_q")]


def summarise(rows, head_dim, opts):
    names = variant_names(rows)
    summary = []
    for side in dict.fromkeys(r["side"] for r in rows):
        for bits in dict.fromkeys(r["bits"] for r in rows):
            mine = [r for r in rows if r["side"] == side and r["bits"] == bits]
            base, base_q = sum(r["today"] for r in mine), sum(r["today_q"] for r in mine)
            s = {"side": side, "bits": bits, "today_err": base, "today_err_q": base_q}
            for v in names:
                s[v] = sum(r[v] for r in mine) / base
                s[v + "_q"] = sum(r[v + "_q"] for r in mine) / base_q
                s[v + "_min_layer"] = min(r[v] / r["today"] for r in mine)
                s[v + "_max_layer"] = max(r[v] / r["today"] for r in mine)
                for t in (512, 4096):
                    s[f"{v}_static_bits_{t}"] = static_bits(v, bits, head_dim, t, opts.qnorm)
            summary.append(s)
    return names, summary


def markdown(names, summary, rows) -> str:
    """The summary (ratios to today's codebook, Q-Norm decode in parentheses, static bits
    per element at 512 / 4096 tokens) and the per-layer ratios of channel and hist16."""
    out = ["| side | bits | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for s in summary:
        cells = [f"{s[v]:.3f} ({s[v + '_q']:.3f})" for v in names]
        out.append(f"| {s['side']} | {s['bits']} | " + " | ".join(cells) + " |")
    out += ["", "Static bits per element added (at 512 / 4096 tokens):", ""]
    out += ["| bits | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for bits in dict.fromkeys(s["bits"] for s in summary):
        s = next(s for s in summary if s["bits"] == bits)
        cells = [
            f"{s[f'{v}_static_bits_512']:.3f} / {s[f'{v}_static_bits_4096']:.4f}" for v in names
        ]
        out.append(f"| {bits} | " + " | ".join(cells) + " |")
    bits_list = list(dict.fromkeys(r["bits"] for r in rows))
    per = [v for v in ("channel", "hist16") if v in names]
    out += ["", "Per layer, ratio to today's codebook (error with levels as fitted):", ""]
    head = [f"{v}@{b}" for v in per for b in bits_list]
    out += ["| layer | side | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    for layer in dict.fromkeys(r["layer"] for r in rows):
        for side in dict.fromkeys(r["side"] for r in rows):
            mine = {r["bits"]: r for r in rows if r["layer"] == layer and r["side"] == side}
            cells = [f"{mine[b][v] / mine[b]['today']:.3f}" for v in per for b in bits_list]
            out.append(f"| {layer} | {side} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def write(args, rows, head_dim, opts, payload=None, show: bool = True) -> None:
    if payload is None:
        names, summary = summarise(rows, head_dim, opts)
    else:  # as measured (static bits need the run's head_dim)
        names, summary = variant_names(rows), payload["summary"]
    table = Table(title="held-out Fisher-weighted error / today's per-layer codebook (Q-Norm)")
    for c in ["side", "bits", *names]:
        table.add_column(c)
    for s in summary:
        cells = [s["side"], str(s["bits"])]
        cells += [f"{s[v]:.3f} ({s[v + '_q']:.3f})" for v in names]
        table.add_row(*cells)
    if show:
        Console().print(table)
    if args.md and show:
        args.md.write_text(markdown(names, summary, rows))
    if args.json and payload is None:
        meta = {"model": args.model, "samples": args.samples, "seqlen": args.seqlen,
                "calibration": Path(args.calibration).name, "fit": "first half of rows",
                "measure": "second half", "outliers": opts.outliers, "sink": opts.sink,
                "head_dim": head_dim}  # fmt: skip
        args.json.write_text(json.dumps(meta | {"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
