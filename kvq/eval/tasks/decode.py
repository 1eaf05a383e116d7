"""`decode`: does long greedy generation through the quantized cache stay on the baseline's
track, and where it leaves it, does it stay fluent?

The same prompts (one batch, equal lengths, no padding) are continued greedily for
--new-tokens tokens twice: through transformers' DynamicCache (what the model uses when no
cache is passed) and through the quantized cache. Token by token the two continuations are
compared (first divergence, agreement); then the unquantized model scores both, teacher
forced after the prompt: a quantized continuation that has diverged but reads as well as
the baseline's costs little, one whose perplexity climbs has derailed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor
from transformers import DynamicCache

from kvq.errors import KvqError
from kvq.eval.tasks.base import EvalTask, TaskContext
from kvq.eval.tasks.prompts import draw_prompts, prompt_length, served
from kvq.models.placement import input_device

# Logits scored at once when teacher forcing, in bytes of fp32: Gemma 3's vocabulary is
# 262k, so [T, V] for a whole 512-token continuation of 4 prompts would be 2 GB.
SCORE_LOGITS_BYTES = 256 << 20


@torch.no_grad()
def greedy(model, ids: Tensor, new_tokens: int, cache, step=None) -> Tensor:
    """[B, new_tokens] greedy continuations of ids [B, T] through `cache` (fed one token a
    step after the prompt). No stop at EOS: every prompt gets exactly new_tokens tokens, so
    the two sides are compared position by position. step(): called after each token."""
    out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1)  # [B]
    tokens = [token]
    for _ in range(new_tokens - 1):
        if step is not None:
            step()
        out = model(token[:, None], cache=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1)  # [B]
        tokens.append(token)
    if step is not None:
        step()
    return torch.stack(tokens, dim=1)  # [B, N]


@torch.no_grad()
def continuation_nll(model, ids: Tensor, continuation: Tensor) -> Tensor:
    """[B] mean negative log-likelihood of continuation [B, N] after ids [B, T] under the
    unquantized model, teacher forced. The continuation runs a chunk of positions at a time
    through a DynamicCache, whose rows are exact: the same logits as one no-cache forward
    over ids + continuation, without ever holding [B, N, V] at once."""
    batch, n = continuation.shape
    cache = DynamicCache(config=model.config)
    logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits  # [B, 1, V]
    total = _token_nll(logits, continuation[:, :1]).sum(1)  # [B]
    chunk = max(1, SCORE_LOGITS_BYTES // (batch * logits.shape[-1] * 4))
    for start in range(0, n - 1, chunk):
        stop = min(n - 1, start + chunk)
        logits = model(continuation[:, start:stop], cache=cache, use_cache=True).logits
        total += _token_nll(logits, continuation[:, start + 1 : stop + 1]).sum(1)  # [B, C]
    return total / n


def _token_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """[B, C] -log p(target) from logits [B, C, V] (float64 sums: hundreds of terms)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, C, V]
    return -logp.gather(-1, targets[..., None]).squeeze(-1).double()  # [B, C]


def first_divergence(same: Tensor) -> list[int | None]:
    """Per row of same [B, N] (bool: tokens equal), the first position that differs."""
    differs = ~same
    first = differs.int().argmax(1)  # [B] 0 for a row that never differs, too
    return [int(f) if bool(d.any()) else None for f, d in zip(first, differs, strict=True)]


@torch.no_grad()
def run(ctx: TaskContext) -> dict:
    p = ctx.params
    if p.new_tokens < 1:
        raise KvqError(f"--new-tokens must be at least 1 for the decode task, got {p.new_tokens}")
    model, n = ctx.model, p.new_tokens
    quant_cache = ctx.make_cache()
    spec = quant_cache.policy.prefix  # declared prefix rows the baseline runs as tokens
    length = prompt_length(ctx, n, spec)
    ids = draw_prompts(ctx.tokenizer, ctx.text, p.prompts, length, p.seed)  # [P, L]
    bos = getattr(ctx.tokenizer, "bos_token_id", None)
    base_ids, quant_ids = served(ids.to(input_device(model)), spec, bos)
    with ctx.progress.stage("decode", total=2 * n + 2) as bar:
        done = [0]  # steps advanced: what sides read back leave to advance

        def step(k: int = 1) -> None:
            done[0] += k
            bar.advance(k)

        def side(ids: Tensor, make_cache) -> Callable[[], dict]:
            def compute() -> dict:
                tokens = greedy(model, ids, n, make_cache(), step)  # [P, N]
                nll = continuation_nll(model, base_ids, tokens)  # [P] under the baseline
                step()
                return {"tokens": tokens.tolist(), "nll": nll.tolist()}

            return compute

        # the baseline: transformers' own default, the cache a forward without one builds
        sides = [
            ctx.baseline("decode/greedy", base_ids, {"new_tokens": n},
                         side(base_ids, lambda: DynamicCache(config=model.config))),
            ctx.quantized("decode/greedy", quant_ids, {"new_tokens": n},
                          side(quant_ids, lambda: quant_cache)),
        ]  # fmt: skip
        bar.advance(2 * n + 2 - done[0])  # sides read back from --result-cache
    base, quant = (torch.tensor(s["tokens"], device=base_ids.device) for s in sides)  # [P, N]
    nll_base, nll_quant = (torch.tensor(s["nll"], dtype=torch.float64) for s in sides)  # [P]
    same = base == quant  # [P, N]
    firsts = first_divergence(same)
    agreement = same.double().mean(1)  # [P]
    prompts = [
        {
            "first_divergence": f,
            "agreement": float(a),
            "ppl_baseline_continuation": math.exp(float(b)),
            "ppl_quantized_continuation": math.exp(float(q)),
        }
        for f, a, b, q in zip(firsts, agreement, nll_base, nll_quant, strict=True)
    ]
    return {
        "params": p.as_dict(),
        "cache": ctx.cache_name,
        "prompt_tokens": length,
        "prompts": prompts,
        "mean_agreement": float(agreement.mean()),
        # a prompt that never diverges counts as diverging after its last token
        "median_first_divergence": statistics.median(n if f is None else f for f in firsts),
        # equal lengths: the mean NLL over all prompts is that over all scored tokens
        "ppl_baseline_continuation": math.exp(float(nll_base.mean())),
        "ppl_quantized_continuation": math.exp(float(nll_quant.mean())),
    }


def summary(section: dict) -> list[tuple[str, str, str]]:
    n = section["params"]["new_tokens"]
    median = section["median_first_divergence"]
    diverged = f"none in {n}" if median >= n else f"{median:g}"
    return [
        ("decode token agreement", "1.000", f"{section['mean_agreement']:.3f}"),
        ("decode first divergence (median)", "—", diverged),
        (
            "continuation perplexity (baseline model)",
            f"{section['ppl_baseline_continuation']:.3f}",
            f"{section['ppl_quantized_continuation']:.3f}",
        ),
    ]


def plot(section: dict, folder: Path) -> list[Path]:
    """The fraction of prompts whose quantized continuation is still identical to the
    baseline's at each position: `{folder}/decode_divergence.png`."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    n = section["params"]["new_tokens"]
    firsts = [
        n if x["first_divergence"] is None else x["first_divergence"] for x in section["prompts"]
    ]
    positions = list(range(n))
    identical = [sum(f > t for f in firsts) / len(firsts) for t in positions]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.step(positions, identical, where="post", label=f"quantized ({len(firsts)} prompts)")
    ax.axhline(1.0, color="grey", linestyle=":", label="baseline")
    ax.set_ylim(-0.02, 1.05)
    ax.set_xlim(0, max(1, n - 1))
    ax.set_xlabel("generated token position")
    ax.set_ylabel("prompts still identical to baseline")
    ax.set_title(f"decode — {section['cache']}")
    ax.legend(loc="best")
    fig.tight_layout()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "decode_divergence.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


TASK = EvalTask(name="decode", run=run, summary=summary, plot=plot)
