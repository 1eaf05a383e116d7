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
import time

import torch
from _common import add_data_args, load_model_and_windows, result_figures, timed_pass, write_json
from rich.console import Console
from rich.table import Table

from kvq.calibrators.channel_scales import ChannelScalesOptions
from kvq.calibrators.kvquant import KVQuantOptions
from kvq.eval.quality import evaluate
from kvq.progress import Progress
from kvq.runtime.cache import build_cache

CONFIGS = {
    "int8": ChannelScalesOptions(bits=8),
    "int4": ChannelScalesOptions(bits=4),
    "nuq4": KVQuantOptions(bits=4),
    "nuq3": KVQuantOptions(bits=3),
    "nuq2": KVQuantOptions(bits=2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_data_args(ap)
    ap.add_argument("--protocols", default="prefill,decode")
    ap.add_argument("--only", default=",".join(CONFIGS))
    args = ap.parse_args()
    console = Console(stderr=True)
    loaded, cal, ev = load_model_and_windows(args)
    info = loaded.adapter.info
    elements = 2 * info.num_layers * info.num_kv_heads * info.head_dim  # K+V values per token
    results = []
    for name in args.only.split(","):
        progress = Progress()
        state, cal_s = timed_pass(loaded, cal, CONFIGS[name], progress)
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
            row = {
                "config": name,
                "protocol": protocol,
                **result_figures(res),
                "bits_per_element": 8 * res.ledger.bytes_per_token / elements,
                "calibration_s": cal_s,
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
    write_json(args.json, {"results": results})


if __name__ == "__main__":
    main()
