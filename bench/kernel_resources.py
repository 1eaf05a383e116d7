"""What each decode-attention launch configuration costs on an H100/H200 SM, without a GPU.

For two head shapes (Llama-like 32 query / 8 KV heads x 128, and Gemma 3 270M's
4 / 1 x 256) and each cache format of `bench/gpu_decode.py` (KV4, KV8, FP8, NUQ4,
plus Gemma's own layout, KV4 with pre-RoPE keys), every configuration the
autotuner may time is compiled for sm_90 here (`kvq.runtime.kernels.offline`),
and the table gives registers per thread, spilled bytes, shared memory, resident
programs and warps per SM, instructions and tensor-core instructions.

A decode kernel hides memory latency with resident warps: 8 of an SM's 64 warp
slots leave each warp's loads exposed. Timing still needs the GPU
(`bench/gpu_decode.py`); this says why a configuration can or cannot be fast,
and catches a change that makes the kernel spill.

`--json FILE` writes {"target": "sm_90", "rows": [{"shape", "format", "dots",
"BLOCK_T", "num_warps", "num_stages", "maxnreg", "registers", "stack_bytes",
"shared_bytes", "programs_per_sm", "warps_per_sm", "instructions",
"tensor_core_ops"}, ...]}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import gpu_decode
import torch

from kvq.runtime.kernels import _decode_attention_triton as kern
from kvq.runtime.kernels import decode_attention as da
from kvq.runtime.kernels.offline import compile_offline

SHAPES = {"llama-7b-like": (32, 8, 128), "gemma3-270m": (4, 1, 256)}
FORMATS = ("kv4", "kv4-pre", "kv8", "fp8", "nuq4")
ROWS = 256  # cached rows of the traced call (a multiple of 16, as long contexts are)
BATCH = 16


def segment(fmt: str, shape: str):
    """A `gpu_decode` segment of `fmt` at `shape` (kv4-pre: KV4 with pre-RoPE keys, the
    layout of a channel-scales artifact)."""
    gpu_decode.HQ, gpu_decode.HKV, gpu_decode.D = SHAPES[shape]
    seg = gpu_decode.packed("kv4" if fmt == "kv4-pre" else fmt, BATCH, ROWS, "cpu")
    if fmt == "kv4-pre":
        seg = dataclasses.replace(seg, key=dataclasses.replace(seg.key, pre_rope=True))
    return seg


def launch(fmt: str, shape: str, dots: str) -> tuple[tuple, dict]:
    """(args, constexprs) of the decode kernel's launch for one query token per sequence."""
    hq, _, d = SHAPES[shape]
    seg = segment(fmt, shape)
    query = torch.randn(BATCH, hq, 1, d)
    rope = gpu_decode.rope_tables(ROWS, "cpu")
    calls, _ = da.kernel_calls(query, [seg], scaling=d**-0.5, rope=rope, dots=dots)
    ((_, args, consts),) = calls
    return args, consts


def configs_for(consts: dict) -> list[dict]:
    """The autotuner's configurations that `_fits` keeps for this launch, as options."""
    kept = da._fits(da.autotune_configs(), {}, **consts)
    return [
        {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages, "maxnreg": c.maxnreg}
        for c in kept
    ]


def survey(shapes, formats, dots: str) -> list[dict]:
    rows = []
    for shape in shapes:
        for fmt in formats:
            args, consts = launch(fmt, shape, dots)
            for cfg in configs_for(consts):
                opts = {k: v for k, v in cfg.items() if v is not None}
                res = compile_offline(kern.decode_attention_kernel, args, consts, options=opts)
                row = {"shape": shape, "format": fmt, "dots": dots, **cfg, **res.as_dict()}
                rows.append(row)
                print(
                    f"{shape:14s} {fmt:8s} BLOCK_T={cfg['BLOCK_T']:<4d} warps={cfg['num_warps']} "
                    f"stages={cfg['num_stages']} prefetch={int(cfg['PREFETCH'])} "
                    f"maxnreg={cfg['maxnreg'] or '-':<4} "
                    f"regs={res.registers:<4d} spill={res.stack_bytes:<5d} "
                    f"smem={res.shared_bytes // 1024:>3d}K  programs/SM={res.programs_per_sm} "
                    f"warps/SM={res.warps_per_sm:<3d} instr={sum(res.sass.values()):<5d} "
                    f"tensor-core={res.tensor_core_ops}",
                    flush=True,
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--dots", default="tf32", choices=da.DOT_MODES)
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args()
    rows = survey(args.shapes, args.formats, args.dots)
    spilling = [r for r in rows if r["stack_bytes"]]
    best = max(r["warps_per_sm"] for r in rows)
    print(f"{len(rows)} configurations, {len(spilling)} spill; most resident warps/SM: {best}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": "sm_90", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
