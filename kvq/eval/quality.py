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
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvq.manifests.ledger import ByteLedger
from kvq.models.placement import input_device
from kvq.progress import Progress

POSITION_BUCKETS = 8  # the per-position breakdown splits each window into this many spans


@dataclass
class QualityTotals:
    tokens: int = 0
    nll_base: float = 0.0
    nll_quant: float = 0.0
    kl: float = 0.0
    top1_agree: int = 0
    # per bucket of window positions: [tokens, kl, nll_base, nll_quant] sums (`by_position`)
    buckets: list[list[float]] = field(default_factory=list)
    seqlen: int = 0  # the scored windows' length, which the buckets divide
    # per window: [tokens, kl, nll_base, nll_quant] sums, for the bootstrap (`interval`)
    per_window: dict[int, list[float]] = field(default_factory=dict)

    def interval(self, resamples: int = 1000, seed: int = 0) -> dict:
        """95% bootstrap intervals of the perplexity ratio and the mean KLD, resampling
        windows: the noise floor a difference between two caches must clear."""
        rows = torch.tensor(list(self.per_window.values()), dtype=torch.float64)  # [W, 4]
        if rows.shape[0] < 2:
            return {}
        g = torch.Generator().manual_seed(seed)
        pick = torch.randint(0, rows.shape[0], (resamples, rows.shape[0]), generator=g)
        sums = rows[pick].sum(1)  # [R, 4]
        ratio = torch.exp((sums[:, 3] - sums[:, 2]) / sums[:, 0])
        kld = sums[:, 1] / sums[:, 0]
        q = torch.tensor([0.025, 0.975], dtype=torch.float64)
        return {"ppl_ratio": torch.quantile(ratio, q).tolist(),
                "kld": torch.quantile(kld, q).tolist(), "windows": rows.shape[0],
                "resamples": resamples}  # fmt: skip

    def by_position(self) -> list[dict]:
        """KL and NLL delta (quantized - baseline, nats per token) by span of the window:
        whether error grows along the context."""
        n = len(self.buckets)
        rows = []
        for b, (tokens, kl, nb, nq) in enumerate(self.buckets):
            if tokens:
                rows.append({
                    "start": b * self.seqlen // n, "end": (b + 1) * self.seqlen // n,
                    "tokens": int(tokens), "kld": kl / tokens, "nll_delta": (nq - nb) / tokens,
                })  # fmt: skip
        return rows

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
                "by_position": t.by_position(),
                "interval95": t.interval(),
            }
        if "kld" in tasks:
            out["kld"] = {"mean": t.kl / t.tokens, "top1_agreement": t.top1_agree / t.tokens,
                          "interval95": t.interval().get("kld")}  # fmt: skip
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

# windows longer than this are scored a chunk of positions at a time (chunked prefill, for
# baseline and cache alike): [L, V] logits of an 8K window of a 262k vocabulary are 8.6 GB
PREFILL_CHUNK = 1024


@torch.no_grad()
def _chunked_baseline(model, ids: Tensor, prefix: Tensor | None):
    """Yield (start, [C, V] unquantized logits predicting targets start..start+C-1) for the
    window ids [1, L], a chunk at a time through transformers' DynamicCache; the last
    chunk's final position (which predicts nothing in the window) is dropped."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if prefix is not None:
        model(prefix.to(ids.device)[None], cache=cache, use_cache=True, logits_to_keep=1)
    length = ids.shape[1]
    for start in range(0, length, PREFILL_CHUNK):
        stop = min(length, start + PREFILL_CHUNK)
        logits = model(ids[:, start:stop], cache=cache, use_cache=True).logits[0].float()
        yield start, logits[: min(stop, length - 1) - start]


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
    length = windows.shape[1]
    with progress.stage(title, total=windows.shape[0]) as bar:
        for i in range(windows.shape[0]):
            ids = windows[i : i + 1].to(input_device(model))  # [1, L]
            targets = windows[i, 1:].to(ids.device)  # [L - 1]
            if length > PREFILL_CHUNK:  # a long window: [L, V] logits would not fit
                base_chunks = _chunked_baseline(model, ids, prefix)
                caches = {name: make() for name, make in make_caches.items()}
                for start, base in base_chunks:  # base [C, V] predicts targets[start:...]
                    chunk = ids[:, start : start + base.shape[0]]
                    tgt = targets[start : start + base.shape[0]]
                    for name, cache in caches.items():
                        with around.get(name, nullcontext)():
                            quant = model(chunk, cache=cache, use_cache=True).logits[0]
                        quant = quant[: tgt.numel()].float()
                        _accumulate(totals[name], base, quant, tgt, start, length, i)
                for name, cache in caches.items():
                    ledgers[name] = cache.nbytes()
            else:
                base = _baseline(model, ids, prefix)[0, :-1].float()  # [L - 1, V]
                for name, make_cache in make_caches.items():
                    cache = make_cache()
                    with around.get(name, nullcontext)():
                        logits = model(ids, cache=cache, use_cache=True).logits
                    quant = logits[0, :-1].float()
                    _accumulate(totals[name], base, quant, targets, 0, length, i)
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
                    _accumulate(totals, base[:, t - half].float(), quant.float(), ids[:, t + 1],
                                torch.full((ids.shape[0],), t), length,
                                torch.arange(a, a + ids.shape[0]))  # fmt: skip
                    bar.advance(ids.shape[0])
            ledger = cache.nbytes()
    return QualityResult(totals=totals, ledger=ledger)


def _accumulate(
    totals: QualityTotals,
    base: Tensor,
    quant: Tensor,
    targets: Tensor,
    positions: Tensor | int | None = None,
    seqlen: int = 0,
    windows: Tensor | int | None = None,
) -> None:
    """base, quant: [P, V] logits predicting targets [P] (P: positions, or windows).
    positions: the window position each row predicts from ([P], or an int for rows at
    consecutive positions from it); with the window length `seqlen`, the rows also go to
    the per-position buckets (`QualityTotals.by_position`). windows: the window of each row
    ([P], or an int for all), for the per-window sums (`QualityTotals.interval`)."""
    if seqlen and not totals.buckets:
        totals.buckets, totals.seqlen = [[0.0] * 4 for _ in range(POSITION_BUCKETS)], seqlen
    if isinstance(positions, int):
        positions = torch.arange(positions, positions + base.shape[0])
    if isinstance(windows, int):
        windows = torch.full((base.shape[0],), windows)
    for a in range(0, base.shape[0], 128):  # bounded memory with a 262k vocabulary
        lb = torch.log_softmax(base[a : a + 128], -1)
        lq = torch.log_softmax(quant[a : a + 128], -1)
        tgt = targets[a : a + 128]
        nll_b = -lb.gather(-1, tgt[:, None])[:, 0]  # [p]
        nll_q = -lq.gather(-1, tgt[:, None])[:, 0]
        kl = (lb.exp() * (lb - lq)).sum(-1)  # [p]
        totals.nll_base += nll_b.sum().item()
        totals.nll_quant += nll_q.sum().item()
        totals.kl += kl.sum().item()
        totals.top1_agree += (lb.argmax(-1) == lq.argmax(-1)).sum().item()
        totals.tokens += tgt.numel()
        figures = (kl, nll_b, nll_q)
        if seqlen and positions is not None:
            n = len(totals.buckets)
            which = (positions[a : a + 128].cpu() * n // seqlen).clamp(max=n - 1)  # [p]
            _add(totals.buckets, which, *figures)
        if windows is not None:
            _add(totals.per_window, windows[a : a + 128].cpu(), *figures)


def _add(sums, which: Tensor, kl: Tensor, nll_b: Tensor, nll_q: Tensor) -> None:
    """Add each row's [tokens, kl, nll_base, nll_quant] to sums[which[row]] (a list of
    buckets or a dict by window, grown on demand)."""
    for b in which.unique().tolist():
        sel = (which == b).to(kl.device)
        if isinstance(sums, dict):
            sums.setdefault(b, [0.0] * 4)
        acc = sums[b]
        acc[0] += int(sel.sum())
        acc[1] += kl[sel].sum().item()
        acc[2] += nll_b[sel].sum().item()
        acc[3] += nll_q[sel].sum().item()
