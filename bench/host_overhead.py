"""Host-side cost of one decode step through the quantized cache on the Triton path.

On a GPU, a decode step at small batch is often bound by the host: every torch call is a
kernel launch, and every `bool()` / `int()` / `.tolist()` / `nonzero` on a device tensor
is a sync that drains the launch queue. This counts both for one decode step of a real
model, with the Triton kernels run by the CPU interpreter (so it needs no GPU):

* torch compute ops (views and allocations left out), split into the model's own and
  kvq's, kvq's by the function that issued them;
* Triton kernel launches;
* device syncs (`bool`/`int`/`item`, `nonzero`, `.tolist()`), by the kvq function that
  forced them.

Prints a table; `--json FILE` writes the counts.

    python bench/host_overhead.py --policy int4
    python bench/host_overhead.py --artifact ART
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse
import collections
import json
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# metadata-only ops: no kernel runs for them on a GPU
VIEWS = {
    "view", "_unsafe_view", "alias", "t", "transpose", "permute", "expand", "slice", "select",
    "unsqueeze", "squeeze", "as_strided", "empty", "empty_like", "empty_strided", "detach",
    "unflatten", "reshape", "split", "chunk", "unbind", "view_as_real", "view_as_complex",
    "_reshape_alias", "lift_fresh",
}  # fmt: skip
SYNCS = {"_local_scalar_dense", "nonzero", "item"}


def _kvq_frame(stack) -> str | None:
    """'file:function' of the innermost kvq frame, or None when the model issued the op."""
    for f in reversed(stack):
        if "/kvq/" in f.filename:
            return f"{f.filename.rsplit('/', 1)[-1]}:{f.name}"
    return None


class Counter(TorchDispatchMode):
    """Counts torch ops and device syncs, leaving out what the Triton interpreter issues
    itself (its numpy round trips stand in for work that runs on the GPU)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS or name in SYNCS:
            stack = traceback.extract_stack()
            if not any("/triton/" in f.filename for f in stack):
                where = _kvq_frame(stack) or "model"
                if name in SYNCS:
                    self.syncs[where] += 1
                if name not in VIEWS:
                    self.ops[where] += 1
        return func(*args, **(kwargs or {}))


def count_step(loaded, cache, prompt_tokens: int) -> dict:
    """Prefill `prompt_tokens`, take one decode step untimed, then count a second one."""
    from triton.runtime.interpreter import InterpretedFunction

    launches = collections.Counter()
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches[getattr(self.fn, "__name__", "?")] += 1
        return run(self, *args, **kwargs)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 1000, (1, prompt_tokens), generator=g)
    nxt = torch.randint(100, 1000, (1, 1), generator=g)
    with torch.no_grad():
        loaded.model(ids, cache=cache, use_cache=True)
        loaded.model(nxt, cache=cache, use_cache=True)
        counter = Counter()
        tolist = torch.Tensor.tolist

        def counted_tolist(t):  # a device-to-host copy, dispatched as no op of its own
            counter.syncs[_kvq_frame(traceback.extract_stack()) or "model"] += 1
            return tolist(t)

        InterpretedFunction.run = counted
        torch.Tensor.tolist = counted_tolist
        try:
            with counter:
                loaded.model(nxt, cache=cache, use_cache=True)
        finally:
            InterpretedFunction.run = run
            torch.Tensor.tolist = tolist
    kvq_ops = {k: v for k, v in counter.ops.items() if k != "model"}
    return {
        "model_ops": counter.ops["model"],
        "kvq_ops": sum(kvq_ops.values()),
        "triton_launches": sum(launches.values()),
        "syncs": sum(counter.syncs.values()),
        "kvq_ops_by_function": dict(collections.Counter(kvq_ops).most_common()),
        "syncs_by_function": dict(counter.syncs.most_common()),
        "launches_by_kernel": dict(launches.most_common()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--policy", help="a calibration-free policy (int8, int4, int2, fp16)")
    src.add_argument("--artifact", help="an artifact directory")
    ap.add_argument("--prompt-tokens", type=int, default=12)
    ap.add_argument("--json", help="also write the counts to this JSON file")
    args = ap.parse_args()

    from kvq.artifacts.compat import load_artifact
    from kvq.models.loading import load_model
    from kvq.pipeline import cache_for

    loaded = load_model(args.model)
    artifact = load_artifact(args.artifact, loaded) if args.artifact else None
    cache = cache_for(loaded, artifact=artifact, policy=args.policy, backend="triton")
    counts = count_step(loaded, cache, args.prompt_tokens)
    layers = loaded.adapter.info.num_layers
    print(f"{args.model} · {args.policy or args.artifact} · one decode step, Triton path")
    for key in ("model_ops", "kvq_ops", "triton_launches", "syncs"):
        print(f"  {key:16s} {counts[key]:6d}  ({counts[key] / layers:5.1f} per layer)")
    print("  kvq ops by function:")
    for where, n in list(counts["kvq_ops_by_function"].items())[:12]:
        print(f"    {n:5d}  {where}")
    print("  syncs by function:")
    for where, n in counts["syncs_by_function"].items():
        print(f"    {n:5d}  {where}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"model": args.model, "source": args.policy or args.artifact, **counts}, f, indent=2
            )


if __name__ == "__main__":
    main()
