"""The headline quality matrix: every calibrated cache on the same windows, both protocols.

    .venv/bin/python bench/eval_matrix.py [--windows 16] [--seqlen 512] [--protocols prefill,decode]
                                          [--only int8,nuq4] [--json FILE]

Calibrates each configuration on `calibration/groups_merged.txt` (16 × 512),
evaluates on WikiText-2 test and prints perplexity ratio, KLD, top-1 agreement,
bytes per token against fp16 and average stored bits per K/V element, with the
calibration and evaluation seconds. The unquantized baseline is computed once.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvq.calibrators.channel_scales import ChannelScalesOptions
from kvq.calibrators.kvquant import KVQuantOptions
from kvq.eval.quality import evaluate
from kvq.models.loading import load_model
from kvq.pipeline import load_windows, run_pass
from kvq.progress import Progress
from kvq.runtime.cache import build_cache

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"

CONFIGS = {
    "int8": ChannelScalesOptions(bits=8),
    "int4": ChannelScalesOptions(bits=4),
    "nuq4": KVQuantOptions(bits=4),
    "nuq3": KVQuantOptions(bits=3),
    "nuq2": KVQuantOptions(bits=2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--protocols", default="prefill,decode")
    ap.add_argument("--only", default=",".join(CONFIGS))
    ap.add_argument("--calibration", default=str(SHARED / "calibration" / "groups_merged.txt"))
    ap.add_argument("--data-dir", default=str(SHARED))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    console = Console(stderr=True)
    loaded = load_model(args.model)
    info = loaded.adapter.info
    cal = load_windows(loaded, args.calibration, args.samples, args.seqlen, 0, None)
    ev = load_windows(loaded, "wikitext2", args.windows, args.seqlen, 0, args.data_dir)
    elements = 2 * info.num_layers * info.num_kv_heads * info.head_dim  # K+V values per token
    results = []
    for name in args.only.split(","):
        progress = Progress()
        start = time.perf_counter()
        state = run_pass(loaded, cal, CONFIGS[name], progress)
        cal_s = time.perf_counter() - start
        policy, static = state.policy, state.of_kind("policy")
        for protocol in args.protocols.split(","):
            t0 = time.perf_counter()
            with torch.no_grad():
                res = evaluate(
                    loaded.model,
                    ev.ids,
                    lambda p=policy, s=static: build_cache(loaded.model, p, s, loaded.adapter),
                    protocol,
                    Progress(),
                )
            out = res.as_json(("ppl", "kld", "bytes"))
            led = res.ledger
            row = {
                "config": name,
                "protocol": protocol,
                "ppl_baseline": out["ppl"]["baseline"],
                "ppl": out["ppl"]["quantized"],
                "ratio": out["ppl"]["ratio"],
                "kld": out["kld"]["mean"],
                "top1": out["kld"]["top1_agreement"],
                "bytes_ratio": led.ratio,
                "bits_per_element": 8 * led.bytes_per_token / elements,
                "calibration_s": round(cal_s, 1),
                "calibration_stages": progress.seconds,
                "eval_s": round(time.perf_counter() - t0, 1),
            }
            results.append(row)
            console.print(
                f"{name:<6} {protocol:<8} ratio {row['ratio']:.4f} kld {row['kld']:.5f} "
                f"top1 {row['top1']:.4f} bytes {row['bytes_ratio']:.4f} "
                f"bits/elem {row['bits_per_element']:.3f}"
            )
    table = Table(
        title=f"{args.model} · WikiText-2 {args.windows}×{args.seqlen} · "
        f"calibrated on {args.samples}×{args.seqlen}"
    )
    for col in (
        "config",
        "protocol",
        "ppl",
        "ratio",
        "KLD",
        "top-1",
        "bytes/fp16",
        "bits/elem",
        "calib s",
        "eval s",
    ):
        table.add_column(col, justify="left" if col in ("config", "protocol") else "right")
    for r in results:
        table.add_row(
            r["config"],
            r["protocol"],
            f"{r['ppl']:.3f}",
            f"{r['ratio']:.4f}",
            f"{r['kld']:.5f}",
            f"{r['top1']:.4f}",
            f"{r['bytes_ratio']:.4f}",
            f"{r['bits_per_element']:.3f}",
            f"{r['calibration_s']:.0f}",
            f"{r['eval_s']:.0f}",
        )
    Console().print(table)
    if results:
        Console().print(f"baseline perplexity {results[0]['ppl_baseline']:.4f}")
    if args.json:
        args.json.write_text(json.dumps({"results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
