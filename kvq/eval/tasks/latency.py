"""`latency`: decode ms per token, prefill tokens/s, append cost and decode paths.

At each context a prompt of exactly that many tokens (real text, `prompt_ids`; a cache's
declared prefix is run by the baseline, served by the cache: `side_prompts`) is prefilled
into transformers' DynamicCache (the baseline) and into the quantized cache, then decoded
greedily. The two sides alternate in one process (baseline, quantized, baseline, ...: ABAB),
so that drift of the machine (clocks, other load) hits both; each round takes a fresh
cache, and the report gives the median over `ROUNDS` rounds of each round's figure.

A round: one timed prefill (`logits_to_keep=1`: no [T, V] logits), `WARMUP_STEPS` untimed
decode steps, `DECODE_STEPS` timed ones (median and IQR of their ms). The quantized side
then takes `DECODE_STEPS` more steps with timing shims on `QuantizedKVCache.update` and
`KvqLayer.prepare` (the append: rows in, quantized and packed): a pass of its own, because
the shims synchronise CUDA around every call and would slow the steps they time.
The decode paths (kernel, reference or SDPA fallback per layer) are recorded in the first
warm-up step of the first round: the recording calls `decode_path` again, untimed.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.eval.tasks.base import EvalTask, TaskContext
from kvq.eval.tasks.prompts import served
from kvq.models.placement import input_device
from kvq.pipeline import check_context

BASELINE = "baseline"  # how rows name transformers' DynamicCache
ROUNDS = 3  # baseline/quantized rounds per context; figures are medians over rounds
WARMUP_STEPS = 2  # untimed decode steps after the prefill (allocator, autotuning, caches)
DECODE_STEPS = 16  # timed decode steps per round (and as many more for the append pass)
# what a layer whose attention got plain K/V tensors ran (kvq attention defers to SDPA)
SDPA_FALLBACK = "sdpa fallback (plain K/V tensors)"
# characters of text tokenized per prompt token wanted, before trying a longer slice
_CHARS_PER_TOKEN = 6


# --- shared with the memory task ---------------------------------------------------------


def prompt_ids(tokenizer, text: str, tokens: int) -> Tensor:
    """[1, tokens] ids: the tokenizer's BOS (if any), then the start of `text`, repeated
    when the text is too short. Only a slice of the text is tokenized: prompts are short
    next to a whole dataset."""
    if tokens < 1:
        raise KvqError(f"a context must be at least 1 token, got {tokens}")
    if not text.strip():
        raise KvqError("the dataset's text is empty; prompts are cut from it")
    bos = getattr(tokenizer, "bos_token_id", None)
    head = [] if bos is None else [bos]
    chars = tokens * _CHARS_PER_TOKEN
    while True:
        piece = text[:chars]
        ids = tokenizer(piece, add_special_tokens=False, return_attention_mask=False)
        ids = head + list(ids["input_ids"])
        if len(ids) >= tokens or chars >= len(text):
            break
        chars *= 2
    if len(ids) <= len(head):
        raise KvqError("the dataset's text tokenizes to nothing; prompts are cut from it")
    body = ids[len(head) :]
    while len(head) + len(body) < tokens:  # a short text: go round it again
        body = body + ids[len(head) :]
    return torch.tensor([(head + body)[:tokens]], dtype=torch.long)


def device_name(device: torch.device) -> str:
    """ "cpu", or "cuda:" and the GPU's name."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What to call before reading a clock: waits for queued CUDA work; nothing on CPU,
    whose ops have finished when they return."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def side_prompts(ctx: TaskContext, tokens: int, spec, device) -> tuple[Tensor, Tensor]:
    """(baseline ids [1, P + T'], quantized ids [1, T']) for a `tokens`-token prompt: a
    cache with a declared prefix (`spec`, or None) holds the prefix's rows already, which
    the baseline runs as tokens (`prompts.served`: both sides attend the same sequence)."""
    ids = prompt_ids(ctx.tokenizer, ctx.text, tokens)
    bos = getattr(ctx.tokenizer, "bos_token_id", None)
    return tuple(x.to(device) for x in served(ids, spec, bos))


def baseline_cache(model):
    """A fresh transformers DynamicCache laid out for `model` (sliding-window layers
    included)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def check_contexts(ctx: TaskContext, extra: int, what: str) -> tuple[int, ...]:
    """The contexts, refused in one sentence when empty or past the model's context (with
    `extra` tokens more: a declared prefix, decode steps)."""
    contexts = tuple(ctx.params.contexts)
    if not contexts:
        raise KvqError(f"{what} needs at least one context")
    for n in contexts:
        if type(n) is not int or n < 1:
            raise KvqError(f"{what}: a context must be a positive number of tokens, got {n!r}")
    check_context(ctx.loaded, max(contexts) + extra, f"{what} (longest context + decode steps)")
    return contexts


# --- instruments ----------------------------------------------------------------------------


@contextmanager
def patched(owner, name: str, value) -> Iterator[object]:
    """`owner.name = value` inside the block, the original back after it, also on error.
    Yields the original (as stored: a class's plain function, a module's global)."""
    original = vars(owner)[name]
    setattr(owner, name, value)
    try:
        yield original
    finally:
        setattr(owner, name, original)


class AppendTimer:
    """Seconds spent inside the cache's append (`QuantizedKVCache.update`, which takes the
    new rows, and `KvqLayer.prepare`, which quantizes and packs them) while entered: the
    classes' methods are wrapped by shims for the block's duration only."""

    def __init__(self, device: torch.device):
        self.sync = synchronizer(device)
        self.seconds = 0.0
        self._depth = 0  # a shim inside another's call adds nothing: no double counting

    @contextmanager
    def installed(self) -> Iterator[AppendTimer]:
        from kvq.runtime.cache import QuantizedKVCache
        from kvq.runtime.layers import KvqLayer

        with ExitStack() as stack:
            for owner, name in ((QuantizedKVCache, "update"), (KvqLayer, "prepare")):
                stack.enter_context(patched(owner, name, self._shim(vars(owner)[name])))
            yield self

    def _shim(self, method):
        def timed(*args, **kwargs):
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            self.sync()  # queued work of the step is not the append's
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.sync()
                self.seconds += time.perf_counter() - start
                self._depth -= 1

        timed.__wrapped__ = method
        return timed


@contextmanager
def recorded_paths() -> Iterator[list[str]]:
    """Yields a list that gets, per kvq attention call inside the block (one per layer and
    forward), the `DecodePath.describe()` of the path `decode_attention` took, or
    `SDPA_FALLBACK` for plain tensors. The path taken is the last `decode_path` a call
    asked for (a call over counted buffers may ask twice: planned first, then on the
    buffers cut to their rows)."""
    from kvq.runtime import attention
    from kvq.runtime.kernels.decode import attention as kernels

    seen: list[str] = []
    asked: list = []  # the DecodePaths of the call in flight
    with ExitStack() as stack:
        real_path = vars(kernels)["decode_path"]
        real_attend = vars(attention)["decode_attention"]
        real_sdpa = vars(attention)["sdpa_attention_forward"]

        def path_spy(*args, **kwargs):
            path = real_path(*args, **kwargs)
            asked.append(path)
            return path

        def attend_spy(*args, **kwargs):
            asked.clear()
            out = real_attend(*args, **kwargs)
            seen.append(asked[-1].describe() if asked else "unknown (no decode_path asked)")
            return out

        def sdpa_spy(*args, **kwargs):
            seen.append(SDPA_FALLBACK)
            return real_sdpa(*args, **kwargs)

        stack.enter_context(patched(kernels, "decode_path", path_spy))
        stack.enter_context(patched(attention, "decode_attention", attend_spy))
        stack.enter_context(patched(attention, "sdpa_attention_forward", sdpa_spy))
        yield seen


# --- one round of one side ---------------------------------------------------------------


@dataclass
class Round:
    prefill_tokens: int
    prefill_s: float
    step_ms: list[float]  # the timed decode steps, one token each
    append_ms: list[float] | None = None  # append time per step of the shimmed pass
    shimmed_step_ms: list[float] | None = None  # those steps' own times
    paths: list[str] | None = None  # one per layer: the first warm-up step's decode paths


def _step(model, cache, token: Tensor) -> Tensor:
    """One decode step: token [1, 1] -> the greedy next token [1, 1] (left on the device)."""
    logits = model(token, cache=cache, use_cache=True).logits  # [1, 1, V]
    return logits[:, -1].argmax(-1, keepdim=True)


def run_round(model, ids: Tensor, cache, device: torch.device, quantized: bool,
              paths: bool = False) -> Round:  # fmt: skip
    """Prefill ids [1, T] into `cache`, then decode (see the module doc)."""
    sync = synchronizer(device)
    sync()
    start = time.perf_counter()
    logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits  # [1, 1, V]
    sync()
    prefill_s = time.perf_counter() - start
    token = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
    recorded = None
    for i in range(WARMUP_STEPS):
        if paths and i == 0:
            with recorded_paths() as recorded:
                token = _step(model, cache, token)
        else:
            token = _step(model, cache, token)
    steps = []
    for _ in range(DECODE_STEPS):
        sync()
        start = time.perf_counter()
        token = _step(model, cache, token)
        sync()
        steps.append((time.perf_counter() - start) * 1e3)
    result = Round(ids.shape[1], prefill_s, steps, paths=recorded)
    if quantized:
        result.append_ms, result.shimmed_step_ms = [], []
        timer = AppendTimer(device)
        with timer.installed():
            for _ in range(DECODE_STEPS):
                timer.seconds = 0.0
                sync()
                start = time.perf_counter()
                token = _step(model, cache, token)
                sync()
                result.shimmed_step_ms.append((time.perf_counter() - start) * 1e3)
                result.append_ms.append(timer.seconds * 1e3)
    return result


# --- the task --------------------------------------------------------------------------------


def _iqr(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q3 - q1


def _row(context: int, cache: str, rounds: list[Round]) -> dict:
    """A report row: medians over rounds of each round's figure."""
    med = statistics.median
    row = {
        "context": context,
        "cache": cache,
        "ms_per_token": med(med(r.step_ms) for r in rounds),
        "ms_per_token_iqr": med(_iqr(r.step_ms) for r in rounds),
        "prefill_tokens_per_s": med(r.prefill_tokens / r.prefill_s for r in rounds),
        "append_ms_per_token": None,
        "append_share": None,
        "round_ms_per_token": [med(r.step_ms) for r in rounds],
    }
    if rounds[0].append_ms is not None:
        row["append_ms_per_token"] = med(med(r.append_ms) for r in rounds)
        # of the shimmed steps themselves: the append's share of a step that contains it
        row["append_share"] = med(sum(r.append_ms) / sum(r.shimmed_step_ms) for r in rounds)
    return row


@torch.no_grad()
def run(ctx: TaskContext) -> dict:
    model = ctx.model
    device = input_device(model)
    # the first cache installs kvq attention: both sides then run the same attention
    # function (plain tensors, the baseline's, go straight to SDPA) from the first round on
    spec = ctx.make_cache().policy.prefix
    extra = WARMUP_STEPS + 2 * DECODE_STEPS + (0 if spec is None else spec.length)
    contexts = check_contexts(ctx, extra, "latency")
    rows, slowdown, decode_paths = [], {}, {}
    with ctx.progress.stage("latency", total=len(contexts) * ROUNDS) as bar:
        for n in contexts:
            base_ids, quant_ids = side_prompts(ctx, n, spec, device)  # [1, P + T'], [1, T']
            base, quant = [], []
            for r in range(ROUNDS):  # ABAB: drift of the machine hits both sides
                base.append(run_round(model, base_ids, baseline_cache(model), device, False))
                quant.append(run_round(model, quant_ids, ctx.make_cache(), device, True, r == 0))
                bar.advance()
            rows += [_row(n, BASELINE, base), _row(n, ctx.cache_name, quant)]
            slowdown[str(n)] = rows[-1]["ms_per_token"] / rows[-2]["ms_per_token"]
            decode_paths[str(n)] = dict(Counter(quant[0].paths))
    return {
        "params": ctx.params.as_dict(),
        "protocol": {
            "rounds": ROUNDS,
            "warmup_steps": WARMUP_STEPS,
            "decode_steps": DECODE_STEPS,
            "order": "ABAB (baseline, quantized) per round, one process",
            "append": "update + prepare, timed in a separate pass of as many steps",
            "decode_paths": "layers per path in the first decode step after the prompt",
        },
        "cache": ctx.cache_name,
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        "rows": rows,
        "slowdown": slowdown,  # context (as a string: JSON keys) -> quantized / baseline
        "decode_paths": decode_paths,
    }


def _by_context(section: dict) -> dict[int, dict[str, dict]]:
    """context -> {"baseline": row, "quantized": row}."""
    out: dict[int, dict[str, dict]] = {}
    for row in section["rows"]:
        side = "baseline" if row["cache"] == BASELINE else "quantized"
        out.setdefault(row["context"], {})[side] = row
    return out


def summary(section: dict) -> list[tuple[str, str, str]]:
    rows = []
    for n, sides in _by_context(section).items():
        b, q = sides["baseline"], sides["quantized"]
        rows.append(
            (f"decode ms/token @ {n}", f"{b['ms_per_token']:.2f}", f"{q['ms_per_token']:.2f}")
        )
        rows.append((f"slowdown @ {n}", "1.00x", f"{section['slowdown'][str(n)]:.2f}x"))
        rows.append(
            (
                f"prefill tokens/s @ {n}",
                f"{b['prefill_tokens_per_s']:.0f}",
                f"{q['prefill_tokens_per_s']:.0f}",
            )
        )
        append = f"{q['append_ms_per_token']:.3f} ({q['append_share']:.0%} of a step)"
        rows.append((f"append ms/token @ {n}", "-", append))
    return rows


def plot(section: dict, folder: Path) -> list[Path]:
    """latency.png: decode ms per token against context for both caches (log-x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = _by_context(section)
    contexts = sorted(sides)
    fig, ax = plt.subplots(figsize=(6, 4))
    for side, label in (("baseline", "baseline (DynamicCache)"), ("quantized", section["cache"])):
        ms = [sides[n][side]["ms_per_token"] for n in contexts]
        iqr = [sides[n][side]["ms_per_token_iqr"] for n in contexts]
        ax.errorbar(contexts, ms, yerr=[i / 2 for i in iqr], marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode ms / token (median; bars: IQR)")
    ax.set_title(f"decode latency on {section['device']}, {section['threads']} threads")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "latency.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return [out]


TASK = EvalTask(name="latency", run=run, summary=summary, plot=plot)
