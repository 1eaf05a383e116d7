"""Left padding with a prefix artifact: a padded batch against the same prompts alone.

    .venv/bin/python bench/prefix_padding.py --artifact ART [--prompts 8] [--json FILE]

Prompts are the starts of WikiText-2 test windows of different lengths (their BOS dropped:
the artifact's prefix supplies it). Each prompt's next-token distribution is scored by
KL divergence against the unquantized model over prefix + prompt, once with the prompts
one at a time (unpadded) and once as one left-padded batch through `model.generate`'s
path (attention mask, positions from it). Same prompts, same tokens: the two mean KLs
should agree (within 5% is the bar). The last position's KL of a handful of prompts is
a noisy statistic at INT8 (about 1e-3, where batch-shape rounding flips codes), so the
mean over every position of every prompt (the next-token distribution at each) is
reported beside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvq.artifacts.store import read_artifact
from kvq.models.loading import load_model
from kvq.pipeline import cache_for, load_windows

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def kl_rows(base: torch.Tensor, quant: torch.Tensor) -> float:
    """Summed KL over the rows of [T, V] logits."""
    return sum(kl(base[t], quant[t]) for t in range(base.shape[0]))


def kl(base: torch.Tensor, quant: torch.Tensor) -> float:
    lb, lq = torch.log_softmax(base.float(), -1), torch.log_softmax(quant.float(), -1)
    return float((lb.exp() * (lb - lq)).sum())


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--data-dir", default=str(SHARED))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    loaded = load_model(args.model)
    model = loaded.model
    artifact = read_artifact(args.artifact)
    spec = artifact.manifest.policy.prefix
    assert spec is not None, "give an artifact with a prefix"
    prefix = torch.tensor([spec.token_ids])
    windows = load_windows(loaded, "wikitext2", args.prompts, 320, 0, args.data_dir).ids
    lengths = torch.linspace(24, 300, args.prompts).long().tolist()
    prompts = [windows[i, 1 : 1 + n] for i, n in enumerate(lengths)]  # BOS dropped
    base = [model(torch.cat([prefix[0], p])[None]).logits[0, prefix.shape[1] :] for p in prompts]
    alone = []
    for p in prompts:
        logits = model(p[None], cache=cache_for(loaded, artifact=artifact)).logits[0]
        alone.append(logits)
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - p.numel() :], mask[i, width - p.numel() :] = p, 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # as generate gives them
    cache = cache_for(loaded, artifact=artifact)
    padded = model(ids, attention_mask=mask, position_ids=positions, cache=cache).logits
    unpadded_kl = [kl(b[-1], a[-1]) for b, a in zip(base, alone, strict=True)]
    padded_kl = [kl(b[-1], padded[i, -1]) for i, b in enumerate(base)]
    every_u = [kl_rows(b, a) for b, a in zip(base, alone, strict=True)]
    every_p = [kl_rows(b, padded[i, width - b.shape[0] :]) for i, b in enumerate(base)]
    tokens = sum(lengths)
    all_u, all_p = sum(every_u) / tokens, sum(every_p) / tokens
    mean_u, mean_p = sum(unpadded_kl) / len(prompts), sum(padded_kl) / len(prompts)
    print(f"artifact {args.artifact} (prefix {list(spec.token_ids)}, {spec.source})")
    print(f"{'prompt tokens':>14}{'KL alone':>12}{'KL padded':>12}")
    for n, u, p in zip(lengths, unpadded_kl, padded_kl, strict=True):
        print(f"{n:>14}{u:>12.5f}{p:>12.5f}")
    rel = abs(mean_p - mean_u) / mean_u
    print(f"mean next-token KL: alone {mean_u:.5f}, padded {mean_p:.5f} (relative gap {rel:.2%})")
    rel_all = abs(all_p - all_u) / all_u
    print(
        f"mean KL over all {tokens} positions: alone {all_u:.6f}, padded {all_p:.6f} "
        f"(relative gap {rel_all:.2%})"
    )
    if args.json:
        out = {
            "artifact": str(args.artifact),
            "prefix": list(spec.token_ids),
            "lengths": lengths,
            "kl_alone": unpadded_kl,
            "kl_padded": padded_kl,
            "mean_alone": mean_u,
            "mean_padded": mean_p,
            "relative_gap": rel,
            "all_positions": {
                "tokens": tokens,
                "mean_alone": all_u,
                "mean_padded": all_p,
                "relative_gap": rel_all,
            },
        }
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
