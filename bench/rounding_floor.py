"""How many digits of a cache's ppl ratio and KLD mean something: the same cache scored
with its K/V rows multiplied by (1 + 2^-k) before they are stored, a perturbation of k-bit
relative size, far below any quantizer's step.

A rounding decision at a code boundary flips under such a perturbation, the flipped
code's error reaches the next layers' rows, and their codes flip in turn: the figures
move as a fresh draw of the same quantization noise would. Any change of arithmetic order
(a fused kernel, another reduction order, a backend) moves them as much, so a figure
"unchanged to 4 decimals" is only meaningful above this floor.

    python bench/rounding_floor.py --policy int8 [--windows 16] [--json F]
    python bench/rounding_floor.py --artifact artifacts/demo --bits 22,20
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_data_args, load_model_and_windows, totals_figures, window_meta, write_json

from kvq.artifacts.compat import load_artifact
from kvq.eval.quality import evaluate_many
from kvq.pipeline import cache_for
from kvq.progress import Progress


def perturbed(make, factor: float):
    """A cache factory whose caches store every appended K/V row times `factor`."""

    def build():
        cache = make()
        update = cache.update

        def scaled(key, value, *args, **kwargs):
            return update(key * factor, value * factor, *args, **kwargs)

        cache.update = scaled
        return cache

    return build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(ap, calibration=False)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--policy")
    what.add_argument("--artifact", type=Path)
    ap.add_argument("--bits", default="22", help="k of the (1 + 2^-k) factors, comma-separated")
    args = ap.parse_args()
    loaded, _, ev = load_model_and_windows(args, calibration=False)
    if args.artifact:
        art = load_artifact(args.artifact, loaded)
        make = lambda: cache_for(loaded, artifact=art)  # noqa: E731
    else:
        make = lambda: cache_for(loaded, policy=args.policy)  # noqa: E731
    factories = {"as stored": make}
    factories |= {
        f"x (1 + 2^-{k})": perturbed(make, 1 + 2.0**-k) for k in map(int, args.bits.split(","))
    }
    per_window: dict[str, list[float]] = {name: [] for name in factories}
    seen = dict.fromkeys(factories, (0.0, 0))  # cumulative (KL, tokens) before this window

    def on_window(i, results):
        for name, r in results.items():
            kl, tokens = r.totals.kl - seen[name][0], r.totals.tokens - seen[name][1]
            per_window[name].append(kl / tokens)
            seen[name] = (r.totals.kl, r.totals.tokens)

    results = evaluate_many(loaded.model, ev.ids, factories, Progress(), on_window=on_window)
    rows = {}
    print("| rows | ppl ratio | KLD | per-window KLD spread vs as stored |")
    print("|---|---|---|---|")
    base = per_window["as stored"]
    for name, r in results.items():
        fig = totals_figures(r.totals)
        rel = [abs(a - b) / b for a, b in zip(per_window[name], base, strict=True) if b]
        spread = (
            f"median {statistics.median(rel):.1%}, max {max(rel):.1%}"
            if name != "as stored"
            else ""
        )
        rows[name] = fig | {"per_window_kld": per_window[name]}
        print(f"| {name} | {fig['ratio']:.5f} | {fig['kld']:.5f} | {spread} |")
    cache = str(args.artifact) if args.artifact else args.policy
    write_json(args.json, window_meta(args, ev, "prefill") | {"cache": cache, "rows": rows})


if __name__ == "__main__":
    main()
