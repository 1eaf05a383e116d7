"""Where a decode step's time goes, per cache kind, against transformers' DynamicCache.

One process, one model (Gemma 3 270M by default), every cache prefilled with the same
WikiText-2 prompt at each context, then decode steps through the model's forward with
the caches alternating round by round (the median of the rounds is reported, so a
passing load spike does not land on one cache). Each step's wall time is split by
timing the functions a step passes through, each counted without the timed functions
it calls:

    checks   QuantizedKVCache.update: row checks, the transaction (DynamicCache: its update)
    append   QuantizedKVCache._prepare: encode the new rows into the layer's successor
    mask     the kvq rows mask (sink, residual, prefix) built for the kernel
    attend   decode_attention: read the codes, dequantize, attend (DynamicCache: SDPA)
    publish  swap the successors in, evict past the sliding window
    masks    the model's own causal / sliding-window masks
    model    everything else: embeddings, linears, norms, RoPE, sampling

and, once per kind and context, the torch ops and host syncs of a step (a sync on a
GPU drains the launch queue; here it is the count that matters). kvq's CPU backend is
the pure-torch reference; the Triton kernels' costs are GPU figures (bench/gpu_decode.py).

    python bench/decode_profile.py                                  # dynamic, fp16, int8
    python bench/decode_profile.py --artifact demo=artifacts/demo --contexts 512,2048,8192 \
        --json bench/results/cpu/decode_profile.json
    python bench/decode_profile.py --generate 128 --contexts 2048 ...   # generate, end to end
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from host_overhead import Counter
from transformers import DynamicCache

import kvq
import kvq.runtime.attention as attention
from kvq.eval.provenance import cpu_name
from kvq.runtime.cache import QuantizedKVCache

LOAD_BEFORE = list(os.getloadavg())  # 1/5/15-minute load when the script started
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
PARTS = ("checks", "append", "mask", "attend", "publish", "masks", "model")


class PartTimer:
    """Exclusive wall time of wrapped functions, by part, for the steps run inside."""

    def __init__(self):
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self._stack: list[list] = []  # [part, start, time spent in nested parts]
        self._undo: list = []

    def wrap(self, owner, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            self._stack.append([part, time.perf_counter(), 0.0])
            try:
                return inner(*args, **kwargs)
            finally:
                p, start, nested = self._stack.pop()
                spent = time.perf_counter() - start
                self.seconds[p] += spent - nested
                if self._stack:
                    self._stack[-1][2] += spent

        setattr(owner, name, timed)
        self._undo.append((owner, name, inner))

    def restore(self) -> None:
        for owner, name, inner in reversed(self._undo):
            setattr(owner, name, inner)


def install_timers(model) -> PartTimer:
    timer = PartTimer()
    timer.wrap(QuantizedKVCache, "update", "checks")
    timer.wrap(QuantizedKVCache, "_prepare", "append")
    timer.wrap(QuantizedKVCache, "_publish", "publish")
    timer.wrap(attention, "_rows_mask", "mask")
    timer.wrap(attention, "decode_attention", "attend")
    timer.wrap(attention, "sdpa_attention_forward", "attend")
    timer.wrap(DynamicCache, "update", "checks")
    modeling = sys.modules[type(model).__module__]
    for name in dir(modeling):
        if name.startswith("create_") and name.endswith("mask"):
            timer.wrap(modeling, name, "masks")
    return timer


def make_cache(model, kind: str, artifacts: dict[str, str]):
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    if kind in artifacts:
        return kvq.make_cache(model, artifact=artifacts[kind])
    return kvq.make_cache(model, policy=kind)


class Decoder:
    """A cache prefilled with the prompt, stepping greedily one token at a time."""

    def __init__(self, model, cache, prompt: torch.Tensor):
        self.model, self.cache = model, cache
        out = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        self.token = out.logits[:, -1:].argmax(-1)
        self.pos = prompt.shape[1]

    def step(self) -> None:
        position = torch.tensor([self.pos])
        out = self.model(self.token, past_key_values=self.cache, use_cache=True,
                         cache_position=position)  # fmt: skip
        self.token = out.logits[:, -1:].argmax(-1)
        self.pos += 1


def count_step(decoder: Decoder) -> dict:
    """Torch ops (kvq's and the model's) and host syncs of one step."""
    with Counter() as counter:
        decoder.step()
    model_ops = counter.ops["model"]
    return {"ops_kvq": sum(counter.ops.values()) - model_ops, "ops_model": model_ops,
            "syncs": sum(counter.syncs.values())}  # fmt: skip


def profile_context(model, prompt, kinds, artifacts, steps: int, rounds: int) -> dict:
    decoders = {k: Decoder(model, make_cache(model, k, artifacts), prompt) for k in kinds}
    for d in decoders.values():  # warm the allocator and any lazily built tables
        d.step()
        d.step()
    counts = {k: count_step(d) for k, d in decoders.items()}
    timer = install_timers(model)
    per_round: dict[str, list[dict]] = {k: [] for k in kinds}
    try:
        for _ in range(rounds):
            for kind, d in decoders.items():
                timer.seconds = dict.fromkeys(PARTS, 0.0)
                start = time.perf_counter()
                for _ in range(steps):
                    d.step()
                wall = time.perf_counter() - start
                parts = dict(timer.seconds)
                parts["model"] = wall - sum(v for p, v in parts.items() if p != "model")
                per_round[kind].append(
                    {"step": wall / steps} | {p: v / steps for p, v in parts.items()}
                )
    finally:
        timer.restore()
    result = {}
    for kind, rs in per_round.items():
        median = {key: statistics.median(r[key] for r in rs) * 1e3 for key in rs[0]}
        result[kind] = {"ms": median, "rounds_ms": [r["step"] * 1e3 for r in rs]} | counts[kind]
    return result


def generate_times(model, prompt, kinds, artifacts, new: int, rounds: int) -> dict:
    """`model.generate` of `new` greedy tokens after `prompt` (prefill included), each
    cache fresh per run, kinds alternating within each round: seconds per round."""
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds + 1):  # round 0 warms up (tables, allocator) and is not kept
        for kind in kinds:
            cache = make_cache(model, kind, artifacts)
            start = time.perf_counter()
            model.generate(prompt, attention_mask=torch.ones_like(prompt), cache=cache,
                           max_new_tokens=new, min_new_tokens=new, do_sample=False)  # fmt: skip
            if r:
                times[kind].append(time.perf_counter() - start)
    return {k: {"s": statistics.median(v), "rounds_s": v} for k, v in times.items()}


def generate_table(results: dict, new: int) -> str:
    lines = [f"| prompt | cache | generate +{new} s | × dyn |", "|---|---|---|---|"]
    for ctx, per_kind in results.items():
        base = per_kind["dynamic"]["s"] if "dynamic" in per_kind else None
        for kind, r in per_kind.items():
            ratio = f"{r['s'] / base:.3f}" if base else "-"
            lines.append(f"| {ctx} | {kind} | {r['s']:.2f} | {ratio} |")
    return "\n".join(lines)


def table(results: dict) -> str:
    head = ("ctx", "cache", "step ms", "× dyn", *PARTS, "kvq ops", "syncs")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for ctx, per_kind in results.items():
        base = per_kind["dynamic"]["ms"]["step"] if "dynamic" in per_kind else None
        for kind, r in per_kind.items():
            ms = r["ms"]
            ratio = f"{ms['step'] / base:.2f}" if base else "-"
            cells = (ctx, kind, f"{ms['step']:.1f}", ratio, *(f"{ms[p]:.1f}" for p in PARTS),
                     r["ops_kvq"], r["syncs"])  # fmt: skip
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--policies", default="fp16,int8", help="kvq policies, comma-separated")
    ap.add_argument("--artifact", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--generate", type=int, default=0, metavar="NEW",
                    help="instead: time model.generate of NEW tokens after each context")  # fmt: skip
    ap.add_argument("--data-dir", default=str(SHARED))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    artifacts = dict(a.split("=", 1) for a in args.artifact)
    kinds = ["dynamic", *filter(None, args.policies.split(",")), *artifacts]
    torch.manual_seed(0)
    model, tok = kvq.load_model(args.model)
    model.eval()
    text = (Path(args.data_dir) / "wikitext-2-raw" / "wiki.test.raw").read_text()
    results = {}
    with torch.no_grad():
        for ctx in map(int, args.contexts.split(",")):
            ids = tok(text[: ctx * 8], return_tensors="pt").input_ids[:, :ctx]
            if args.generate:
                results[ctx] = generate_times(model, ids, kinds, artifacts, args.generate,
                                              args.rounds)  # fmt: skip
                print(generate_table({ctx: results[ctx]}, args.generate), flush=True)
                continue
            results[ctx] = profile_context(model, ids, kinds, artifacts, args.steps, args.rounds)
            print(table({ctx: results[ctx]}), flush=True)
    meta = {"model": args.model, "steps": args.steps, "rounds": args.rounds,
            "generate_new_tokens": args.generate, "cpu": cpu_name(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "artifacts": artifacts, "backend": "reference (CPU)"}  # fmt: skip
    print(generate_table(results, args.generate) if args.generate else table(results))
    meta["load_before"] = LOAD_BEFORE
    meta["load_after"] = list(os.getloadavg())
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
