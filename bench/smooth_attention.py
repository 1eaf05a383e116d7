"""SmoothAttention on QServe's KV4 layout: an alpha (and beta) sweep on the same windows.

    .venv/bin/python bench/smooth_attention.py [--alphas 0.3,0.4,0.5,0.6,0.7] [--betas 0]
        [--samples 16] [--windows 16] [--seqlen 512] [--artifacts ART ...] [--json FILE]

Rows: kv4-qserve without smoothing, then one per (alpha, beta): lambda fitted on the
calibration windows (one capture of post-RoPE key and query maxima serves every row),
folded into the model, the same kv4-qserve cache. Each evaluation window's baseline
logits are computed once and every row is scored against them (prefill protocol, as
`kvq run-eval`). `--artifacts`: more rows, each an artifact as `run-eval --artifact` would
use it (its transforms folded, its policy and qparams), e.g. channel-scales with and
without SmoothAttention before it. Also per layer: the widest post-RoPE key channel range over the median
one (`key_channel_spread`, on the first --spread-windows evaluation windows), without
smoothing and per row.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvq.artifacts.compat import load_artifact
from kvq.calibrators.base import tensor_kind
from kvq.calibrators.smooth_attention import channel_maxima, key_channel_spread, smooth_lambda
from kvq.eval.quality import QualityTotals, _accumulate
from kvq.models.adapters import rope_partners
from kvq.models.loading import load_model
from kvq.models.smoothing import fold_smooth
from kvq.pipeline import load_windows
from kvq.progress import Progress
from kvq.quant.schemes import named_policy
from kvq.runtime.cache import build_cache

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def per_layer_alpha(adapter, ids, kmax, qmax, partners, grid, sink) -> list[float]:
    """Per layer, the alpha of `grid` whose kv4-qserve keys (smoothed, quantized per token)
    change the attention logits least on windows `ids`, each logit's squared change
    weighted by its exact causal attention probability: a proxy, before any evaluation."""
    from kvq.calibrators.capture import capture, run_windows
    from kvq.quant import affine

    info = adapter.info
    group = info.num_q_heads // info.num_kv_heads
    best: list[float] = []
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def consume(layer: int, part: str, x: torch.Tensor) -> None:
        seen.setdefault(layer, {})[part] = x[0].float()  # [H, T, D], the first window

    with capture(adapter, consume, parts=("key", "query"), key_stage="post-rope"):
        run_windows(adapter.model, ids[:1])
    for i in range(info.num_layers):
        k, q = seen[i]["key"], seen[i]["query"]  # [H_kv, T, D], [H_q, T, D]
        t = k.shape[1]
        logits = torch.einsum("htd,hsd->hts", q, k.repeat_interleave(group, 0))
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        causal[:, :sink] = False  # sink keys are exact
        p = torch.softmax(logits.masked_fill(~torch.ones(t, t).tril().bool(), -1e30), -1)
        errors = []
        for alpha in grid:
            lam = smooth_lambda(kmax[i], qmax[i], alpha, 0.0, partners[i])[:, None, :]
            ks = k[:, sink:] / lam
            codes, scale, zp = affine.quantize_qserve(ks, -1)
            dk = torch.zeros_like(k)
            dk[:, sink:] = affine.qserve_decode(codes, scale, zp) - ks
            qs = q * lam.repeat_interleave(group, 0)
            dl = torch.einsum("htd,hsd->hts", qs, dk.repeat_interleave(group, 0))
            errors.append(float((p * dl.square() * causal).sum()))
        best.append(grid[min(range(len(grid)), key=errors.__getitem__)])
    return best


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--alphas", type=_floats, default=[0.3, 0.4, 0.5, 0.6, 0.7])
    ap.add_argument("--betas", type=_floats, default=[0.0])
    ap.add_argument("--policy", default="kv4-qserve")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--calibration", default=str(SHARED / "calibration" / "groups_merged.txt"))
    ap.add_argument("--data-dir", default=str(SHARED))
    ap.add_argument("--artifacts", type=Path, nargs="*", default=[])
    ap.add_argument(
        "--split", type=float, default=0.5, help="alpha of the K-only and V-only rows (-1: none)"
    )
    ap.add_argument(
        "--spread-windows", type=int, default=4, help="evaluation windows the key range uses"
    )
    ap.add_argument(
        "--pairs", type=str, default="", help="extra alpha:beta rows, e.g. 0.5:0.2,0.6:0.3"
    )
    ap.add_argument(
        "--per-layer", action="store_true", help="a row with alpha chosen per layer (proxy)"
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    console = Console(stderr=True)
    start = time.perf_counter()

    loaded = load_model(args.model)
    model, adapter = loaded.model, loaded.adapter
    info = adapter.info
    policy = named_policy(args.policy, info.num_layers, info.head_dim)
    sink = policy.layers[0].sink_tokens
    cal = load_windows(loaded, args.calibration, args.samples, args.seqlen, 0, None)
    ev = load_windows(loaded, "wikitext2", args.windows, args.seqlen, 0, args.data_dir)
    kmax, qmax = channel_maxima(adapter, cal.ids, sink, Progress())
    partners = [rope_partners(info.head_dim, r.rotary_dim, r.pairing) for r in info.rope]

    def lambdas(alpha: float, beta: float) -> dict:
        return {
            f"layers.{i}.smooth.lambda": smooth_lambda(kmax[i], qmax[i], alpha, beta, partners[i])
            for i in range(info.num_layers)
        }

    # (name, alpha, beta, smooth tensors or None, cache policy, its static tensors)
    configs = [("no smoothing", None, None, None, policy, {})] + [
        (f"alpha {a:g} beta {b:g}", a, b, lambdas(a, b), policy, {})
        for b in args.betas
        for a in args.alphas
    ]
    for pair in filter(None, args.pairs.split(",")):
        a, b = (float(v) for v in pair.split(":"))
        configs.append((f"alpha {a:g} beta {b:g}", a, b, lambdas(a, b), policy, {}))
    if args.per_layer:
        grid = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
        alphas = per_layer_alpha(adapter, cal.ids, kmax, qmax, partners, grid, sink)
        console.print(f"per-layer alpha: {alphas}")
        tensors = {
            f"layers.{i}.smooth.lambda": smooth_lambda(kmax[i], qmax[i], a, 0.0, partners[i])
            for i, a in enumerate(alphas)
        }
        configs.append(("alpha per layer", alphas, 0.0, tensors, policy, {}))
    if args.split >= 0:  # where the error left after smoothing comes from
        split = lambdas(args.split, 0.0)
        for side in ("keys", "values"):
            name = f"alpha {args.split:g}, {side} only"
            configs.append((name, args.split, 0.0, split, policy.only(side), {}))
    for path in args.artifacts:
        art = load_artifact(path, loaded)
        kinds = {n: tensor_kind(n) for n in art.tensors}
        smooth = {n: t for n, t in art.tensors.items() if kinds[n] == "transform"}
        static = {n: t for n, t in art.tensors.items() if kinds[n] == "policy"}
        chain = "+".join(p.method for p in art.manifest.passes)
        configs.append(
            (f"{path.name} ({chain})", None, None, smooth or None, art.manifest.policy, static)
        )
    # the attention modules' weights as loaded, restored before each row's fold
    original = [
        {n: t.clone() for n, t in adapter.attention(i).state_dict().items()}
        for i in range(info.num_layers)
    ]

    def use(tensors: dict | None) -> None:
        for i, state in enumerate(original):
            adapter.attention(i).load_state_dict(state)
        if tensors is not None:
            fold_smooth(loaded, tensors)

    rows, spreads = [], {}  # spreads by the lambdas' bytes: rows sharing them share it
    for name, alpha, beta, tensors, _, _ in configs:
        key = None if tensors is None else b"".join(t.numpy().tobytes() for t in tensors.values())
        if key not in spreads:
            use(tensors)
            spreads[key] = key_channel_spread(
                adapter, ev.ids[: args.spread_windows], sink, Progress()
            )
        spread = spreads[key]
        rows.append(
            {"config": name, "alpha": alpha, "beta": beta, "key_spread": spread,
             "totals": QualityTotals()}
        )  # fmt: skip
    console.print(f"{len(configs)} configurations; scoring {args.windows} x {args.seqlen} windows")
    for w in range(ev.ids.shape[0]):
        ids = ev.ids[w : w + 1]
        use(None)
        base = model(ids).logits[0, :-1].float()  # [L - 1, V]
        for row, (_, _, _, tensors, row_policy, static) in zip(rows, configs, strict=True):
            use(tensors)
            cache = build_cache(model, row_policy, static, adapter)
            quant = model(ids, cache=cache).logits[0, :-1].float()
            _accumulate(row["totals"], base, quant, ids[0, 1:])
            row["bytes_ratio"] = cache.nbytes().ratio
        console.print(f"window {w + 1}/{args.windows} ({time.perf_counter() - start:.0f} s)")

    for row in rows:
        t = row.pop("totals")
        row |= {
            "ppl_baseline": t.ppl_base(),
            "ppl": t.ppl_quant(),
            "ratio": t.ppl_quant() / t.ppl_base(),
            "kld": t.kl / t.tokens,
            "top1": t.top1_agree / t.tokens,
        }
    plain_kld = rows[0]["kld"]
    table = Table(
        title=f"SmoothAttention · {args.model} · {args.policy} · WikiText-2 "
        f"{args.windows}×{args.seqlen} · prefill"
    )
    cols = ("config", "perplexity", "ratio", "KLD", "KLD cut", "top-1", "key spread max/med")
    for col in cols:
        table.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        s = r["key_spread"]
        table.add_row(
            r["config"], f"{r['ppl']:.3f}", f"{r['ratio']:.4f}", f"{r['kld']:.4f}",
            f"{1 - r['kld'] / plain_kld:.1%}", f"{r['top1']:.3f}",
            f"{max(s):.1f} (median {sorted(s)[len(s) // 2]:.1f})",
        )  # fmt: skip
    out = Console(width=160)  # the full table, also in a log file
    out.print(table)
    out.print(f"baseline perplexity {rows[0]['ppl_baseline']:.3f}")
    spread = Table(title="post-RoPE key channel range, max / median, per layer")
    spread.add_column("layer")
    for r in rows:
        spread.add_column(r["config"], justify="right")
    for i in range(info.num_layers):
        kind = "full" if info.layer_types[i] == "full_attention" else "slide"
        spread.add_row(f"{i} ({kind})", *(f"{r['key_spread'][i]:.1f}" for r in rows))
    out.print(spread)
    report = {
        "model": args.model, "policy": args.policy, "calibration": cal.source.spec,
        "samples": args.samples, "windows": args.windows, "seqlen": args.seqlen,
        "spread_windows": args.spread_windows,
        "windows_sha256": ev.fingerprint, "seconds": round(time.perf_counter() - start, 1),
        "results": rows,
    }  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
