"""How much of a cache's squared error must go before its loss meets a target?

Scores one artifact's cache with the error of its encoded rows scaled: every main row
the attention reads is exact + s * (decoded - exact), s = sqrt(kept MSE fraction), on
keys, values or both (sink, prefix and residual rows stay as the cache keeps them). s = 1
is the artifact's own cache; s = 0.707 is a code with half the squared error at the same
bits, e.g. what a better quantizer would have to reach. All caches are scored against one
baseline forward per window (`evaluate_many`, prefill protocol).

    python bench/error_scale.py --artifact A [--mse 1,0.75,0.5,0.25] [--sides both]
        [--exact worst:0.04,first:10,norm:0.02] [--windows 8] [--seqlen 512] [--json F]

Prints perplexity ratio, KLD and top-1 per (side, kept MSE fraction); `--exact` adds
caches at full error with some rows kept exact (the worst-encoded fraction, the first
n, the largest keys): what token-level exceptions could buy. The rows' exact values are
what the cache was handed (keys pre-RoPE where the cache stores them so); the scaled
rows are handed to attention as full-precision rows, so the reference path scores them
(a measurement, not a cache: nothing here is stored compressed). The row "cache" is the
artifact's cache itself: it differs from "both 1" only in the order of fp32 arithmetic,
which flips a few codes downstream; the gap between the two is the noise floor of a
comparison between caches on these windows.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import torch
from _common import add_data_args, load_model_and_windows, result_figures, write_json
from rich.console import Console
from rich.table import Table

from kvq.artifacts.compat import load_artifact
from kvq.eval.quality import evaluate_many
from kvq.pipeline import apply_transforms, cache_for
from kvq.progress import Progress
from kvq.runtime.layers import KvqLayer
from kvq.runtime.packed import PackedRows, decode_packed

_append_main = KvqLayer._append_main
_segments = KvqLayer.segments


def _recording_append(self, main, key, value, flat, positions, backend):
    """`_append_main` that also keeps the exact rows it encodes: [B, H, T, D] float32."""
    out = _append_main(self, main, key, value, flat, positions, backend)
    k, v = key.float(), value.float()
    if main.length and getattr(self, "exact_rows", None) is not None:
        k = torch.cat([self.exact_rows[0], k], dim=2)
        v = torch.cat([self.exact_rows[1], v], dim=2)
    self.exact_rows = (k, v)
    return out


def _scaled_segments(self, state):
    """`segments` with the main (encoded) segment replaced by exact + s * error."""
    segments = _segments(self, state)
    scale = getattr(self, "error_scale", None)
    if scale is None:
        return segments
    out = []
    for seg in segments:
        if seg.key.kind == "full":
            out.append(seg)
            continue
        exact_k, exact_v = self.exact_rows
        rows = state.main.length
        exact_k, exact_v = exact_k[:, :, -rows:], exact_v[:, :, -rows:]
        k = decode_packed(seg.key)  # [B, H, T, D] (pre-RoPE when the cache stores it so)
        v = decode_packed(seg.value)
        if k.shape != exact_k.shape:
            raise SystemExit(f"rows out of step: decoded {tuple(k.shape)}, {tuple(exact_k.shape)}")
        k = exact_k + scale[0] * (k - exact_k)
        v = exact_v + scale[1] * (v - exact_v)
        keep = getattr(self, "exact_rule", None)
        if keep is not None:  # these rows exact on both sides: [B, H, T] bool
            chosen = _exact_rows(keep, k - exact_k, v - exact_v, exact_k)
            k = torch.where(chosen[..., None], exact_k, k)
            v = torch.where(chosen[..., None], exact_v, v)
        key = PackedRows("full", seg.key.head_dim, k, pre_rope=seg.key.pre_rope)
        value = PackedRows("full", seg.value.head_dim, v)
        out.append(replace(seg, key=key, value=value))
    return out


def _exact_rows(rule: tuple[str, float], err_k, err_v, exact_k):
    """[B, H, T] rows a rule keeps exact: ("worst", f) the fraction f of each (sequence,
    head)'s rows with the largest relative squared error, keys and values together;
    ("first", n) the first n encoded rows; ("norm", f) the fraction f of largest key norms."""
    kind, amount = rule
    b, h, t, _ = err_k.shape
    if kind == "first":
        return (torch.arange(t) < amount).expand(b, h, t)
    if kind == "worst":
        score = err_k.square().sum(-1) / err_k.square().sum(-1).mean(-1, keepdim=True)
        score = score + err_v.square().sum(-1) / err_v.square().sum(-1).mean(-1, keepdim=True)
    else:
        score = exact_k.square().sum(-1)
    n = max(1, round(amount * t))
    top = score.topk(n, dim=-1).indices  # [B, H, n]
    return torch.zeros(b, h, t, dtype=torch.bool).scatter_(-1, top, True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_data_args(ap, calibration=False)
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--mse", default="1,0.75,0.5,0.25", help="kept fractions of the MSE")
    ap.add_argument("--sides", default="both", help="comma list of both, keys, values")
    ap.add_argument("--exact", default="", help="also: rows kept exact at full error, e.g. "
                    "worst:0.04,first:10,norm:0.02 (see _exact_rows)")  # fmt: skip
    ap.set_defaults(windows=8)  # about 20 minutes for the default grid on this machine
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    KvqLayer._append_main = _recording_append
    KvqLayer.segments = _scaled_segments

    loaded, _, ev = load_model_and_windows(args, calibration=False)
    artifact = load_artifact(args.artifact, loaded)
    apply_transforms(loaded, artifact.tensors, Progress())  # e.g. rotated values
    runs = {}

    def plain():  # the cache itself, unpatched: must score as "both:1"
        return cache_for(loaded, artifact=artifact, backend="reference")

    runs["cache:1"] = plain
    for side in args.sides.split(","):
        for kept in (float(x) for x in args.mse.split(",")):
            s = math.sqrt(kept)
            scale = {"both": (s, s), "keys": (s, 1.0), "values": (1.0, s)}[side]

            def make(scale=scale):
                cache = cache_for(loaded, artifact=artifact, backend="reference")
                for layer in cache.layers:
                    layer.error_scale = scale
                    layer.exact_rows = None
                return cache

            runs[f"{side}:{kept:g}"] = make

    for rule in filter(None, args.exact.split(",")):
        kind, amount = rule.split(":")

        def make_exact(rule=(kind, float(amount))):
            cache = cache_for(loaded, artifact=artifact, backend="reference")
            for layer in cache.layers:
                layer.error_scale, layer.exact_rule, layer.exact_rows = (1.0, 1.0), rule, None
            return cache

        runs[f"exact {rule}:1"] = make_exact

    def report(i, results):
        rows = []
        for name, r in results.items():
            side, kept = name.rsplit(":", 1)
            rows.append({"side": side, "mse_kept": float(kept), **result_figures(r)})
        write_json(args.json, {"artifact": args.artifact, "policy": artifact.manifest.policy.name,
                               "windows_done": i + 1,
                               "windows": args.windows, "seqlen": args.seqlen, "rows": rows})  # fmt: skip
        if i + 1 == args.windows:
            table = Table(title=f"error scaled: {args.artifact}, {i + 1} x {args.seqlen}")
            for c in ("side", "MSE kept", "ratio", "KLD", "top-1"):
                table.add_column(c)
            for r in rows:
                table.add_row(r["side"], f"{r['mse_kept']:g}", f"{r['ratio']:.4f}",
                              f"{r['kld']:.5f}", f"{r['top1']:.3f}")  # fmt: skip
            Console().print(table)

    evaluate_many(loaded.model, ev.ids, runs, Progress(), on_window=report)


if __name__ == "__main__":
    main()
