"""What the quality benches share: their data flags, the model with its calibration and
WikiText-2 test windows, timed calibration passes, the figures a scored cache reports,
and the checks that split runs scored the same windows before they are merged.

Not a script: `python bench/NAME.py` puts bench/ first on sys.path, so the scripts beside
it import it as `_common`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvq.eval.quality import QualityResult, QualityTotals
from kvq.models.loading import load_model
from kvq.pipeline import load_windows, run_pass
from kvq.progress import Progress

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
CALIBRATION = SHARED / "calibration" / "groups_merged.txt"

# what says two runs scored the same windows (a merge refuses runs that differ in any)
WINDOW_KEYS = ("model", "windows_sha256", "windows", "seqlen", "protocol")


def add_data_args(ap: argparse.ArgumentParser, calibration: bool = True) -> None:
    """--model, --windows, --seqlen, --data-dir and --json; with `calibration`, also
    --samples and --calibration (16 x 512 of groups_merged by default)."""
    ap.add_argument("--model", default="gemma3-270m")
    if calibration:
        ap.add_argument("--samples", type=int, default=16)
        ap.add_argument("--calibration", default=str(CALIBRATION))
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--data-dir", default=str(SHARED))
    ap.add_argument("--json", type=Path)


def load_model_and_windows(args: argparse.Namespace, calibration: bool = True):
    """(loaded model, calibration windows or None, WikiText-2 test windows) from the flags
    of `add_data_args`: --samples x --seqlen of --calibration, --windows x --seqlen of the
    test split, both from their first window (offset 0)."""
    loaded = load_model(args.model)
    cal = None
    if calibration:
        cal = load_windows(loaded, args.calibration, args.samples, args.seqlen, 0, None)
    ev = load_windows(loaded, "wikitext2", args.windows, args.seqlen, 0, args.data_dir)
    return loaded, cal, ev


def window_meta(args: argparse.Namespace, ev, protocol: str) -> dict:
    """The WINDOW_KEYS of a run (and the dataset spec), first in every payload."""
    return {"model": args.model, "dataset": ev.source.spec, "windows_sha256": ev.fingerprint,
            "windows": args.windows, "seqlen": args.seqlen, "protocol": protocol}  # fmt: skip


def timed_pass(loaded, cal, options, progress: Progress | None = None):
    """Run one calibration pass on the calibration windows: (its state, seconds to 0.1)."""
    start = time.perf_counter()
    state = run_pass(loaded, cal, options, progress or Progress())
    return state, round(time.perf_counter() - start, 1)


def totals_figures(t: QualityTotals) -> dict:
    """Perplexity (baseline, quantized, ratio), mean KLD and top-1 agreement of the scored
    tokens, as `QualityResult.as_json` computes them."""
    return {"ppl_baseline": t.ppl_base(), "ppl": t.ppl_quant(),
            "ratio": t.ppl_quant() / t.ppl_base(), "kld": t.kl / t.tokens,
            "top1": t.top1_agree / t.tokens}  # fmt: skip


def result_figures(r: QualityResult) -> dict:
    """`totals_figures` and the last window's cache bytes against fp16."""
    return totals_figures(r.totals) | {"bytes_ratio": r.ledger.ratio}


def write_json(path: Path | None, payload: dict, indent: int = 2) -> None:
    """Rewrite --json (when given): the benches call this after every window or config, so
    a stopped run keeps what it measured."""
    if path:
        path.write_text(json.dumps(payload, indent=indent) + "\n")


def check_same_windows(payloads: list[dict], keys: tuple[str, ...] = WINDOW_KEYS) -> None:
    """Refuse to merge runs that did not score the same windows the same way."""
    for other in payloads[1:]:
        for k in keys:
            if other[k] != payloads[0][k]:
                raise SystemExit(f"cannot merge: {k} differs ({other[k]} vs {payloads[0][k]})")


def calibration_kv(model: str, calibration: str, samples: int, seqlen: int, sink: int, stage):
    """Calibration K/V of `model` as `kvq calibrate` sees them: per layer [N, H, D] keys
    (at `stage`) and values, and the Fisher sums (kvq's cache) over the same windows."""
    from kvq.calibrators.fisher import fisher_cached
    from kvq.calibrators.kvquant import capture_kv

    loaded = load_model(model)
    cal = load_windows(loaded, calibration, samples, seqlen, 0, None)
    progress = Progress()
    with torch.enable_grad():
        fisher = fisher_cached(
            loaded.model, loaded.adapter, cal.ids, cal.fingerprint,
            loaded.identity.weights_sha256, progress, exclude_first=sink,
        )  # fmt: skip
    with torch.no_grad():
        keys, values = capture_kv(loaded.model, loaded.adapter, cal.ids, sink, stage, progress)
    return loaded, keys, values, fisher
