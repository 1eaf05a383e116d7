"""Offline check of KVQuant's remaining levers: does a change to the codebook fit or the
value normaliser lower the Fisher-weighted reconstruction error on held-out rows?

    .venv/bin/python bench/kvquant_levers.py [--bits 3] [--samples 16] [--seqlen 512]
                                             [--layer-step 2] [--json FILE]

Captures the calibration K (pre-RoPE) and V of every layer as `kvq calibrate kvquant` does
(sink rows left out), fits on the first half of the rows and measures on the second half
sum(F_c * (x_hat - x)^2), F the cached diagonal Fisher of that layer, exceptions (1%) kept
exact. Each lever is reported relative to the shipped fit (Fisher-weighted k-means over the
normalised inliers):

  values  fisher-scale2   k-means weighted by Fisher x the row normaliser's scale^2 (the
                          error in original units)
          plain           unweighted k-means
          channel-scale   V divided per channel by m_c = (rms_c / mean rms)^1/2 *
                          (F_c / mean F)^-1/4 before per-token quantisation, multiplied
                          back after: a calibrated per-channel value state, which the
                          issue's design (values need nothing calibrated but the codebook)
                          leaves out
  keys    fisher-scale2   as for values, with the per-channel normaliser
          plain           unweighted k-means

A proxy (no Q-Norm, equal-quantile key thresholds): it ranks levers quickly, while
`kvq run-eval` measures the model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvq.calibrators.fisher import fisher_cached
from kvq.calibrators.kvquant import capture_kv
from kvq.models.loading import load_model
from kvq.pipeline import load_windows
from kvq.progress import Progress
from kvq.quant import nuq, sparse

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
FRACTION = 0.01


def _codebook(xn, inlier, weights, bits):
    """Codebook over normalised inliers of the fitting half; weights [N, D] or None."""
    return nuq.fit_codebook(xn[inlier], bits, None if weights is None else weights[inlier])


def _error(x, x_hat, inlier, fisher):
    """Fisher-weighted squared error, exceptions exact: x, x_hat [N, D], fisher [D]."""
    return float(((torch.where(inlier, x_hat, x) - x) ** 2 * fisher).sum())


def value_errors(v: torch.Tensor, f: torch.Tensor, bits: int) -> dict[str, float]:
    """v [N, D] one head's values, f [D] its Fisher -> lever -> held-out error."""
    n = v.shape[0] // 2
    rms = v[:n].pow(2).mean(0).sqrt()
    prescale = (rms / rms.mean()).sqrt() * (f / f.mean()).pow(-0.25)  # [D]
    out = {}
    for lever in ("fisher", "fisher-scale2", "plain", "channel-scale"):
        m = prescale if lever == "channel-scale" else torch.ones_like(rms)
        y = v / m
        idx, _, lo, hi = sparse.row_outliers(y, FRACTION, "range")
        inlier = torch.ones_like(y, dtype=torch.bool).scatter(-1, idx.long(), False)
        scale, center = (t.float()[:, None] for t in nuq.normalizer(lo, hi))
        yn = (y - center) / scale
        weights = {"plain": None, "fisher-scale2": f * scale**2}.get(lever, f.expand_as(y))
        cb = _codebook(yn[:n], inlier[:n], None if weights is None else weights[:n], bits)
        y_hat = nuq.nuq_decode(nuq.nuq_encode(yn[n:], cb), cb) * scale[n:] + center[n:]
        out[lever] = _error(v[n:], y_hat * m, inlier[n:], f)
    return out


def key_errors(k: torch.Tensor, f: torch.Tensor, bits: int) -> dict[str, float]:
    """k [N, D] one head's pre-RoPE keys, f [D] its Fisher -> lever -> held-out error."""
    n = k.shape[0] // 2
    lower, upper = sparse.channel_thresholds(k[:n, None], FRACTION)  # [1, D]
    inlier = ~sparse.threshold_outliers(k[:, None], lower, upper)[:, 0]
    scale, center = (t.float()[0] for t in nuq.normalizer(lower, upper))
    kn = (k - center) / scale
    out = {}
    for lever in ("fisher", "fisher-scale2", "plain"):
        weights = {"plain": None, "fisher-scale2": (f * scale**2).expand_as(k)}.get(
            lever, f.expand_as(k)
        )
        cb = _codebook(kn[:n], inlier[:n], None if weights is None else weights[:n], bits)
        k_hat = nuq.nuq_decode(nuq.nuq_encode(kn[n:], cb), cb) * scale + center
        out[lever] = _error(k[n:], k_hat, inlier[n:], f)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--layer-step", type=int, default=2, help="every n-th layer")
    ap.add_argument("--calibration", default=str(SHARED / "calibration" / "groups_merged.txt"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    console = Console(stderr=True)
    loaded = load_model(args.model)
    cal = load_windows(loaded, args.calibration, args.samples, args.seqlen, 0, None)
    progress = Progress()
    fisher = fisher_cached(
        loaded.model, loaded.adapter, cal.ids, cal.fingerprint,
        loaded.identity.weights_sha256, progress, exclude_first=1,
    )  # fmt: skip
    with torch.no_grad():
        keys, values = capture_kv(loaded.model, loaded.adapter, cal.ids, 1, "pre-rope", progress)
    totals = {"keys": {}, "values": {}}
    for layer in range(0, loaded.adapter.info.num_layers, args.layer_step):
        for head in range(keys[layer].shape[1]):
            for side, errors, x, f in (
                ("keys", key_errors, keys[layer], fisher.key[layer]),
                ("values", value_errors, values[layer], fisher.value[layer]),
            ):
                for lever, e in errors(x[:, head].float(), f[head].float(), args.bits).items():
                    totals[side][lever] = totals[side].get(lever, 0.0) + e
        console.print(f"layer {layer} done")
    rows = [
        {"side": side, "lever": lever, "error": e, "relative": e / levers["fisher"]}
        for side, levers in totals.items()
        for lever, e in levers.items()
    ]
    table = Table(title=f"{args.model}: held-out Fisher-weighted error, {args.bits} bits")
    for col in ("side", "lever", "relative to the shipped fit"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["side"], r["lever"], f"{r['relative']:.3f}")
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({"bits": args.bits, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
