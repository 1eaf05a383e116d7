"""Static FP8 / INT8 K/V scales as engines serve them: calibrated, scale 1.0, dynamic.

    .venv/bin/python bench/kv_scales.py [--windows 16] [--seqlen 512] [--protocol prefill]
                                        [--only NAME,...] [--json FILE]
    .venv/bin/python bench/kv_scales.py --merge A.json B.json ... --json FILE

(--json is rewritten after every configuration, so a run split over processes with
--only, or stopped early, keeps what it measured; --merge joins such files, checking
they scored the same windows, and prints the table.)

Every configuration on the same WikiText-2 test windows: FP8 E4M3 with scales calibrated
per tensor and per KV head (`kvq calibrate kv-scales`, absmax, on 16 x 512 windows of
`calibration/groups_merged.txt`), the same with the sliding-window layers kept in 16 bits,
scale = 1.0 (what an engine does uncalibrated: `--policy fp8-e4m3`), dynamic per-token
scales (`--policy fp8-e4m3-dynamic`), E5M2, and static INT8 per head against the dynamic
per-token `--policy int8`. Prints perplexity ratio, KLD, top-1 agreement and bytes
against fp16, and writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from _common import (
    add_data_args,
    check_same_windows,
    load_model_and_windows,
    result_figures,
    window_meta,
    write_json,
)
from rich.console import Console
from rich.table import Table

from kvq.calibrators.options import KVScalesOptions
from kvq.eval.quality import evaluate_many
from kvq.pipeline import run_pass
from kvq.progress import Progress
from kvq.quant.schemes import named_policy
from kvq.runtime.cache import build_cache, unit_scales

# name -> calibrated options, or the name of a calibration-free policy
CONFIGS: dict[str, KVScalesOptions | str] = {
    "e4m3-tensor": KVScalesOptions("fp8-e4m3", "tensor"),
    "e4m3-head": KVScalesOptions("fp8-e4m3", "head"),
    "e4m3-unit": "fp8-e4m3",
    "e4m3-dynamic": "fp8-e4m3-dynamic",
    "e4m3-tensor-skip-sliding": KVScalesOptions("fp8-e4m3", "tensor", skip_layers="sliding"),
    "e4m3-head-skip-sliding": KVScalesOptions("fp8-e4m3", "head", skip_layers="sliding"),
    "e5m2-tensor": KVScalesOptions("fp8-e5m2", "tensor"),
    "e5m2-unit": "fp8-e5m2",
    "int8-head": KVScalesOptions("int8", "head"),
    "int8-dynamic": "int8",
}


def _payload(args, ev, results) -> dict:
    return {**window_meta(args, ev, args.protocol), "results": results}


def print_table(payload: dict) -> None:
    table = Table(
        title=f"{payload['model']} · WikiText-2 test {payload['windows']}×{payload['seqlen']} "
        f"({payload['protocol']}) · scales calibrated on groups_merged"
    )
    for col in ("config", "16-bit layers", "ppl", "ratio", "KLD", "top-1", "bytes/fp16"):
        table.add_column(col, justify="left" if col == "config" else "right")
    for r in payload["results"]:
        table.add_row(
            r["config"],
            str(r["layers_16bit"]),
            f"{r['ppl']:.4f}",
            f"{r['ratio']:.5f}",
            f"{r['kld']:.6f}",
            f"{r['top1']:.4f}",
            f"{r['bytes_ratio']:.4f}",
        )
    Console(width=120).print(table)
    if payload["results"]:
        Console().print(f"baseline perplexity {payload['results'][0]['ppl_baseline']:.4f}")


def merge(files: list[Path], out: Path | None) -> None:
    """Join the rows of runs split with --only (same model, windows and protocol), in
    CONFIGS order."""
    payloads = [json.loads(f.read_text()) for f in files]
    check_same_windows(payloads)
    rows = {r["config"]: r for p in payloads for r in p["results"]}
    merged = dict(payloads[0], results=[rows[n] for n in CONFIGS if n in rows])
    print_table(merged)
    write_json(out, merged)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_data_args(ap)
    ap.add_argument("--protocol", default="prefill")
    ap.add_argument("--only", default=",".join(CONFIGS))
    ap.add_argument("--merge", type=Path, nargs="+", help="join the JSON of split runs")
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, args.json)
        return
    console = Console(stderr=True)
    loaded, cal, ev = load_model_and_windows(args)
    info = loaded.adapter.info
    names = args.only.split(",")
    prepared = {}  # name -> (policy, static state, source, calibration seconds)
    for name in names:
        config = CONFIGS[name]
        start = time.perf_counter()
        if isinstance(config, str):
            policy = named_policy(config, info.num_layers, info.head_dim)
            static, source = unit_scales(policy), f"--policy {config}"
        else:
            state = run_pass(loaded, cal, config, Progress())
            policy, static = state.policy, state.of_kind("policy")
            source = "kv-scales " + " ".join(f"{k}={v}" for k, v in config.as_dict().items())
        prepared[name] = (policy, static, source, round(time.perf_counter() - start, 1))
        console.print(f"{name}: {policy.name} ready ({prepared[name][3]} s)")
    makers = {
        name: (lambda p=p, s=s: build_cache(loaded.model, p, s, loaded.adapter))
        for name, (p, s, _, _) in prepared.items()
    }
    t0 = time.perf_counter()

    def rows(done: int, results) -> list[dict]:
        out = []
        for name, res in results.items():
            policy, _, source, cal_s = prepared[name]
            out.append({
                "config": name, "source": source, "policy": policy.name,
                "layers_16bit": sum(layer.full_precision for layer in policy.layers),
                "protocol": args.protocol, "windows_scored": done, **result_figures(res),
                "calibration_s": cal_s, "eval_s_all_configs": round(time.perf_counter() - t0, 1),
            })  # fmt: skip
        return out

    def on_window(i: int, results) -> None:
        # after every window: a stopped run keeps what it measured (windows_scored says how much)
        write_json(args.json, _payload(args, ev, rows(i + 1, results)))

    if args.protocol != "prefill":
        raise SystemExit("this bench scores the prefill protocol (one baseline per window)")
    with torch.no_grad():
        results = evaluate_many(loaded.model, ev.ids, makers, Progress(), on_window)
    final = rows(ev.ids.shape[0], results)
    for row in final:
        console.print(
            f"{row['config']:<26} ratio {row['ratio']:.5f} kld {row['kld']:.6f} "
            f"top1 {row['top1']:.4f} bytes {row['bytes_ratio']:.4f}"
        )
    print_table(_payload(args, ev, final))


if __name__ == "__main__":
    main()
