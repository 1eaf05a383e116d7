"""GPU benchmark: decode tokens per second of Gemma 3 270M through `generate`, kvq cache vs
the fp16 DynamicCache, at batch 16.

Both runs generate the same number of tokens greedily after the same random prompt;
the decode rate is (batch x (new - 1) tokens) / (time of `new` tokens - time of one),
so prefill is left out. The kvq cache uses a calibration-free policy (default int4: K
and V per token, groups of 64, the layout the planned decode path takes). Prints one
line per cache and the ratio; `--json FILE` writes them.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _timed_generate(model, ids, new: int, cache_fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        cache=cache_fn(),  # how kvq's own tests pass a cache (tests/runtime/test_contract.py)
    )
    torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_rate(model, ids, new: int, cache_fn, repeats: int = 2) -> float:
    """Decoded tokens per second over the batch (prefill and first token left out)."""
    _timed_generate(model, ids, 2, cache_fn)  # warm: compile kernels, allocator
    full = min(_timed_generate(model, ids, new, cache_fn) for _ in range(repeats))
    first = min(_timed_generate(model, ids, 1, cache_fn) for _ in range(repeats))
    return ids.shape[0] * (new - 1) / max(full - first, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--policy", default="int4")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return
    from transformers import DynamicCache

    import kvq

    model, _ = kvq.load_model(args.model)
    model = model.to("cuda", torch.float16)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(100, vocab - 100, (args.batch, args.prompt), generator=g).cuda()
    rows = []
    with torch.inference_mode():
        base = decode_rate(model, ids, args.new, lambda: DynamicCache(config=model.config))
        rows.append({"cache": "fp16-dynamic", "tokens_per_s": base})
        rate = decode_rate(
            model,
            ids,
            args.new,
            lambda: kvq.make_cache(model, policy=args.policy, backend="triton"),
        )
        rows.append({"cache": f"kvq-{args.policy}", "tokens_per_s": rate, "ratio": rate / base})
    for r in rows:
        extra = f"  {r['ratio']:.2f}x fp16" if "ratio" in r else ""
        print(
            f"{args.model} batch {args.batch} prompt {args.prompt} +{args.new}: "
            f"{r['cache']:14s} {r['tokens_per_s']:9.0f} tokens/s{extra}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows},
                      f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
