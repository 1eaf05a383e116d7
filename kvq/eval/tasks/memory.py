"""`memory`: what one request's K/V costs, and how many tokens fit a memory budget.

At each context the same prompt (`latency.side_prompts`: a declared prefix is run by the
baseline, served by the cache) is prefilled into transformers' DynamicCache and into the
quantized cache. Bytes come from the stored tensors, never a
formula:

* quantized: the cache's `nbytes()` ledger (codes, qparams, sink, residual, ...): its total
  and total / tokens.
* baseline: the same ledger's fp16 figure (the retained rows as fp16 K and V: the
  reference every ledger ratio is taken against, whatever dtype the eval ran in), and
  DynamicCache's actual bytes in the model's dtype, summed over its K/V tensors
  (`dtype_bytes_*`). The two can count different rows on sliding-window layers:
  DynamicCache keeps window - 1 of them, the quantized cache compacts only once it holds
  twice the window (`KvqLayer.evict`), and its ledger's fp16 figure covers what it holds.

Max concurrent tokens: budget // bytes per token, the tokens of requests of that context
that fit the budget (per-token bytes fall with context where sliding windows cap a layer).

Peak memory of each side, over the prefill of one request, above what was in use before:
on CUDA `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`; on CPU the
process's resident set sampled every millisecond from /proc/self/statm (its lifetime
high-water marks, VmHWM and ru_maxrss, rarely move after the model load), after freed
heap went back to the OS (glibc malloc_trim) so that one side does not reuse pages
the other freed. It includes the forward's activations, not only the cache; None where
/proc is missing.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import torch

from kvq.errors import KvqError
from kvq.eval.tasks.base import EvalTask, TaskContext
from kvq.eval.tasks.latency import (
    BASELINE,
    baseline_cache,
    check_contexts,
    device_name,
    side_prompts,
)
from kvq.models.placement import input_device

DEFAULT_BUDGET = 1 << 30  # bytes (1 GiB) when run-eval gets no --memory-budget
RSS_INTERVAL_S = 0.001  # how often the CPU peak samples the resident set
_STATM = "/proc/self/statm"


# --- peak memory -------------------------------------------------------------------------


def _rss() -> int:
    """Resident bytes of this process now (/proc/self/statm's second field, in pages)."""
    with open(_STATM) as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    """Collect garbage and hand freed heap back to the OS, so resident growth measures
    what a side allocates rather than what the previous side left in the allocator."""
    gc.collect()
    with suppress(OSError, AttributeError):  # not glibc: the measure is only coarser
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class _RssPeak:
    """Peak resident-set growth during a block, from a sampling thread (torch releases
    the GIL inside its ops, so the thread samples while they run)."""

    def __init__(self):
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(RSS_INTERVAL_S):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> _RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


@contextmanager
def peak_growth(device: torch.device) -> Iterator[dict]:
    """Yields a dict whose "bytes" holds, after the block, the peak memory in use during
    it above what was in use before (see the module doc); None where not measurable."""
    out: dict = {"bytes": None}
    _trim()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        yield out
        torch.cuda.synchronize(device)
        out["bytes"] = torch.cuda.max_memory_allocated(device) - before
    elif os.path.exists(_STATM):
        with _RssPeak() as rss:
            yield out
        out["bytes"] = rss.peak - rss.start
    else:
        yield out


PEAK_METHOD = {
    "cuda": "torch.cuda.max_memory_allocated growth over the prefill (reset_peak_memory_stats)",
    "cpu": "resident-set growth over the prefill, /proc/self/statm sampled every 1 ms "
    "after malloc_trim; includes the forward's activations",
}


# --- one side ---------------------------------------------------------------------------------


def _dynamic_bytes(cache) -> int:
    """Bytes of a transformers DynamicCache's K/V tensors, in the dtype they are held in."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _prefill(model, ids, cache, device: torch.device):
    """Prefill ids [1, T] into `cache`; returns (cache, peak growth in bytes or None)."""
    with peak_growth(device) as peak:
        model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache, peak["bytes"]


def _fit(budget: int, per_token: float) -> int:
    return int(budget // per_token)


@torch.no_grad()
def run(ctx: TaskContext) -> dict:
    model = ctx.model
    device = input_device(model)
    # the first cache installs kvq attention: both sides' forwards run the same function
    spec = ctx.make_cache().policy.prefix
    contexts = check_contexts(ctx, 0 if spec is None else spec.length, "memory")
    budget = ctx.params.memory_budget
    default = budget is None
    budget = DEFAULT_BUDGET if default else budget
    if type(budget) is not int or budget < 1:
        raise KvqError(f"--memory-budget must be a positive number of bytes, got {budget!r}")
    rows = []
    with ctx.progress.stage("memory", total=len(contexts)) as bar:
        for n in contexts:
            base_ids, quant_ids = side_prompts(ctx, n, spec, device)  # [1, P + T'], [1, T']
            base, base_peak = _prefill(model, base_ids, baseline_cache(model), device)
            actual = _dynamic_bytes(base)
            del base
            quant, quant_peak = _prefill(model, quant_ids, ctx.make_cache(), device)
            ledger = quant.nbytes()
            del quant
            rows.append(
                {
                    "context": n,
                    "cache": BASELINE,
                    "bytes_per_request": ledger.fp16_bytes,
                    "bytes_per_token": ledger.fp16_bytes_per_token,
                    "max_concurrent_tokens": _fit(budget, ledger.fp16_bytes_per_token),
                    "peak_bytes": base_peak,
                    "dtype": str(model.dtype).removeprefix("torch."),
                    "dtype_bytes_per_request": actual,
                    "dtype_bytes_per_token": actual / base_ids.shape[1],
                    "dtype_max_concurrent_tokens": _fit(budget, actual / base_ids.shape[1]),
                }
            )
            rows.append(
                {
                    "context": n,
                    "cache": ctx.cache_name,
                    "bytes_per_request": ledger.total,
                    "bytes_per_token": ledger.bytes_per_token,
                    "max_concurrent_tokens": _fit(budget, ledger.bytes_per_token),
                    "peak_bytes": quant_peak,
                    "ratio": ledger.ratio,
                    "ledger": ledger.to_dict(),
                }
            )
            bar.advance()
    return {
        "params": ctx.params.as_dict(),
        "cache": ctx.cache_name,
        "device": device_name(device),
        "budget_bytes": budget,
        "budget_source": "default 1 GiB (no --memory-budget)" if default else "--memory-budget",
        "baseline_bytes": "fp16 K/V of the rows the quantized cache retains (its ledger's "
        "fp16 figure); dtype_*: DynamicCache's own tensors",
        "peak": PEAK_METHOD["cuda" if device.type == "cuda" else "cpu"],
        "rows": rows,
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f}"


def summary(section: dict) -> list[tuple[str, str, str]]:
    sides: dict[int, dict[str, dict]] = {}
    for row in section["rows"]:
        side = "baseline" if row["cache"] == BASELINE else "quantized"
        sides.setdefault(row["context"], {})[side] = row
    budget = _mib(section["budget_bytes"])
    out = []
    for n, s in sides.items():
        b, q = s["baseline"], s["quantized"]
        out += [
            (
                f"KV bytes/token @ {n}",
                f"{b['bytes_per_token']:,.0f}",
                f"{q['bytes_per_token']:,.0f}",
            ),
            (
                f"max tokens in {budget} MiB @ {n}",
                f"{b['max_concurrent_tokens']:,}",
                f"{q['max_concurrent_tokens']:,}",
            ),
            (f"peak MiB @ {n}", _mib(b["peak_bytes"]), _mib(q["peak_bytes"])),
        ]
    return out


def plot(section: dict, folder: Path) -> list[Path]:
    """memory.png: KV bytes per token at each context, both caches side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in section["rows"]})
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.4
    for i, (label, pick) in enumerate(
        (
            ("baseline (fp16)", lambda r: r["cache"] == BASELINE),
            (section["cache"], lambda r: r["cache"] != BASELINE),
        )
    ):
        per = {r["context"]: r["bytes_per_token"] for r in section["rows"] if pick(r)}
        xs = [j + (i - 0.5) * width for j in range(len(contexts))]
        ax.bar(xs, [per[n] for n in contexts], width, label=label)
    ax.set_xticks(range(len(contexts)), [str(n) for n in contexts])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("KV bytes / token")
    ax.set_title(f"K/V bytes per token on {section['device']}")
    ax.legend()
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "memory.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return [out]


TASK = EvalTask(name="memory", run=run, summary=summary, plot=plot)
