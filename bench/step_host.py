"""Host time of one layer's decode step through the kvq cache, every kernel launch stubbed.

What the host does per layer and decode step on the Triton path — `QuantizedKVCache.update`
(the append: checks, the append kernel's arguments, the row store's successor) and the
kvq attention (the layer's segments, routing, the planned kernel's arguments and plan) —
timed on this CPU-only machine with the append kernels' and the planned kernels' launches
replaced by no-ops (tensors on the CPU; `torch.empty` stands in for the caching
allocator). The cache is driven through its public interface the way a model's attention
layers drive it (update, then the attention function), after a prefill of `--context`
tokens, on a Llama-like head layout of `bench/gpu_decode.py`'s shapes. Besides the time,
one step is counted op by op (`host_overhead.Counter`): torch compute ops (each a launch
on CUDA), device syncs, and the stubbed Triton launches, per layer.

    python bench/step_host.py --json F            # replayable steps (prepare_replay)
    python bench/step_host.py --eager --json F    # what eager decoding does by default
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton backend on CPU tensors (stubbed)

import argparse
import json
import time

import gpu_decode
import torch
from host_overhead import Counter
from planned_host import _Compiled, _stub_launcher
from transformers import LlamaConfig, LlamaForCausalLM

from kvq.models.adapters import get_adapter
from kvq.quant.schemes import named_policy
from kvq.runtime.attention import kvq_attention
from kvq.runtime.cache import build_cache, unit_scales
from kvq.runtime.kernels.append import codes as append
from kvq.runtime.kernels.decode import _splits_triton as kern
from kvq.runtime.kernels.decode import planned

SHAPES = gpu_decode.SHAPES
POLICIES = ("int4", "int8", "fp8-e4m3")
LAYERS = 2
LAUNCHES: list[str] = []  # every stubbed launch, by kernel


def _model(hq: int, hkv: int, d: int):
    """A Llama with the head layout of a shape (tiny hidden size: only the cache is run)."""
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                         num_hidden_layers=LAYERS, num_attention_heads=hq,
                         num_key_value_heads=hkv, head_dim=d, max_position_embeddings=1 << 16)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _stub() -> _Compiled:
    """Every launch a no-op, recorded in LAUNCHES: the planned kernels' compiled launches
    and the append kernels (whose flags then read as "nothing wrong")."""
    stub = _Compiled()
    for f in (kern.decode_splits_kernel, kern.combine_splits_kernel):
        f.warmup = lambda *a, **k: stub
    launcher = _stub_launcher()
    planned._launcher = lambda device: launcher
    launch = planned._Launcher.launch

    def counted(self, fn, *args):
        LAUNCHES.append(fn.__name__)
        return launch(self, fn, *args)

    planned._Launcher.launch = counted
    append._launch = lambda kernel, *a, **k: LAUNCHES.append(kernel)
    append._flags = lambda n, device: torch.zeros(n, dtype=torch.uint8, device=device)
    return stub


def measure(
    policy: str, shape: str, batch: int, context: int, steps: int, repeats: int, replay: bool
) -> dict:
    hq, hkv, d = SHAPES[shape]
    model = _model(hq, hkv, d)
    ad = get_adapter(model)
    lp = named_policy(policy, LAYERS, d)
    cache = build_cache(model, lp, unit_scales(lp), ad, backend="triton")
    if replay:
        cache.prepare_replay()
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(batch, hkv, context, d, generator=g) for _ in range(2))
    positions = torch.arange(context).expand(batch, context)
    for i in range(LAYERS):  # prefill: appended and published, no attention needed
        view, _ = cache.update(k, v, i, kwargs={"position_ids": positions})
        view.prepare(None)
        cache.attended(i)
    q = torch.randn(batch, hq, 1, d, generator=g)
    k1, v1 = k[:, :, :1].clone(), v[:, :, :1].clone()
    total = 5 + repeats * steps  # warm-up, timed, counted
    pos = [torch.full((batch, 1), context + n) for n in range(total)]
    calls = iter(pos)

    def step():
        p = next(calls)
        for i in range(LAYERS):
            view, _ = cache.update(k1, v1, i, kwargs={"position_ids": p})
            kvq_attention(None, q, view, view, None, scaling=d**-0.5)

    for _ in range(4):  # warm: growth past the prefill's buffers, sites, plans
        step()
    means = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(steps):
            step()
        means.append((time.thread_time() - t0) / steps / LAYERS * 1e6)
    counter, launched = Counter(), len(LAUNCHES)
    with counter:
        step()
    per_layer = {
        "ops_per_layer_step": sum(counter.ops.values()) / LAYERS,
        "syncs_per_layer_step": sum(counter.syncs.values()) / LAYERS,
        "launches_per_layer_step": (len(LAUNCHES) - launched) / LAYERS,
    }
    return {"policy": policy, "shape": shape, "batch": batch, "context": context, "replay": replay,
            "us_per_layer_step": round(min(means), 1), **per_layer}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--eager", action="store_true", help="no prepare_replay: host-driven steps")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if args.repeats * args.steps + 5 > args.context:
        raise SystemExit("--context must leave room for every timed step in the buffers")
    stub = _stub()
    rows = []
    with torch.no_grad():
        for shape in args.shapes:
            for policy in args.policies:
                for batch in args.batches:
                    rows.append(measure(policy, shape, batch, args.context, args.steps,
                                        args.repeats, not args.eager))  # fmt: skip
                    print(json.dumps(rows[-1]), flush=True)
    assert stub.launched and LAUNCHES  # the stubs took the launches
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": LAYERS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
