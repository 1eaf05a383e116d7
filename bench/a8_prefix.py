"""Static per-head INT8 K/V and static per-tensor A8 activations, without and with a prefix,
beside dynamic per-token A8.

    .venv/bin/python bench/a8_prefix.py [--windows 16] [--seqlen 512] [--prefix-ids auto|2,..]
                                        [--eta 64] [--max-tokens 4] [--json FILE]

1. The prefix (`--prefix-ids auto`): the `prefixquant` pass's choice (`outlier_stats`,
   `choose_tokens`) on the first --discover-windows calibration windows: BOS plus the
   tokens most often over --eta x the median at an MLP down-projection input, as many as
   the largest per-layer mean count per window asks for (at most --max-tokens).
2. Calibration (timed), on 16 x 512 of `calibration/groups_merged.txt`: `kv-scales --format
   int8 --granularity head` and `act-scales --method {--act-method}`, each without and with
   the prefix (`--prefix-ids`: a declared prefix, its exact K/V rows in the cache while the
   windows are served after it, so its positions are never in the statistics).
3. WikiText-2 test, prefill: every row of a set scored against one full-precision forward
   per window; the rows with a prefix are caches seeded with it (the A8 rows: an fp16
   cache with the exact prefix), scored against the full-precision model over prefix +
   window on the window's own tokens (its BOS supplied by the prefix).
JSON is rewritten after every window, so a stopped run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import torch
from _common import (
    add_data_args,
    check_same_windows,
    load_model_and_windows,
    result_figures,
    timed_pass,
    window_meta,
    write_json,
)
from rich.console import Console
from rich.table import Table

from kvq.calibrators.options import ActScalesOptions, KVScalesOptions
from kvq.calibrators.prefix_state import bos_id, ids_prefix
from kvq.calibrators.prefixquant import choose_tokens, outlier_stats
from kvq.eval.quality import evaluate_many
from kvq.progress import Progress
from kvq.quant.schemes import named_policy
from kvq.runtime.activations import quantized_linear_inputs, static_scales
from kvq.runtime.cache import build_cache, unit_scales
from kvq.runtime.prefix import prefix_from_tensors, user_tokens


def discover_prefix(loaded, windows: torch.Tensor, eta: float, max_tokens: int):
    """The prefixquant pass's tokens for these windows (see 1. above). Returns (ids, report)."""
    stats = outlier_stats(loaded.adapter, windows, Progress())
    ids, wanted, counts = choose_tokens(stats, eta, max_tokens, bos_id(loaded.tokenizer))
    report = {
        "eta": eta,
        "wanted": wanted,
        "tokens": [
            {"id": t, "text": loaded.tokenizer.decode([t]), "outlier_hits": counts.get(t, 0)}
            for t in ids
        ],
        "top_ratio_per_layer": [round(float(r), 1) for r in stats.top_ratio()],
        "mean_outliers_per_window": [round(float(c), 3) for c in stats.mean_count(eta)],
    }
    return tuple(ids), report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_data_args(ap)
    ap.add_argument("--prefix-ids", default="auto")
    ap.add_argument("--eta", type=float, default=64.0)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--discover-windows", type=int, default=8)
    ap.add_argument("--act-method", default="absmax", choices=("absmax", "percentile", "mse"))
    ap.add_argument("--set", default="both", choices=("none", "prefix", "both"),
                    help="score the rows without the prefix, with it, or both (split a run "
                    "over two processes; --merge joins them)")  # fmt: skip
    ap.add_argument("--merge", type=Path, nargs="+", help="join the JSON of split runs")
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, args.json)
        return
    console = Console(stderr=True)
    loaded, cal, ev = load_model_and_windows(args)
    info = loaded.adapter.info
    payload: dict = {**window_meta(args, ev, "prefill"), "calibration": {}, "sets": {}}

    def save() -> None:
        write_json(args.json, payload)

    start = time.perf_counter()
    if args.prefix_ids == "auto":
        prefix, found = discover_prefix(
            loaded, cal.ids[: args.discover_windows], args.eta, args.max_tokens
        )
        found["seconds"] = round(time.perf_counter() - start, 1)
    else:
        prefix = tuple(int(t) for t in args.prefix_ids.split(","))
        found = {"given": True}
    payload["prefix"] = {"ids": list(prefix), **found}
    console.print(f"prefix {prefix}: {found}")
    save()

    fp16 = named_policy("fp16", info.num_layers, info.head_dim)
    ids = ",".join(map(str, prefix))
    tags = {"none": [""], "prefix": ["+prefix"], "both": ["", "+prefix"]}[args.set]
    calibrations = {  # name -> options
        name: options
        for name, options in (
            ("kv-int8-head", KVScalesOptions("int8", "head")),
            ("kv-int8-head+prefix", KVScalesOptions("int8", "head", prefix_ids=ids)),
            ("act", ActScalesOptions(args.act_method)),
            ("act+prefix", ActScalesOptions(args.act_method, prefix_ids=ids)),
        )
        if name.endswith("+prefix") == ("+prefix" in tags) or len(tags) == 2
    }
    states = {}
    for name, options in calibrations.items():
        states[name], seconds = timed_pass(loaded, cal, options)
        payload["calibration"][name] = {"pass": options.NAME, "options": options.as_dict(),
                                        "seconds": seconds}  # fmt: skip
        console.print(f"calibrated {name} in {seconds} s")
        save()

    def cache_of(state):
        rows = prefix_from_tensors(state.policy.prefix, state.tensors, info.num_layers)
        return partial(build_cache, loaded.model, state.policy, state.of_kind("policy"),
                       loaded.adapter, prefix=rows)  # fmt: skip

    exact = ids_prefix(loaded, prefix) if "+prefix" in tags else None

    def fp16_cache(with_prefix: bool):
        rows = exact if with_prefix else None
        policy = fp16.with_prefix(rows.spec) if rows is not None else fp16
        return partial(build_cache, loaded.model, policy, unit_scales(fp16), loaded.adapter,
                       prefix=rows)  # fmt: skip

    def act(mode: str, state=None):
        scales = static_scales(state.tensors, loaded.adapter) if state is not None else None
        return partial(quantized_linear_inputs, loaded.adapter, mode, scales)

    sets = {}
    for tag in tags:
        p = prefix if tag else ()
        rows = {
            f"K/V INT8 static per head{tag}": (cache_of(states[f"kv-int8-head{tag}"]), None),
            f"A8 static per tensor ({args.act_method}){tag}": (
                fp16_cache(bool(tag)), act("a8-static", states[f"act{tag}"])),
            f"A8 dynamic per token{tag}": (fp16_cache(bool(tag)), act("a8-dynamic")),
        }  # fmt: skip
        sets[tag or "none"] = (p, rows)

    t0 = time.perf_counter()
    for key, (p, rows) in sets.items():

        def on_window(i: int, results, key=key, p=p) -> None:
            payload["sets"][key] = {"prefix_ids": list(p), "windows_scored": i + 1,
                                    "eval_s": round(time.perf_counter() - t0, 1),
                                    "rows": [{"config": n, **result_figures(r)}
                                             for n, r in results.items()]}  # fmt: skip
            save()

        makers = {n: m for n, (m, _) in rows.items()}
        around = {n: a for n, (_, a) in rows.items() if a is not None}
        ids, served = ev.ids, None
        if p:  # the caches serve the prefix (and with it each window's BOS)
            ids = user_tokens(ev.ids, exact.spec, loaded.tokenizer.bos_token_id)
            served = torch.tensor(p)
        with torch.no_grad():
            evaluate_many(loaded.model, ids, makers, Progress(), on_window, around, prefix=served)

    print_table(payload)


def merge(files: list[Path], out: Path | None) -> None:
    """Join split runs (--set none / prefix) that scored the same windows with one prefix."""
    payloads = [json.loads(f.read_text()) for f in files]
    check_same_windows(payloads)
    for other in payloads[1:]:
        if other["prefix"]["ids"] != payloads[0]["prefix"]["ids"]:
            raise SystemExit("cannot merge: the prefixes differ")
    merged = dict(payloads[0])
    merged["calibration"] = {k: v for p in payloads for k, v in p["calibration"].items()}
    merged["sets"] = {k: v for p in payloads for k, v in p["sets"].items()}
    print_table(merged)
    write_json(out, merged)


def print_table(payload: dict) -> None:
    prefix = payload["prefix"]["ids"]
    table = Table(title=f"{payload['model']} · WikiText-2 test {payload['windows']}×"
                  f"{payload['seqlen']} (prefill) · prefix {prefix}")  # fmt: skip
    for col in ("config", "ppl base", "ppl", "ratio", "KLD", "top-1", "bytes/fp16"):
        table.add_column(col, justify="left" if col == "config" else "right")
    for s in payload["sets"].values():
        for r in s["rows"]:
            table.add_row(r["config"], f"{r['ppl_baseline']:.4f}", f"{r['ppl']:.4f}",
                          f"{r['ratio']:.5f}", f"{r['kld']:.6f}", f"{r['top1']:.4f}",
                          f"{r['bytes_ratio']:.4f}")  # fmt: skip
    Console(width=140).print(table)
    for name, c in payload["calibration"].items():
        Console().print(f"calibration {name}: {c['seconds']} s")


if __name__ == "__main__":
    main()
