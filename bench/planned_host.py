"""Python time of one planned decode call on the host, the kernel launches stubbed.

A decode step at small batch is bound by the host when the Python that prepares each
layer's launch takes longer than the kernel (a few microseconds at batch 1 x 4K). This
times what `planned_decode.run_planned` does per layer call on a CUDA device — the
call's arguments (`planned_call`), the plan, the launcher's specialisation key and
argument list, the two allocations — with the compiled kernels replaced by no-op stubs,
so it runs on this CPU-only machine (tensors on the CPU; `torch.empty` there stands in
for the caching allocator). The routing check (`planned_unsupported`) is timed apart.

Each timed call gets the segments a layer hands attention at one decode step: sink rows
(full precision), the packed main rows and the residual window, as views of buffers
with room to grow (new view objects every step, rows changing: the residual window
grows by one row per step, the main rows by 64 every 64 steps), in the layouts of
`bench/gpu_decode.py` (`--formats`) at its two head shapes, batch 16.

    python bench/planned_host.py --json F
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from types import SimpleNamespace

import gpu_decode
import torch

from kvq.runtime.kernels.decode import _splits_triton as kern
from kvq.runtime.kernels.decode import planned
from kvq.runtime.kernels.decode.attention import Segment
from kvq.runtime.kernels.decode.planned_layouts import planned_unsupported
from kvq.runtime.packed import PackedRows

SHAPES = gpu_decode.SHAPES
FORMATS = ("kv4", "kv4-pre", "nuq4-post")
BATCH = 16
SINK, MAIN0, MAIN_CAP, RESIDUAL_CAP = 4, 1024, 2048, 64
STEPS = 256  # distinct decode steps, cycled through


class _Compiled:
    """Stands in for a compiled kernel: resource figures for the plan, a launch that
    does nothing (after taking its arguments, as the driver's launcher would)."""

    def __init__(self):
        self.metadata = SimpleNamespace(num_warps=4, shared=30720)
        self.n_regs = 128
        self.launched = 0

    def __getitem__(self, grid):
        def run(*args):
            self.launched += 1

        return run


def _sliced(p: PackedRows, rows: int) -> PackedRows:
    """`p` with its per-row tensors cut to the first `rows` rows (views, as the cache's)."""
    cut = {}
    for name in ("data", "scale", "offset", "slot_index", "slot_value", "sparse_count"):
        t = getattr(p, name)
        per_row = t is not None and t.dim() >= 3 and t.shape[0] == BATCH
        if per_row:
            cut[name] = t[:, :, :rows]
    return dataclasses.replace(p, **cut)


def layer_steps(fmt: str, shape: str) -> tuple[list, torch.Tensor, tuple | None]:
    """(segments of STEPS decode steps, query, rope tables) of one layer in `fmt`."""
    hq, hkv, d = SHAPES[shape]
    gpu_decode.HQ, gpu_decode.HKV, gpu_decode.D = hq, hkv, d
    base = {"kv4-pre": "kv4"}.get(fmt, fmt)
    main = gpu_decode.packed(base, BATCH, MAIN_CAP, "cpu")
    pre = fmt == "kv4-pre"
    if pre:
        main = dataclasses.replace(main, key=dataclasses.replace(main.key, pre_rope=True))
    full = {n: torch.randn(BATCH, hkv, SINK + RESIDUAL_CAP, d).half() for n in "kv"}
    pos = torch.arange(MAIN_CAP + SINK + RESIDUAL_CAP).expand(BATCH, -1)
    steps = []
    for i in range(STEPS):
        rows = MAIN0 + (i // RESIDUAL_CAP) * RESIDUAL_CAP
        recent = i % RESIDUAL_CAP + 1
        sink = Segment(PackedRows("full", d, full["k"][:, :, :SINK], pre_rope=pre),
                       PackedRows("full", d, full["v"][:, :, :SINK]),
                       pos[:, :SINK] if pre else None)  # fmt: skip
        packed = Segment(_sliced(main.key, rows), _sliced(main.value, rows),
                         pos[:, SINK : SINK + rows] if pre else None)  # fmt: skip
        res = Segment(PackedRows("full", d, full["k"][:, :, SINK : SINK + recent], pre_rope=pre),
                      PackedRows("full", d, full["v"][:, :, SINK : SINK + recent]),
                      pos[:, SINK + rows : SINK + rows + recent] if pre else None)  # fmt: skip
        steps.append([sink, packed, res])
    query = torch.randn(BATCH, hq, 1, d)
    rope = gpu_decode.rope_tables(MAIN_CAP + SINK + RESIDUAL_CAP, "cpu") if pre else None
    return steps, query, rope


def _stub_launcher() -> planned._Launcher:
    launcher = planned._Launcher.__new__(planned._Launcher)
    launcher.device = torch.device("cuda")  # the compiled path; nothing touches a GPU
    launcher.compiled = {}
    launcher.interpreted = False
    launcher.sms = 132
    return launcher


def time_calls(fn, steps, repeats: int) -> float:
    """The least over `repeats` of the mean microseconds of CPU time per call of
    fn(segments) (CPU time of this thread, and the least: the machine is shared, and a
    descheduled or disturbed repeat would count other processes' time)."""
    for segs in steps[:8]:
        fn(segs)  # warm: specialisations, cached tables
    means = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for segs in steps:
            fn(segs)
        means.append((time.thread_time() - t0) / len(steps) * 1e6)
    return min(means)


def measure(fmt: str, shape: str, repeats: int) -> dict:
    steps, query, rope = layer_steps(fmt, shape)
    d = query.shape[-1]
    launcher = _stub_launcher()
    stub = _Compiled()
    saved = {f: f.__dict__.get("warmup") for f in (kern.decode_splits_kernel,
                                                   kern.combine_splits_kernel)}  # fmt: skip
    original = planned._launcher
    for f in saved:
        f.warmup = lambda *a, **k: stub
    planned._launcher = lambda device: launcher
    try:
        call = dict(scaling=d**-0.5, softcap=None, half=True, rope=rope)
        route = time_calls(lambda segs: planned_unsupported(query, segs, None), steps,
                           repeats)  # fmt: skip
        assert planned_unsupported(query, steps[0], None) is None
        args = time_calls(lambda segs: planned.planned_call(query, segs, **call), steps, repeats)
        total = time_calls(lambda segs: planned.run_planned(query, segs, **call), steps, repeats)
    finally:
        planned._launcher = original
        for f, w in saved.items():
            if w is None:
                del f.warmup
            else:
                f.warmup = w
    assert stub.launched
    return {"format": fmt, "shape": shape, "planned_unsupported_us": round(route, 2),
            "planned_call_us": round(args, 2), "run_planned_us": round(total, 2)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run without TRITON_INTERPRET: this times the compiled path's host side")
    rows = []
    for shape in args.shapes:
        for fmt in args.formats:
            rows.append(measure(fmt, shape, args.repeats))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": BATCH, "steps": STEPS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
