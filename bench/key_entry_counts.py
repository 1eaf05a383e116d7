"""How many flat key exceptions real rows hold, per row and per decode tile.

    .venv/bin/python bench/key_entry_counts.py --artifact ART [--model gemma3-270m]
                                               [--windows 2] [--seqlen 2048] [--json FILE]

KVQuant-style keys (`kvq calibrate kvquant`, and the vq / trellis bases with key
outliers) keep every value outside the calibrated per-channel thresholds exactly, so the
count per row varies. The decode kernel's pass over a tile's entries takes as many steps
as the tile's longest row needs (`planned_decode.KernelConfig.key_entries_per_step`), so
what it costs follows the tiles' maxima, not the mean. This runs WikiText-2 test windows
through a cache made from ART and records each layer's counts per cached row of the
packed segment (the first KV head; sink rows are exact, not counted). Prints the mean
per row and per 64-row tile's longest row, and writes the counts as JSON
(`bench/kernel_resources.py --entry-counts FILE` reads them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _common import SHARED

import kvq
from kvq.data.text import load_text

TILE_ROWS = 64  # the planned kernel's tile (`planned_decode.kernel_config`)


def layer_counts(cache) -> list[list[int]]:
    """Per layer holding key exceptions: its packed rows' entry counts (batch 0, head 0)."""
    out = []
    for layer in cache.layers:
        rows = layer.state.main.rows() if hasattr(layer, "state") else {}
        if "k.sparse_count" in rows:
            out.append(rows["k.sparse_count"][0, 0].tolist())
    return out


def tile_maxima(counts: list[list[int]], tile: int = TILE_ROWS) -> list[int]:
    """The longest row's count of each whole tile of each layer's rows."""
    return [max(c[i : i + tile]) for c in counts for i in range(0, len(c) - tile + 1, tile)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--data-dir", default=str(SHARED))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model, tokenizer = kvq.load_model(args.model)
    artifact = kvq.load_artifact(args.artifact, model=model)
    text, _ = load_text("wikitext2", args.data_dir)
    ids = tokenizer(text[: 40 * args.windows * args.seqlen], return_tensors="pt").input_ids
    counts = []
    with torch.no_grad():
        for w in range(args.windows):  # consecutive windows from the test split's start
            window = ids[:, w * args.seqlen : (w + 1) * args.seqlen]
            cache = kvq.make_cache(model, artifact=artifact)
            model(window, past_key_values=cache, use_cache=True)
            counts += layer_counts(cache)
    if not counts:
        raise SystemExit(f"{args.artifact}: its keys keep no flat exceptions")
    rows = [n for c in counts for n in c]
    maxima = tile_maxima(counts)
    summary = {
        "rows": len(rows),
        "mean_per_row": round(sum(rows) / len(rows), 3),
        "tiles": len(maxima),
        "mean_tile_max": round(sum(maxima) / max(1, len(maxima)), 3),
        "largest": max(rows),
    }
    print(json.dumps(summary))
    if args.json:
        meta = {"model": args.model, "artifact": str(args.artifact), "windows": args.windows,
                "seqlen": args.seqlen, "head_dim": model.config.head_dim}  # fmt: skip
        args.json.write_text(json.dumps({**meta, **summary, "counts": counts}))


if __name__ == "__main__":
    main()
