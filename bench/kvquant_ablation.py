"""KVQuant's ablation on our model, every step on the same windows in one run.

    .venv/bin/python bench/kvquant_ablation.py [--bits 3] [--samples 16] [--windows 16]
                                               [--seqlen 512] [--json FILE]

Steps (each adds one idea to the previous one):
  1. uniform post-RoPE per-token K (and per-token V)
  2. per-channel K (static, calibrated, post-RoPE)
  3. pre-RoPE per-channel K
  4. + NUQ: k-means codebooks (K and V), plain
  5. + Fisher-weighted k-means
  6. + 1% dense-and-sparse outliers
  7. + attention sink (first token exact)
  8. + Q-Norm (decoded levels carry the originals' mean and std; kvq's default)
then, unless --no-split, the full configuration with only K or only V quantized (the
other kept exact): where the remaining error comes from.

--lowbit B1,B2,...: instead, for each width, scalar KVQuant (the full configuration above)
then + vector codebooks (`kvq calibrate vq`: the same normalisers, outliers and sink, the
dense codes over 2- or 4-channel groups) then + mixed precision (per-layer, per-side bits
from the Fisher sensitivity at equal total bits: what `kvq calibrate auto` runs), each
with both sides, keys only and values only quantized; then (`--steps ...,trellis,trellis-mixed`)
bit-shift trellis codes (`kvq calibrate trellis`: the same normalisers, outliers and sink,
shared 12-bit tables) with uniform and Fisher-allocated widths (tables charged over
--seqlen tokens). All caches are scored against one
baseline forward per window (`evaluate_many`); the JSON is rewritten after every window.
Prints perplexity ratio, KLD and top-1 agreement against the unquantized model,
and bytes per token against fp16, measured from the caches.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from _common import (
    add_data_args,
    load_model_and_windows,
    result_figures,
    totals_figures,
    write_json,
)
from rich.console import Console
from rich.table import Table

from kvq.calibrators.channel_scales import ChannelScalesOptions, calibrate_channel_scales
from kvq.calibrators.fisher import fisher_cached
from kvq.calibrators.kvquant import KVQuantOptions, calibrate_kvquant
from kvq.calibrators.options import TrellisOptions, VQOptions
from kvq.calibrators.trellis import calibrate_trellis
from kvq.calibrators.vq import calibrate_vq
from kvq.eval.quality import QualityTotals, _accumulate, evaluate_many
from kvq.progress import Progress
from kvq.quant.schemes import FULL_PRECISION, CachePolicy, LayerPolicy, QuantScheme
from kvq.runtime.cache import build_cache


def fisher_sums(loaded, cal, sink: int):
    """(key, value) Fisher sums over the calibration windows, the first `sink` positions
    left out (cached by windows and weights, so every step and width reads them once)."""
    with torch.enable_grad():
        info = fisher_cached(
            loaded.model, loaded.adapter, cal.ids, cal.fingerprint,
            loaded.identity.weights_sha256, Progress(), exclude_first=sink,
        )  # fmt: skip
    return info.key, info.value


def per_token_policy(bits: int, layers: int) -> CachePolicy:
    scheme = QuantScheme(format="int", bits=bits, axis="token")
    return CachePolicy("int-per-token", (LayerPolicy(key=scheme, value=scheme),) * layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_data_args(ap)
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--no-split", action="store_true", help="skip the K-only / V-only rows")
    ap.add_argument("--lowbit", default="", help="e.g. 3,2: scalar NUQ -> + vq -> + mixed")
    ap.add_argument(
        "--steps",
        default="nuq,vq,mixed",
        help="--lowbit rows to run (nuq, vq, mixed, trellis, trellis-mixed)",
    )
    ap.add_argument("--split", default="nuq,vq,mixed", help="--lowbit rows with K/V-only rows")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    console = Console(stderr=True)

    loaded, cal, ev = load_model_and_windows(args)
    model, adapter = loaded.model, loaded.adapter
    layers = adapter.info.num_layers
    if args.lowbit:
        return lowbit(args, loaded, cal, ev, console)
    console.print(f"baseline logits on {args.windows} × {args.seqlen} windows")
    base = [model(ev.ids[i : i + 1]).logits[0, :-1].float() for i in range(ev.ids.shape[0])]

    b = args.bits

    def kvquant(**options):
        """A KVQuant step at --bits; Fisher sums (matching its sink) unless fisher=False."""
        opts = KVQuantOptions(bits=b, **options)
        return lambda: calibrate_kvquant(
            model, adapter, cal.ids, opts, Progress(),
            fisher_sums(loaded, cal, opts.sink) if opts.fisher else None,
        )  # fmt: skip

    def channel_scales(stage: str):
        """Static per-channel INT K at --bits, full range, no sink; per-token V."""
        opts = ChannelScalesOptions(
            bits=b, key_stage=stage, clip_percentile=100.0, sink=0, value_group=None
        )
        return lambda: calibrate_channel_scales(model, adapter, cal.ids, opts, Progress())

    steps = [
        ("uniform post-RoPE per-token K", lambda: (per_token_policy(b, layers), {})),
        ("per-channel K (post-RoPE)", channel_scales("post-rope")),
        ("pre-RoPE per-channel K", channel_scales("pre-rope")),
        ("+ NUQ", kvquant(outliers=0.0, sink=0, fisher=False, qnorm=False)),
        ("+ Fisher weighting", kvquant(outliers=0.0, sink=0, qnorm=False)),
        ("+ 1% sparse", kvquant(outliers=0.01, sink=0, qnorm=False)),
        ("+ sink (1 token)", kvquant(outliers=0.01, sink=1, qnorm=False)),
        ("+ Q-Norm (kvq's default)", kvquant(outliers=0.01, sink=1, qnorm=True)),
    ]
    results = []

    def evaluate(name: str, policy: CachePolicy, static: dict, start: float) -> None:
        totals, ledger = QualityTotals(), None
        for i in range(ev.ids.shape[0]):
            cache = build_cache(model, policy, static, adapter)
            quant = model(ev.ids[i : i + 1], cache=cache).logits[0, :-1].float()
            _accumulate(totals, base[i], quant, ev.ids[i, 1:])
            ledger = cache.nbytes()
        row = {
            "step": name,
            "bits": b,
            **totals_figures(totals),
            "bytes_ratio": ledger.ratio,
            "seconds": round(time.perf_counter() - start, 1),
        }
        results.append(row)
        console.print(
            f"{name:<32} ratio {row['ratio']:.4f}  kld {row['kld']:.4f}  "
            f"bytes {row['bytes_ratio']:.3f}  ({row['seconds']} s)"
        )

    for name, calibrate in steps:
        start = time.perf_counter()
        policy, tensors = calibrate()
        static = {n: t for n, t in tensors.items() if n.startswith("layers.")}
        evaluate(name, policy, static, start)
    if not args.no_split:  # the full configuration, one side at a time
        for side, keep in (("K", "value"), ("V", "key")):
            only = tuple(dataclasses.replace(lp, **{keep: FULL_PRECISION}) for lp in policy.layers)
            name = f"  {side} only (other side exact)"
            evaluate(name, CachePolicy(f"{policy.name}-{side}", only), static, time.perf_counter())

    table = Table(
        title=f"KVQuant ablation · {args.model} · {b}-bit · WikiText-2 "
        f"{args.windows}×{args.seqlen} · prefill"
    )
    for col in ("step", "perplexity", "ratio", "KLD", "top-1", "bytes/fp16"):
        table.add_column(col, justify="left" if col == "step" else "right")
    for r in results:
        table.add_row(
            r["step"],
            f"{r['ppl']:.3f}",
            f"{r['ratio']:.4f}",
            f"{r['kld']:.4f}",
            f"{r['top1']:.3f}",
            f"{r['bytes_ratio']:.3f}",
        )
    Console().print(table)
    Console().print(f"baseline perplexity {results[0]['ppl_baseline']:.3f}")
    write_json(args.json, {"results": results})


def _distinct_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of `tensors`, each distinct tensor once (shared trellis tables are written with
    every layer and held once by the cache)."""
    seen: list[torch.Tensor] = []
    for t in tensors:
        if not any(s.dtype == t.dtype and s.shape == t.shape and torch.equal(s, t) for s in seen):
            seen.append(t)
    return sum(t.nbytes for t in seen)


def lowbit(args, loaded, cal, ev, console) -> None:
    """Scalar NUQ -> + vector codebooks -> + mixed precision at each width of --lowbit."""
    model, adapter = loaded.model, loaded.adapter
    fisher = fisher_sums(loaded, cal, 1)
    caches, seconds, static_bytes = {}, {}, {}
    # every pass captures the same K/V of the same windows: capture once, hand out copies
    # of the per-layer lists (passes release their entries as they go)
    import kvq.calibrators.kvquant as kvquant_module
    import kvq.calibrators.trellis as trellis_module
    import kvq.calibrators.vq as vq_module

    captured = {}
    original_capture = kvquant_module.capture_kv

    def capture_once(model_, adapter_, windows, sink, stage, progress):
        key = (sink, stage)
        if key not in captured:
            captured[key] = original_capture(model_, adapter_, windows, sink, stage, progress)
        k, v = captured[key]
        return list(k), list(v)

    vq_module.capture_kv = kvquant_module.capture_kv = capture_once
    trellis_module.capture_kv = capture_once
    steps_wanted = set(args.steps.split(","))
    split_wanted = set(args.split.split(","))
    info = adapter.info
    for b in (int(x) for x in args.lowbit.split(",")):
        steps = [
            ("nuq", f"{b}b KVQuant (scalar NUQ)", lambda b=b: calibrate_kvquant(
                model, adapter, cal.ids, KVQuantOptions(bits=b), Progress(), fisher)),
            ("vq", f"{b}b + vector codebooks", lambda b=b: calibrate_vq(
                model, adapter, cal.ids, VQOptions(bits=b), Progress(), fisher)),
            ("mixed", f"{b}b + mixed precision (auto)", lambda b=b: calibrate_vq(
                model, adapter, cal.ids, VQOptions(bits=b, mixed=True), Progress(), fisher)),
            ("trellis", f"{b}b + trellis codes", lambda b=b: calibrate_trellis(
                model, adapter, cal.ids, TrellisOptions(bits=b), Progress(), fisher)),
            ("trellis-mixed", f"{b}b + trellis codes, mixed precision", lambda b=b:
                calibrate_trellis(model, adapter, cal.ids, TrellisOptions(bits=b,
                mixed="fisher"), Progress(), fisher)),
        ]  # fmt: skip
        for step, name, calibrate in steps:
            if step not in steps_wanted:
                continue
            start = time.perf_counter()
            policy, tensors = calibrate()
            seconds[name] = round(time.perf_counter() - start, 1)
            console.print(f"calibrated {name} ({seconds[name]} s): {policy.name}")
            static = {n: t for n, t in tensors.items() if n.startswith("layers.")}
            split = not args.no_split and step in split_wanted
            sides = ("both", "keys", "values") if split else ("both",)
            for side in sides:
                label = name if side == "both" else f"  {name}: {side} only"
                kept = {"both": (".key.", ".value."), "keys": (".key.",), "values": (".value.",)}
                static_bytes[label] = _distinct_bytes(
                    [t for n, t in static.items() if any(k in n for k in kept[side])]
                )
                caches[label] = lambda p=policy.only(side), s=static: build_cache(
                    model, p, s, adapter
                )
    title = f"{args.model} · WikiText-2 {args.windows}×{args.seqlen} · prefill"

    def report(i: int, results) -> None:
        rows = []
        for name, r in results.items():
            led = r.ledger
            rows.append({
                "step": name, "windows": i + 1, **result_figures(r), "ledger": led.to_dict(),
                # static state (codebooks, normalisers: per model, not per token) apart:
                # stored bits per cached K/V element of the quantized sides, sink rows included
                "static_bytes": static_bytes[name],
                "stream_bits_per_element": 8 * (led.total - static_bytes[name] - led.full_precision)
                / (led.tokens * info.num_layers * info.num_kv_heads * info.head_dim
                   * (2 if "only" not in name else 1)),
                "calibration_seconds": seconds.get(name),
            })  # fmt: skip
        write_json(args.json, {"title": title, "results": rows}, indent=1)
        if i + 1 == ev.ids.shape[0]:
            table = Table(title=f"low-bit ablation · {title}")
            for col in ("step", "ratio", "KLD", "top-1", "bytes/fp16", "bits/elem"):
                table.add_column(col, justify="left" if col == "step" else "right")
            for r in rows:
                table.add_row(r["step"], f"{r['ratio']:.4f}", f"{r['kld']:.4f}",
                              f"{r['top1']:.3f}", f"{r['bytes_ratio']:.4f}",
                              f"{r['stream_bits_per_element']:.3f}")  # fmt: skip
            Console().print(table)
            Console().print(f"baseline perplexity {rows[0]['ppl_baseline']:.3f}")

    evaluate_many(model, ev.ids, caches, Progress(), on_window=report)


if __name__ == "__main__":
    main()
