"""The Python API's misuse and tampering cases on a real model, each with its outcome.

    python bench/api_trust.py --artifact artifacts/demo [--json out.json]

Each case is a thing a user (or a damaged file) does with a real cache of the model; the
outcome is the one-line `KvqError` it ends in, or "accepted" (with the next-token logit
difference where a wrong state was accepted). Before these checks existed the cases
below loaded silently or raised raw exceptions (see the closing note of the issue that
added them).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import kvq
from kvq.errors import KvqError


def _outcome(fn) -> str:
    try:
        fn()
    except KvqError as e:
        return f"KvqError: {e}"
    except Exception as e:  # noqa: BLE001 (what we report is exactly this)
        return f"OTHER {type(e).__name__}: {str(e)[:100]}"
    return "accepted"


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model, tok = kvq.load_model(args.model)
    art = args.artifact
    ids = tok(["The capital of France is Paris, and the river is"] * 2, return_tensors="pt")
    ids = ids["input_ids"]
    step = ids[:, -1:]

    def filled():
        cache = kvq.make_cache(model, artifact=art)
        model(ids[:, :-1], cache=cache)
        return cache

    tmp = Path(tempfile.mkdtemp(prefix="kvq-api-trust-"))
    state = tmp / "state.safetensors"
    filled().save(state)
    pristine = state.read_bytes()
    header = 8 + int.from_bytes(pristine[:8], "little")
    info = model._kvq_loaded.adapter.info
    kv = lambda *shape, dtype=torch.float32: torch.randn(shape).to(dtype)  # noqa: E731
    b, h, d = 2, info.num_kv_heads, info.head_dim

    def corrupt(edit):
        def go():
            state.write_bytes(pristine)
            edit()
            kvq.load_cache(state, model, artifact=art)

        return go

    def swap_layers():
        tensors = load_file(state)
        with safe_open(str(state), framework="pt") as f:
            meta = f.metadata()
        swapped = {}
        for name, t in tensors.items():
            i = name.split(".")[1]
            j = {"0": "1", "1": "0"}.get(i, i)
            swapped[name.replace(f"layers.{i}.", f"layers.{j}.", 1)] = t
        save_file(swapped, str(state), metadata=meta)

    def perturbed_weights():
        weight = model.model.layers[0].mlp.down_proj.weight
        weight[0, 0] += 0.5
        try:
            filled().save(tmp / "perturbed.safetensors")
        finally:
            weight[0, 0] -= 0.5
        kvq.load_cache(tmp / "perturbed.safetensors", model, artifact=art)

    def plain_model():
        cache = filled()
        model.set_attn_implementation("sdpa")
        try:
            model(step, cache=cache)
        finally:
            model.set_attn_implementation("kvq")

    cases = {
        "save onto ART/tensors.safetensors": lambda: filled().save(art / "tensors.safetensors"),
        "save onto a directory": lambda: filled().save(tmp),
        "save under a missing folder": lambda: filled().save(tmp / "no" / "s.safetensors"),
        "load a state saved by a model with one weight changed": perturbed_weights,
        "load: a byte flipped mid-file": corrupt(
            lambda: _flip(state, (header + len(pristine)) // 2)
        ),
        "load: the last byte flipped": corrupt(lambda: _flip(state, len(pristine) - 1)),
        "load: two layers swapped": corrupt(swap_layers),
        "update() with int64 K/V": lambda: filled().update(
            kv(b, h, 1, d, dtype=torch.int64), kv(b, h, 1, d, dtype=torch.int64), 0
        ),
        "update() with bool K/V": lambda: filled().update(
            kv(b, h, 1, d, dtype=torch.bool), kv(b, h, 1, d, dtype=torch.bool), 0
        ),
        f"update() with {h + 1} KV heads": lambda: filled().update(
            kv(b, h + 1, 1, d), kv(b, h + 1, 1, d), 0
        ),
        "update() with head_dim 128 rows": lambda: filled().update(
            kv(b, h, 1, 128), kv(b, h, 1, 128), 0
        ),
        "update() of rank 3": lambda: filled().update(kv(h, 1, d), kv(h, 1, d), 0),
        "a forward of batch 1 into a batch-2 cache": lambda: model(step[:1], cache=filled()),
        "batched generate, then a single prompt": lambda: model.generate(
            ids[:1, :4], cache=filled(), max_new_tokens=2, do_sample=False
        ),
        "the cache handed to SDPA (a model without kvq attention)": plain_model,
        "reorder_cache with index 5 of 2": lambda: filled().reorder_cache(torch.tensor([5, 0])),
        "batch_select_indices with a float tensor": lambda: filled().batch_select_indices(
            torch.tensor([0.0])
        ),
        "crop(3) (positive)": lambda: filled().crop(3),
        "make_cache(artifact=123)": lambda: kvq.make_cache(model, artifact=123),
        "make_cache(policy=4)": lambda: kvq.make_cache(model, policy=4),
    }
    rows = {name: _outcome(fn) for name, fn in cases.items()}
    width = max(map(len, rows))
    for name, outcome in rows.items():
        print(f"{name:<{width}}  {outcome[:150]}")
    others = sum(not o.startswith("KvqError") for o in rows.values())
    print(f"\n{len(rows)} cases: {len(rows) - others} KvqError, {others} other")
    if args.json:
        args.json.write_text(
            json.dumps({"model": args.model, "artifact": str(art), "cases": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
