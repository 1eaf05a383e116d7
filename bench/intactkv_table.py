"""IntactKV on held-out text: no prefix, the exact prefix and the calibrated prefix.

    .venv/bin/python bench/intactkv_table.py --pair NAME=BASE_ART,CALIBRATED_ART ... \
        [--windows 16] [--seqlen 512] [--json FILE]

BASE_ART is a quantized artifact without a prefix (e.g. `kvq calibrate kvquant --bits 3`),
CALIBRATED_ART the `kvq calibrate intactkv --base BASE_ART` result (pairs that share a
base, e.g. two learning rates, score its no-prefix and exact-prefix rows once). The exact prefix is
extracted here from the unquantized model (the same tokens as the calibrated one).
WikiText-2 test windows (prefill protocol) start with BOS; the prefix supplies that BOS,
so each window is served as prefix + window[1:], and all three variants are scored on
the same tokens (window positions 1 .. L-2 predicting 2 .. L-1) against one unquantized
baseline per window: perplexity ratio, mean KL divergence, top-1 agreement.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from _common import add_data_args, load_model_and_windows, totals_figures

from kvq.artifacts.store import read_artifact
from kvq.calibrators.base import tensor_kind
from kvq.calibrators.prefix_state import extract_prefix
from kvq.eval.quality import QualityTotals, _accumulate
from kvq.pipeline import artifact_prefix, cache_for
from kvq.runtime.cache import build_cache


def exact_cache(loaded, artifact, exact):
    """A cache with the base artifact's layout and state, seeded with the exact prefix."""
    static = {n: t for n, t in artifact.tensors.items() if tensor_kind(n) == "policy"}
    policy = artifact.manifest.policy.with_prefix(exact.spec)
    return build_cache(loaded.model, policy, static, loaded.adapter, prefix=exact)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_data_args(ap, calibration=False)
    ap.add_argument("--pair", action="append", required=True, help="NAME=BASE_ART,CALIBRATED_ART")
    args = ap.parse_args()
    loaded, _, ev = load_model_and_windows(args, calibration=False)
    model = loaded.model
    setups = {}
    shared = {}  # pair name -> the earlier pair with the same base: its none/exact rows
    for pair in args.pair:
        name, paths = pair.split("=", 1)
        base_path, cal_path = paths.split(",")
        shared[name] = next((n for n, s in setups.items() if s["_base"] == base_path), None)
        base, cal = read_artifact(Path(base_path)), read_artifact(Path(cal_path))
        calibrated = artifact_prefix(loaded, cal)
        exact = extract_prefix(loaded, calibrated.token_ids, "intactkv-exact")
        setups[name] = {
            "none": lambda base=base: cache_for(loaded, artifact=base),
            "exact": lambda base=base, exact=exact: exact_cache(loaded, base, exact),
            "calibrated": lambda cal=cal: cache_for(loaded, artifact=cal),
            "_base": base_path,
            "_prefix_len": calibrated.length,
            "_cal_report": cal.manifest.passes[-1].report,
            "_cal_seconds": cal.manifest.passes[-1].stage_seconds,
        }
    totals = {(n, v): QualityTotals() for n in setups for v in ("none", "exact", "calibrated")}
    start = time.perf_counter()
    for w in range(ev.ids.shape[0]):
        ids = ev.ids[w : w + 1]  # [1, L], BOS first
        base = model(ids, use_cache=False).logits[0].float()  # [L, V]
        targets = ids[0, 2:]
        for name, s in setups.items():
            assert s["_prefix_len"] == 1, "the shared baseline assumes a BOS-only prefix"
            for variant in ("none", "exact", "calibrated"):
                if variant != "calibrated" and shared[name] is not None:
                    continue  # the same base's rows: copied from the earlier pair below
                cache = s[variant]()
                if variant == "none":
                    quant = model(ids, cache=cache).logits[0, 1:-1].float()
                else:  # the prefix supplies the BOS: the cache sees window[1:]
                    quant = model(ids[:, 1:], cache=cache).logits[0, :-1].float()
                _accumulate(totals[(name, variant)], base[1:-1], quant, targets)
        print(f"window {w + 1}/{ev.ids.shape[0]}  {time.perf_counter() - start:.0f} s", flush=True)
    for name, earlier in shared.items():
        if earlier is not None:
            for variant in ("none", "exact"):
                totals[(name, variant)] = totals[(earlier, variant)]
    rows = []
    for (name, variant), t in totals.items():
        f = totals_figures(t)  # this table's JSON names: ppl_quantized, ppl_ratio
        rows.append({"base": name, "prefix": variant, "ppl_baseline": f["ppl_baseline"],
                     "ppl_quantized": f["ppl"], "ppl_ratio": f["ratio"], "kld": f["kld"],
                     "top1": f["top1"], "scored_tokens": t.tokens})  # fmt: skip
    for name, s in setups.items():
        r = s["_cal_report"]
        print(
            f"{name}: intactkv loss before {r.get('loss_before'):.5g} after "
            f"{r.get('loss_after'):.5g} ({r.get('steps')} steps); stages {s['_cal_seconds']}"
        )
    print(f"{'base':<14}{'prefix':<12}{'ppl ratio':>10}{'KLD':>10}{'top-1':>8}")
    for r in rows:
        print(
            f"{r['base']:<14}{r['prefix']:<12}{r['ppl_ratio']:>10.4f}{r['kld']:>10.5f}"
            f"{r['top1']:>8.4f}"
        )
    if args.json:
        meta = {
            "windows": args.windows,
            "seqlen": args.seqlen,
            "windows_sha256": ev.fingerprint,
            "seconds": round(time.perf_counter() - start, 1),
            "calibration": {
                n: {"report": s["_cal_report"], "stage_seconds": s["_cal_seconds"]}
                for n, s in setups.items()
            },
        }
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
