"""GPU benchmark: decode attention over packed KV4 / KV8 / FP8 / NUQ4 / VQ vs fp16 SDPA.

One query token per sequence attends to a cache of `context` tokens at batch 1 and
16, for each head shape (`--shapes`: Llama-like 32 query / 8 KV heads x 128, Gemma 3
270M's 4 / 1 x 256). For
each representation, parity with the pure-torch reference is checked first on
a small real encode (raises on mismatch); timings then use random codes of the
right layout (time does not depend on code values; NUQ4 and the vector-codebook layouts
VQ3 (2-D codebooks) and VQ2 (4-D) have 1% key exceptions and pre-RoPE keys; NUQ4-post is
NUQ4 with post-RoPE keys, the layout the planned path takes; TR4 and TR2 are the trellis
codes `kvq calibrate auto` stores at 4, 3 and 2 bits: 12-bit states, pre-RoPE keys, 1% key
exceptions at 3 and 4 bits, 0.5% value slots at 4, none at 2).

Prints microseconds, the host time per call (launcher Python and launches, which is
the step time when it exceeds the kernel's), achieved GB/s (bytes of codes + qparams +
exceptions read), the share of the HBM peak and the launch chosen (the planned path's
plan and configuration, or the general kernel's autotuned configuration); then KV4 at
batch 16 x 32K through the general kernel, for comparison. `--json FILE` writes the
rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import torch
import torch.nn.functional as F

from kvq.quant import packing, vq
from kvq.runtime.codecs.fp8 import fp8_table
from kvq.runtime.kernels.decode import attention as da
from kvq.runtime.kernels.decode.attention import (
    Segment,
    decode_attention_reference,
    decode_attention_triton,
)
from kvq.runtime.packed import PackedRows

HQ, HKV, D = 32, 8, 128
SHAPES = {"llama-7b-like": (32, 8, 128), "gemma3-270m": (4, 1, 256)}
KINDS = ("kv8", "kv4", "kv4-token", "fp8", "nuq4", "nuq4-post", "vq3", "vq2", "tr4", "tr3",
         "tr2")  # fmt: skip
PEAK_GBS = 4800.0  # H200 HBM3e


def packed(kind: str, b: int, t: int, dev: str, seed: int = 0) -> Segment:
    """A segment of `t` rows per sequence in the layout of `kind`, filled with random codes."""
    g = torch.Generator(device=dev).manual_seed(seed)

    def codes(nbytes):
        return torch.randint(0, 256, (b, HKV, t, nbytes), generator=g, device=dev).to(torch.uint8)

    def half(*shape, lo=0.01, hi=0.05):
        return (torch.rand(*shape, generator=g, device=dev) * (hi - lo) + lo).half()

    pos = torch.arange(t, device=dev).expand(b, t)
    if kind in ("kv4", "kv8"):
        bits = 4 if kind == "kv4" else 8
        step = 2.5 / (2**bits - 1)  # realistic ranges: decoded values within about +-1.25
        key = PackedRows(
            "affine",
            D,
            codes(D * bits // 8),
            bits,
            scale=half(HKV, D, lo=step, hi=1.2 * step),
            offset=-half(HKV, D, lo=1.2, hi=1.3),
        )
        value = PackedRows(
            "affine",
            D,
            codes(D * bits // 8),
            bits,
            scale=half(b, HKV, t, D // 32, lo=step, hi=1.2 * step),
            offset=-half(b, HKV, t, D // 32, lo=1.2, hi=1.3),
        )
        return Segment(key, value, pos)
    if kind == "kv4-token":  # the calibration-free int4 policy: K and V per token, groups of 64
        step = 2.5 / 15

        def token_rows():
            return PackedRows(
                "affine",
                D,
                codes(D // 2),
                4,
                scale=half(b, HKV, t, D // 64, lo=step, hi=1.2 * step),
                offset=-half(b, HKV, t, D // 64, lo=1.2, hi=1.3),
            )

        return Segment(token_rows(), token_rows(), pos)
    if kind == "fp8":
        table = fp8_table("e4m3", dev)  # the codecs' table: the kernels know its format
        key = PackedRows("lookup", D, codes(D) & 0x7E, 8, scale=half(HKV).float(), table=table)
        value = PackedRows("lookup", D, codes(D) & 0x7E, 8, scale=half(HKV).float(), table=table)
        return Segment(key, value, pos)
    if kind == "nuq4-post":  # NUQ4 with post-RoPE keys: the planned path's layout
        seg = packed("nuq4", b, t, dev, seed)
        return Segment(dataclasses.replace(seg.key, pre_rope=False), seg.value, seg.positions)
    if kind in ("nuq4", "vq4", "vq3", "vq2", "vq1"):  # KVQuant's layout: scalar or vector codebooks
        if kind == "nuq4":
            bits, fmt = 4, dict(kind="lookup", table=torch.linspace(-1, 1, 16, device=dev))
        else:  # what `kvq calibrate auto` stores at 3 and 2 bits (vq3, vq2; their layers'
            bits = int(kind[-1])  # mixed widths vq4 and vq1 too: 2-D above 2 bits, else 4-D)
            m = 4 if bits <= 2 else 2
            centroids = torch.rand(2 ** (bits * m), m, generator=g, device=dev) * 2 - 1
            groups = vq.channel_groups(D, m, pairs=True).to(dev)  # RoPE pairs
            fmt = dict(kind="vector", table=centroids, groups=groups)
            # values over neighbouring channels (`kvq.calibrators.vq`)
            value_fmt = {**fmt, "groups": vq.channel_groups(D, m, pairs=False).to(dev)}
        row_bytes = packing.packed_len(D, bits)
        per_row = math.ceil(0.01 * D)  # ~1% of a row's channels as exact exceptions
        count = torch.full((b, HKV, t), per_row, dtype=torch.uint8, device=dev)
        n = b * HKV * t * per_row
        # distinct channels within a row: entry i falls in the i-th slice of the row
        width = D // per_row
        index = torch.randint(0, width, (n // per_row, per_row), generator=g, device=dev)
        index = (index + torch.arange(per_row, device=dev) * width).flatten().to(torch.uint8)
        key = PackedRows(
            head_dim=D,
            data=codes(row_bytes),
            bits=bits,
            scale=half(HKV, D),
            offset=half(HKV, D),
            **fmt,
            sparse_count=count,
            sparse_index=index,
            sparse_value=half(n),
            pre_rope=True,
        )
        slots = torch.randint(0, D // 2, (b, HKV, t, 2), generator=g, device=dev)
        slots = (slots + torch.tensor([0, D // 2], device=dev)).to(torch.uint8)  # distinct
        value = PackedRows(
            head_dim=D,
            data=codes(row_bytes),
            bits=bits,
            scale=half(b, HKV, t, 1),
            offset=half(b, HKV, t, 1),
            **(fmt if kind == "nuq4" else value_fmt),
            slot_index=slots,
            slot_value=half(b, HKV, t, 2),
        )
        return Segment(key, value, pos)
    if kind in ("tr4", "tr3", "tr2", "tr1"):  # trellis codes as `kvq calibrate auto` stores them
        return _trellis(int(kind[-1]), b, t, dev, g)
    raise ValueError(kind)


def _trellis(bits: int, b: int, t: int, dev: str, g) -> Segment:
    """Trellis rows of `bits`-bit digits, 12-bit states: keys before RoPE with the static
    normaliser, values with a per-row one; auto's exceptions: 1% key entries at 3 and 4
    bits, 0.5% value slots at 4, none at 2."""
    codes = torch.randint(0, 256, (b, HKV, t, packing.packed_len(D, bits)), generator=g,
                          device=dev).to(torch.uint8)  # fmt: skip
    table = torch.rand(4096, generator=g, device=dev) * 2 - 1

    def half(*shape):
        return (torch.rand(*shape, generator=g, device=dev) * 0.04 + 0.01).half()

    extra_k, extra_v = {}, {}
    if bits >= 3:
        per_row, width = math.ceil(0.01 * D), D // math.ceil(0.01 * D)
        n = b * HKV * t * per_row
        index = torch.randint(0, width, (n // per_row, per_row), generator=g, device=dev)
        index = (index + torch.arange(per_row, device=dev) * width).flatten().to(torch.uint8)
        count = torch.full((b, HKV, t), per_row, dtype=torch.uint8, device=dev)
        extra_k = dict(sparse_count=count, sparse_index=index, sparse_value=half(n))
    if bits == 4:
        slots = math.ceil(0.005 * D)
        index = torch.randint(0, D, (b, HKV, t, slots), generator=g, device=dev)
        extra_v = dict(slot_index=index.to(torch.uint8), slot_value=half(b, HKV, t, slots))
    key = PackedRows("trellis", D, codes, bits, scale=half(HKV, D), offset=half(HKV, D),
                     table=table, window=12, pre_rope=True, **extra_k)  # fmt: skip
    value = PackedRows("trellis", D, codes.clone(), bits, scale=half(b, HKV, t, 1),
                       offset=half(b, HKV, t, 1), table=table, window=12,
                       **extra_v)  # fmt: skip
    pos = torch.arange(t, device=dev).expand(b, t)
    return Segment(key, value, pos)


def nbytes(seg: Segment) -> int:
    total = 0
    for p in (seg.key, seg.value):
        for name in ("data", "scale", "offset", "zero_point", "slot_index", "slot_value"):
            t = getattr(p, name)
            total += 0 if t is None else t.nbytes
        for name in ("sparse_count", "sparse_index", "sparse_value"):
            t = getattr(p, name)
            total += 0 if t is None else t.nbytes
    return total


def rope_tables(t: int, dev: str):
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2, device=dev).float() / D)
    ang = torch.arange(t, device=dev).float()[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def parity(dev: str) -> list[str]:
    """Kernel vs reference on each layout (random codes, 1000 rows, batch 2)."""
    lines = []
    rope = rope_tables(1000, dev)
    for kind in KINDS:
        seg = packed(kind, 2, 1000, dev, seed=1)
        q = torch.randn(2, HQ, 1, D, device=dev)
        ref = decode_attention_reference(q, [seg], scaling=D**-0.5, rope=rope)
        out = decode_attention_triton(q, [seg], scaling=D**-0.5, rope=rope)
        err = (out - ref).abs().max().item()
        lines.append(f"parity {kind}: max abs error {err:.2e}")
        if not err < 5e-3:
            lines.append(f"PARITY FAILED for {kind}: {err:.2e} > 5e-3")
    return lines


def _sdpa_fp16(q, t: int, dev: str, do_bench) -> tuple[float, float]:
    """(microseconds, GB/s) of torch SDPA over an fp16 cache of t tokens."""
    b = q.shape[0]
    k16 = torch.randn(b, HKV, t, D, device=dev, dtype=torch.float16)
    v16 = torch.randn_like(k16)
    q16 = q.half().view(b, HKV, HQ // HKV, D)  # GQA as query rows: no K/V copy
    us = do_bench(lambda: F.scaled_dot_product_attention(q16, k16, v16)) * 1e3
    return us, (k16.nbytes + v16.nbytes) / us / 1e3


def host_us(fn, calls: int = 20) -> float:
    """Microseconds of host time per call, the GPU left to run behind: the launcher's Python,
    torch calls and kernel launches. When it exceeds the kernel time, it is the step time."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def launch_chosen(q, seg) -> str:
    """The planned path's plan and configuration for this call, or the general kernel's
    autotuned configuration."""
    from kvq.runtime.kernels.decode import planned as planned_decode
    from kvq.runtime.kernels.decode import planned_layouts

    if da.PLANNED and planned_layouts.planned_unsupported(q, [seg], None) is None:
        call = planned_decode.planned_call(q, [seg], scaling=1.0, softcap=None, half=True)
        plan = planned_decode._launcher(q.device).plan(call)
        c = call.config
        return (
            f"planned BLOCK_T={c.block_t} warps={c.num_warps} stages={c.num_stages} "
            f"splits={plan.splits} programs={plan.programs} slots={plan.slots} "
            f"waves={plan.waves} fill={plan.fill:.2f}"
        )
    return f"general {getattr(da.cuda_kernel(), 'best_config', '?')}"


def bench_case(b: int, t: int, dev: str, do_bench, shape: str = "llama-7b-like") -> list[dict]:
    """fp16 SDPA, then each packed layout, at batch b and context t."""
    q = torch.randn(b, HQ, 1, D, device=dev)
    rope = rope_tables(t, dev)
    base, gbs = _sdpa_fp16(q, t, dev, do_bench)
    rows = [dict(shape=shape, batch=b, context=t, path="sdpa-fp16", us=base, gbs=gbs)]
    print(
        f"{shape} b={b:<3d} T={t:<7d} sdpa-fp16 {base:10.1f} us {gbs:7.0f} GB/s "
        f"({100 * gbs / PEAK_GBS:4.1f}% of peak)",
        flush=True,
    )
    for kind in KINDS:
        seg = packed(kind, b, t, dev)

        def call(s=seg):
            return decode_attention_triton(q, [s], scaling=D**-0.5, rope=rope)

        us = do_bench(call) * 1e3
        host = host_us(call)
        gbs = nbytes(seg) / us / 1e3
        config = launch_chosen(q, seg)
        rows.append(
            dict(
                shape=shape,
                batch=b,
                context=t,
                path=kind,
                us=us,
                host_us=host,
                gbs=gbs,
                speedup=base / us,
                hbm_share=gbs / PEAK_GBS,
                config=config,
            )
        )
        print(
            f"{shape} b={b:<3d} T={t:<7d} {kind:9s} {us:10.1f} us (host {host:6.1f} us) "
            f"{gbs:7.0f} GB/s "
            f"({100 * gbs / PEAK_GBS:4.1f}% of peak)  {base / us:5.2f}x vs fp16 sdpa  [{config}]",
            flush=True,
        )
        del seg
    return rows


def general_kernel(dev: str, do_bench, b: int = 16, t: int = 32768) -> list[dict]:
    """KV4 (Llama-like) at batch b x context t through the general kernel (the path before
    the plan): what the planned path gains, measured."""
    set_shape("llama-7b-like")
    q = torch.randn(b, HQ, 1, D, device=dev)
    rope = rope_tables(t, dev)
    seg = packed("kv4", b, t, dev)
    try:
        da.PLANNED = False
        us = 1e3 * do_bench(lambda: decode_attention_triton(q, [seg], scaling=D**-0.5, rope=rope))
    finally:
        da.PLANNED = True
    gbs = nbytes(seg) / us / 1e3
    print(
        f"llama-7b-like b={b} T={t} kv4 general kernel {us:10.1f} us {gbs:7.0f} GB/s "
        f"({100 * gbs / PEAK_GBS:4.1f}% of peak) [{launch_chosen(q, seg)}]",
        flush=True,
    )
    return [dict(shape="llama-7b-like", batch=b, context=t, path="kv4-general", us=us, gbs=gbs)]


def set_shape(shape: str) -> None:
    global HQ, HKV, D
    HQ, HKV, D = SHAPES[shape]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", nargs="+", type=int, default=[4096, 32768, 131072])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return
    from triton.testing import do_bench

    dev = "cuda"
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    rows = []

    def save():  # after every case: a run cut short by its timeout keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)

    # shortest contexts first, both shapes, so a run cut short still covers every shape
    for t in args.contexts:
        for shape in args.shapes:
            set_shape(shape)
            if t == args.contexts[0]:
                for line in parity(dev):
                    print(shape, line, flush=True)
            for b in args.batches:
                rows += bench_case(b, t, dev, do_bench, shape)
                torch.cuda.empty_cache()
                save()
    rows += general_kernel(dev, do_bench)
    save()


if __name__ == "__main__":
    main()
