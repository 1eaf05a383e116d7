"""A8 producer kernels on CUDA: fused RMSNorm -> INT8 and the W8A8 linear, against torch.

    .venv/bin/python bench/a8_gpu.py [--json FILE]

Times (median microseconds, `triton.testing.do_bench`):
  * rmsnorm_quant, Triton vs the pure-torch reference, M in (1, 16, 4096), K = 4096;
  * int8_linear (Triton) vs a torch fp16 matmul of the same shape, M in (16, 4096),
    N = K = 4096.
Every shape is first checked for parity with the reference (codes and scales bit-exact,
GEMM output to rtol 1e-6); a mismatch raises. Both rmsnorm_quant paths include the
host sync of their scale check. Exits with a message, and status 0, without CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvq.runtime.kernels.activations import a8

EPS = 1e-6
NORM_ROWS = (1, 16, 4096)
GEMM_ROWS = (16, 4096)
HIDDEN = 4096


def microseconds(fn) -> float:
    from triton.testing import do_bench

    return 1e3 * do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_rmsnorm(m: int, gen: torch.Generator) -> list[dict]:
    x = torch.randn(m, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    x[:, 7] *= 50.0  # an outlier channel, as in real activations
    w = (1 + 0.1 * torch.randn(HIDDEN, generator=gen, device="cuda")).to(torch.bfloat16)
    want = a8.rmsnorm_quant_reference(x, w, EPS)
    got = a8.rmsnorm_quant_triton(x, w, EPS)
    if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
        codes_off = int((got[0] != want[0]).sum())
        scales_off = int((got[1] != want[1]).sum())
        raise RuntimeError(
            f"rmsnorm_quant M={m}: triton differs from reference "
            f"({codes_off} codes, {scales_off} scales)"
        )
    shape = dict(op="rmsnorm_quant", M=m, N=None, K=HIDDEN)
    return [
        dict(shape, impl="triton", us=microseconds(lambda: a8.rmsnorm_quant_triton(x, w, EPS))),
        dict(
            shape,
            impl="torch reference",
            us=microseconds(lambda: a8.rmsnorm_quant_reference(x, w, EPS)),
        ),
    ]


def bench_linear(m: int, gen: torch.Generator) -> list[dict]:
    n = k = HIDDEN
    x = torch.randn(m, k, generator=gen, device="cuda")
    w = torch.randn(n, k, generator=gen, device="cuda") / k**0.5
    x_codes, x_scale = a8.rmsnorm_quant_reference(x, torch.ones(k, device="cuda"), EPS)
    w_codes, w_scale = a8.quantize_weight_per_channel(w)
    args = (x_codes, x_scale, w_codes, w_scale)
    want = a8.int8_linear_reference(*args)
    got = a8.int8_linear_triton(*args)
    if not torch.allclose(got, want, rtol=1e-6, atol=0.0):
        raise RuntimeError(f"int8_linear M={m}: triton differs from reference")
    x16, w16 = x.half(), w.half()
    shape = dict(op="int8_linear", M=m, N=n, K=k)
    return [
        dict(shape, impl="triton int8", us=microseconds(lambda: a8.int8_linear_triton(*args))),
        dict(shape, impl="torch fp16 matmul", us=microseconds(lambda: x16 @ w16.T)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, help="also write the rows to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/a8_gpu.py: CUDA is not available; nothing to measure.")
        sys.exit(0)

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [r for m in NORM_ROWS for r in bench_rmsnorm(m, gen)]
    rows += [r for m in GEMM_ROWS for r in bench_linear(m, gen)]

    table = Table(title=f"A8 kernels on {torch.cuda.get_device_name()} (parity checked)")
    for col in ("op", "M", "N", "K", "impl", "us"):
        table.add_column(col, justify="left" if col in ("op", "impl") else "right")
    for r in rows:
        n = "-" if r["N"] is None else str(r["N"])
        table.add_row(r["op"], str(r["M"]), n, str(r["K"]), r["impl"], f"{r['us']:.1f}")
    Console().print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}))


if __name__ == "__main__":
    main()
