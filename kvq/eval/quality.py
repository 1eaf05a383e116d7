"""Perplexity, KL divergence and bytes of a quantized cache against the unquantized model.

Two protocols:
- prefill: one forward over the window with the quantized cache, so every
  layer attends over quantized K/V of the same pass (the papers' protocol);
- decode: the first half of the window is prefilled into the cache, then the
  rest is teacher-forced one token at a time through the real cache. Only the
  teacher-forced positions are scored (for baseline and quantized alike),
  since they are the ones that exercise the decode path.

The baseline is the same model with no cache in the same invocation. With a declared
prefix (IntactKV, PrefixQuant) the served sequence is prefix + window: the baseline runs
the unquantized model over both, the quantized run feeds only the window to a cache seeded
with the prefix, and only the window's own tokens are scored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from kvq.manifests.ledger import ByteLedger
from kvq.models.placement import input_device
from kvq.progress import Progress


@dataclass
class QualityTotals:
    tokens: int = 0
    nll_base: float = 0.0
    nll_quant: float = 0.0
    kl: float = 0.0
    top1_agree: int = 0

    def ppl_base(self) -> float:
        return math.exp(self.nll_base / self.tokens)

    def ppl_quant(self) -> float:
        return math.exp(self.nll_quant / self.tokens)


@dataclass
class QualityResult:
    totals: QualityTotals
    ledger: ByteLedger | None  # of the last window's cache

    def as_json(self, tasks: tuple[str, ...]) -> dict:
        t = self.totals
        out: dict = {}
        if "ppl" in tasks:
            out["ppl"] = {
                "baseline": t.ppl_base(),
                "quantized": t.ppl_quant(),
                "ratio": t.ppl_quant() / t.ppl_base(),
                "scored_tokens": t.tokens,
            }
        if "kld" in tasks:
            out["kld"] = {"mean": t.kl / t.tokens, "top1_agreement": t.top1_agree / t.tokens}
        if "bytes" in tasks and self.ledger is not None:
            led = self.ledger
            out["bytes"] = {
                "kv_bytes_per_token": led.bytes_per_token,
                "fp16_bytes_per_token": led.fp16_bytes_per_token,
                "ratio": led.ratio,
                "ledger": led.to_dict(),
            }
        return out


# decode protocol: windows teacher-forced together, as many as keep the baseline logits of
# the scored positions within this budget. A decode step reads every weight once (Gemma 3's
# 262k x 640 embedding alone is 670 MB in fp32), so a batch of windows costs about one.
DECODE_LOGITS_BUDGET = 1 << 30  # bytes


Around = Callable[[], AbstractContextManager]  # entered around each quantized forward only


def _baseline(model, ids: Tensor, prefix: Tensor | None, **kwargs) -> Tensor:
    """Unquantized logits of the window ids [B, L] served after `prefix` ([P] ids or None),
    at the window's own positions: [B, L, V] (or fewer with `logits_to_keep`)."""
    if prefix is None:
        return model(ids, use_cache=False, **kwargs).logits
    served = torch.cat([prefix.to(ids.device)[None].expand(ids.shape[0], -1), ids], dim=1)
    logits = model(served, use_cache=False, **kwargs).logits
    return logits[:, -ids.shape[1] :] if logits.shape[1] > ids.shape[1] else logits


@torch.no_grad()
def evaluate(
    model,
    windows: Tensor,
    make_cache: Callable[[], object],
    protocol: str,
    progress: Progress,
    around: Around | None = None,
    prefix: Tensor | None = None,
) -> QualityResult:
    """Score `windows` ([N, L] ids) with the quantized cache from `make_cache()`.

    around: a context (e.g. activation quantization) entered around the quantized forwards.
    prefix: [P] ids the cache is seeded with (its declared prefix), served before each
    window by the baseline too (only the window's own tokens are scored); None without one.
    """
    if protocol == "decode":
        return _evaluate_decode(model, windows, make_cache, progress, around, prefix)
    result = evaluate_many(
        model, windows, {"": make_cache}, progress,
        around={"": around} if around else None, title=f"eval ({protocol})", prefix=prefix,
    )  # fmt: skip
    return result[""]


def evaluate_many(
    model,
    windows: Tensor,
    make_caches: dict[str, Callable[[], object]],
    progress: Progress,
    on_window: Callable[[int, dict[str, QualityResult]], None] | None = None,
    around: dict[str, Around] | None = None,
    title: str = "eval (prefill, shared baseline)",
    prefix: Tensor | None = None,
) -> dict[str, QualityResult]:
    """The prefill protocol for several caches at once: each window's baseline forward runs
    once and every cache is scored against it (what `evaluate` computes for each alone,
    at about half the forwards for a comparison of many). on_window(i, results so far).
    around (by cache name), prefix: as in `evaluate`."""
    totals = {name: QualityTotals() for name in make_caches}
    ledgers: dict[str, ByteLedger | None] = dict.fromkeys(make_caches)
    around = around or {}
    with progress.stage(title, total=windows.shape[0]) as bar:
        for i in range(windows.shape[0]):
            ids = windows[i : i + 1].to(input_device(model))  # [1, L]
            targets = windows[i, 1:].to(ids.device)  # [L - 1]
            base = _baseline(model, ids, prefix)[0, :-1].float()  # [L - 1, V]
            for name, make_cache in make_caches.items():
                cache = make_cache()
                with around.get(name, nullcontext)():
                    logits = model(ids, cache=cache, use_cache=True).logits
                _accumulate(totals[name], base, logits[0, :-1].float(), targets)
                ledgers[name] = cache.nbytes()
            if on_window is not None:
                on_window(i, {n: QualityResult(totals[n], ledgers[n]) for n in make_caches})
            bar.advance()
    return {n: QualityResult(totals[n], ledgers[n]) for n in make_caches}


def _evaluate_decode(
    model,
    windows: Tensor,
    make_cache,
    progress: Progress,
    around: Around | None = None,
    prefix: Tensor | None = None,
) -> QualityResult:
    """Prefill the first half of each window into the cache, then teacher-force the rest one
    token at a time, a batch of windows at once; score the teacher-forced positions."""
    totals = QualityTotals()
    ledger = None
    n, length = windows.shape
    half = length // 2
    scored = length - 1 - half  # positions half ... L - 2 predict tokens half + 1 ... L - 1
    vocab = model.get_output_embeddings().weight.shape[0]
    batch = max(1, min(n, DECODE_LOGITS_BUDGET // max(1, 4 * scored * vocab)))
    with progress.stage("eval (decode)", total=n * scored) as bar:  # window-steps
        for a in range(0, n, batch):
            ids = windows[a : a + batch].to(input_device(model))  # [B, L]
            base = _baseline(model, ids, prefix, logits_to_keep=scored + 1)  # [B, S + 1, V]
            cache = make_cache()
            with (around or nullcontext)():
                model(ids[:, :half], cache=cache, use_cache=True, logits_to_keep=1)
                for t in range(half, length - 1):
                    quant = model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, 0]
                    _accumulate(totals, base[:, t - half].float(), quant.float(), ids[:, t + 1])
                    bar.advance(ids.shape[0])
            ledger = cache.nbytes()
    return QualityResult(totals=totals, ledger=ledger)


def _accumulate(totals: QualityTotals, base: Tensor, quant: Tensor, targets: Tensor) -> None:
    """base, quant: [P, V] logits predicting targets [P] (P: positions, or windows)."""
    for a in range(0, base.shape[0], 128):  # bounded memory with a 262k vocabulary
        lb = torch.log_softmax(base[a : a + 128], -1)
        lq = torch.log_softmax(quant[a : a + 128], -1)
        tgt = targets[a : a + 128]
        totals.nll_base -= lb.gather(-1, tgt[:, None]).sum().item()
        totals.nll_quant -= lq.gather(-1, tgt[:, None]).sum().item()
        totals.kl += (lb.exp() * (lb - lq)).sum().item()
        totals.top1_agree += (lb.argmax(-1) == lq.argmax(-1)).sum().item()
        totals.tokens += tgt.numel()
