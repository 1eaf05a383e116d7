"""Perplexity, KL divergence and bytes of a quantized cache against the unquantized model.

Two protocols:
- prefill: one forward over the window with the quantized cache, so every
  layer attends over quantized K/V of the same pass (the papers' protocol);
- decode: the first half of the window is prefilled into the cache, then the
  rest is teacher-forced one token at a time through the real cache. Only the
  teacher-forced positions are scored (for baseline and quantized alike),
  since they are the ones that exercise the decode path.

The baseline is the same model with no cache in the same invocation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kvq.manifests.ledger import ByteLedger
from kvq.progress import Progress

PROTOCOLS = ("prefill", "decode")


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


@torch.no_grad()
def evaluate(
    model,
    windows: Tensor,
    make_cache: Callable[[], object],
    protocol: str,
    progress: Progress,
) -> QualityResult:
    """Score `windows` ([N, L] ids) with the quantized cache from `make_cache()`."""
    totals = QualityTotals()
    ledger = None
    n, length = windows.shape
    start = 0 if protocol == "prefill" else length // 2
    with progress.stage(f"eval ({protocol})", total=n) as bar:
        for i in range(n):
            ids = windows[i : i + 1].to(model.device)
            base = model(ids, use_cache=False).logits[0, start:-1].float()  # [P, V]
            cache = make_cache()
            quant = _quantized_logits(model, ids, cache, protocol)[start:-1]
            _accumulate(totals, base, quant, ids[0, start + 1 :])
            ledger = cache.nbytes()
            bar.advance()
    return QualityResult(totals=totals, ledger=ledger)


def _quantized_logits(model, ids: Tensor, cache, protocol: str) -> Tensor:
    """Logits [L, V] of the window through the quantized cache."""
    if protocol == "prefill":
        return model(ids, cache=cache, use_cache=True).logits[0].float()
    half = ids.shape[1] // 2
    parts = [model(ids[:, :half], cache=cache, use_cache=True).logits[0].float()]
    for t in range(half, ids.shape[1]):
        parts.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[0].float())
    return torch.cat(parts)


def _accumulate(totals: QualityTotals, base: Tensor, quant: Tensor, targets: Tensor) -> None:
    """base, quant: [P, V] logits predicting targets [P]."""
    for a in range(0, base.shape[0], 128):  # bounded memory with a 262k vocabulary
        lb = torch.log_softmax(base[a : a + 128], -1)
        lq = torch.log_softmax(quant[a : a + 128], -1)
        tgt = targets[a : a + 128]
        totals.nll_base -= lb.gather(-1, tgt[:, None]).sum().item()
        totals.nll_quant -= lq.gather(-1, tgt[:, None]).sum().item()
        totals.kl += (lb.exp() * (lb - lq)).sum().item()
        totals.top1_agree += (lb.argmax(-1) == lq.argmax(-1)).sum().item()
        totals.tokens += tgt.numel()
