"""What each decode-attention launch costs on an H100/H200 SM, without a GPU.

For two head shapes (Llama-like 32 query / 8 KV heads x 128, and Gemma 3 270M's
4 / 1 x 256) and each cache format of `bench/gpu_decode.py` (KV4, KV8, FP8, NUQ4, the
vector-codebook layouts VQ3 and VQ2 of `kvq calibrate vq` and the mixed widths its layers
take, VQ4 (2-D) and VQ1 (4-D), the trellis codes TR4, TR3 and TR2 of `kvq calibrate auto`, plus
Gemma's own layout,
KV4 with pre-RoPE keys, and NUQ4 with post-RoPE keys), the launch the runtime makes at
batch 16 x 32K is compiled for sm_90 here (`kvq.runtime.kernels.offline.cubin`): the planned
path's fixed configuration where it takes the layout (`planned_decode`), else every
configuration the general kernel's autotuner may time, keeping the best predicted.

Per (format, shape), `--json FILE` writes the item-5 targets: `spill_bytes`,
`warps_per_sm`, `loop_instructions_per_row` (the main loop's SASS instructions x
warps / rows per tile: warp-instructions per cached row of one KV head),
`int_to_float_in_loop` (I2F/I2FP), `mma_instructions` (tensor-core instructions in
the loop), `bytes_in_flight_per_sm` (tiles in flight x tile bytes x resident
programs; tiles in flight: num_stages where the loop issues async copies, 2 with
PREFETCH or where the loop prefetches the next tile's rows into L2, else 1) and `predicted_hbm_share`: the static model's share of the HBM peak,
min(1, issue bound, latency bound) x the plan's wave fill, where the issue bound is 4
warp-instructions per SM per clock over the instructions per row (times the row's
bytes), and the latency bound Little's law over the bytes in flight (LATENCY_S). An
upper bound from the binary alone: it does not see dependency stalls, bank conflicts
or the reduction. Planned launches also report `runtime_args`, the arguments the launch
passes at run time (parameters Triton does not bind as constexprs), for the traced call
(the packed rows alone) and, as `runtime_args_layer`, for a layer's call (sink rows, the
packed rows, a residual window: `layer_segments`). `--survey` also prints the general
kernel's whole tuner table.

Formats whose keys keep flat exceptions (nuq4, vq*, tr4, tr3) run a pass over each tile's
entries inside the loop, as many steps as the tile's longest row needs: the static count
above takes one step. `--entry-counts FILE` (real rows' counts, `bench/key_entry_counts.py`)
adds `loop_instructions_per_row_at_counts`, the loop with that pass's body taken as often as
those rows' 64-row tiles need on average (`entry_steps_per_tile`), and the static model's
share with that loop (`predicted_hbm_share_at_counts`), for the packed call of each shape:
at the file's head_dim as measured, at a smaller one with each entry kept with
probability head_dim / the file's (outliers are per-channel thresholds at one rate).
`--entries-per-step N` sets that pass's entries of each row per step (an ablation: the
launcher's choice is `planned_decode.kernel_config`'s).

The pre-RoPE layouts (LAYER_FORMATS: KV4 of a channel-scales artifact, KVQuant's NUQ4
and the vq layouts)
are also compiled as a whole-layer call (`call` "layer": full-precision pre-RoPE sink and
residual rows around the packed ones, one launch, as `make demo` decodes Gemma 3): its
spill, registers and resident warps are the kernel's, its instructions per row those of
the packed segment's loop (the loop closest in size to the packed call's). `--md FILE`
writes the table as markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import gpu_decode
import torch

from kvq.runtime.kernels.decode import _attention_triton as kern
from kvq.runtime.kernels.decode import attention as da
from kvq.runtime.kernels.offline.cubin import compile_offline, runtime_arguments
from kvq.runtime.kernels.planning.launch_plan import plan_splits

try:  # the planned path (absent before it existed: then every format takes the survey)
    from kvq.runtime.kernels.decode import planned
    from kvq.runtime.kernels.decode.planned_layouts import planned_unsupported
except ImportError:
    planned = None

SHAPES = {"llama-7b-like": (32, 8, 128), "gemma3-270m": (4, 1, 256)}
FORMATS = ("kv4", "kv4-token", "kv4-pre", "kv8", "fp8", "nuq4", "nuq4-post", "vq3", "vq2", "vq4",
           "vq1", "tr4", "tr3", "tr2")  # fmt: skip
ROWS = 256  # cached rows of the traced call (a multiple of 16, as long contexts are)
BATCH = 16
# pre-RoPE keys: the whole-layer call too
LAYER_FORMATS = ("kv4-pre", "nuq4", "vq3", "vq2", "vq4", "vq1", "tr4", "tr3", "tr2")
SINK_ROWS, RESIDUAL_ROWS = 4, 64  # full-precision rows around the packed ones in that call


def segment(fmt: str, shape: str):
    """A `gpu_decode` segment of `fmt` at `shape` (kv4-pre: KV4 with pre-RoPE keys, the
    layout of a channel-scales artifact; nuq4-post: NUQ4 with its keys post-RoPE, the
    layout the planned path takes until it rotates keys)."""
    gpu_decode.HQ, gpu_decode.HKV, gpu_decode.D = SHAPES[shape]
    base = {"kv4-pre": "kv4", "nuq4-post": "nuq4"}.get(fmt, fmt)
    seg = gpu_decode.packed(base, BATCH, ROWS, "cpu")
    if fmt != base:
        key = dataclasses.replace(seg.key, pre_rope=fmt == "kv4-pre")
        seg = dataclasses.replace(seg, key=key)
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


# --- item-5 targets: the static model of one decode step at batch 16 x 32K ----------------

TARGET_BATCH, TARGET_CONTEXT = 16, 32768
ASM = True  # the planned kernel's decode as compiled for CUDA (planned_decode.ASM)
SMS = 132  # H200
ISSUE_PER_SM_CLOCK = 4  # warp-instructions: four schedulers per SM
CLOCK_HZ = 1.98e9  # H200 boost clock
HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e peak
# loaded HBM latency (Little's law): 20 KB in flight per SM sustains about 60% of the peak
# on 132 SMs, the figure the issue's timing model uses
LATENCY_S = 0.94e-6


def bytes_per_row(seg) -> float:
    """HBM bytes one cached row of one KV head costs: codes, per-row qparams and
    exceptions of key and value (static qparams amortised over the rows)."""
    b, hkv, t = seg.key.data.shape[:3]
    return gpu_decode.nbytes(seg) / (b * hkv * t)


def model(res, block_t: int, num_warps: int, stages: int, row_bytes: float, fill: float):
    """The static model's figures for one compiled configuration (see the module doc)."""
    per_row = res.loop_instructions * num_warps / block_t
    issue_share = SMS * ISSUE_PER_SM_CLOCK * CLOCK_HZ / per_row * row_bytes / HBM_BYTES_PER_S
    in_flight = stages * block_t * row_bytes * res.programs_per_sm
    latency_share = in_flight * SMS / LATENCY_S / HBM_BYTES_PER_S
    share = min(1.0, issue_share, latency_share) * fill
    return {
        "spill_bytes": res.stack_bytes,
        "warps_per_sm": res.warps_per_sm,
        "loop_instructions_per_row": round(per_row, 1),
        "int_to_float_in_loop": res.loop_int_to_float,
        "mma_instructions": res.loop_tensor_core_ops,
        "bytes_in_flight_per_sm": round(in_flight),
        "predicted_hbm_share": round(share, 4),
        "issue_bound_share": round(issue_share, 4),
        "latency_bound_share": round(latency_share, 4),
        "wave_fill": round(fill, 4),
    }


def _stages(res, cfg: dict) -> int:
    """Tiles of codes in flight per program: num_stages where the loop issues async copies
    (the pipeliner staged its loads), 2 with PREFETCH (the next tile's words held in
    registers) or L2 prefetches in the loop (the next tile's rows requested while this one
    decodes, `_splits_triton._prefetch_tile`), else 1 (each load waited out in the
    iteration that issues it)."""
    if res.loop_async_copies:
        return cfg["num_stages"]
    return 2 if cfg.get("PREFETCH") or res.loop_prefetches else 1


def targets(shapes, formats, entry_counts=None) -> list[dict]:
    """Item-5 figures per (format, shape) for the configuration the launcher picks at
    TARGET_BATCH x TARGET_CONTEXT: the planned path's fixed configuration where it takes
    the layout; else the best predicted of the general kernel's autotuner configurations
    (the most its tuner could have picked)."""
    out = []
    for shape in shapes:
        hq, hkv, d = SHAPES[shape]
        for fmt in formats:
            seg = segment(fmt, shape)
            row_bytes = bytes_per_row(seg)
            query = torch.randn(BATCH, hq, 1, d)
            calls = []  # (call, figures, configuration)
            if planned is not None and planned_unsupported(query, [seg], None) is None:
                row, picked, alone = planned_row(query, [seg], hkv, row_bytes,
                                                 entry_counts=entry_counts)  # fmt: skip
                calls.append(("packed", row, picked))
                if fmt in LAYER_FORMATS:
                    segs = layer_segments(seg)
                    calls.append(("layer", *planned_row(query, segs, hkv, row_bytes, alone)[:2]))
            else:
                args, consts = launch(fmt, shape, da.DOT_PRECISION)
                row, picked = None, None
                for cfg in configs_for(consts):
                    opts = {k: v for k, v in cfg.items() if v is not None}
                    res = compile_offline(kern.decode_attention_kernel, args, consts, options=opts)
                    fill = _old_fill(hkv, res.programs_per_sm)
                    cand = model(res, cfg["BLOCK_T"], cfg["num_warps"], _stages(res, cfg),
                                 row_bytes, fill)  # fmt: skip
                    if row is None or cand["predicted_hbm_share"] > row["predicted_hbm_share"]:
                        row, picked = cand, {**cfg, "registers": res.registers}
                calls.append(("packed", row, picked))
            for name, row, picked in calls:
                out.append({"format": fmt, "shape": shape, "call": name, **row, "config": picked})
                print(json.dumps(out[-1]), flush=True)
    return out


def layer_segments(seg) -> list:
    """A layer's decode call around the packed segment `seg`: SINK_ROWS and RESIDUAL_ROWS
    full-precision (fp16) rows before and after it (views of buffers with room for 64
    more rows, as a cache holds them), keys pre-RoPE like `seg`'s, positions one after
    another."""
    from kvq.runtime.kernels.decode.attention import Segment
    from kvq.runtime.packed import PackedRows

    b, hkv, t = seg.key.data.shape[:3]
    d = seg.key.head_dim

    def full(n, start):
        k, v = (PackedRows("full", d, torch.randn(b, hkv, n + 64, d).half()[:, :, :n], pre_rope=pre)
                for pre in (seg.key.pre_rope, False))  # fmt: skip
        return Segment(k, v, torch.arange(start, start + n).expand(b, n))

    main = Segment(seg.key, seg.value, torch.arange(SINK_ROWS, SINK_ROWS + t).expand(b, t))
    return [full(SINK_ROWS, 0), main, full(RESIDUAL_ROWS, SINK_ROWS + t)]


def entry_steps(counts: list[list[int]], block_t: int, per_step: int) -> float:
    """Mean steps of the key-entry pass per tile of block_t rows: ceil(the tile's longest
    row's count / per_step), over every whole tile of each layer's rows."""
    steps = [
        -(-max(c[i : i + block_t]) // per_step)
        for c in counts
        for i in range(0, len(c) - block_t + 1, block_t)
    ]
    return sum(steps) / len(steps)


def counts_for(entry_counts: dict, head_dim: int) -> list[list[int]] | None:
    """The file's counts at `head_dim`: as measured at its own, thinned below it (each
    entry kept with probability head_dim / its head_dim, seeded), None above it."""
    own = entry_counts["head_dim"]
    if head_dim > own:
        return None
    if head_dim == own:
        return entry_counts["counts"]
    g = torch.Generator().manual_seed(0)
    p = head_dim / own
    return [torch.binomial(torch.tensor(c, dtype=torch.float), torch.full((len(c),), p),
                           generator=g).long().tolist() for c in entry_counts["counts"]]  # fmt: skip


def at_counts(res, cfg, counts: list[list[int]], row: dict, row_bytes: float) -> dict:
    """`loop_instructions_per_row_at_counts`, `entry_steps_per_tile` and
    `predicted_hbm_share_at_counts` (the static model's share with that loop: `row`'s
    latency bound and wave fill) of a compile whose main loop holds the key-entry pass
    (`offline.inner_loop`), for rows with these counts."""
    steps = entry_steps(counts, cfg.block_t, cfg.key_entries_per_step)
    inner = sum(res.inner.values())
    per_row = (res.loop_instructions + inner * (steps - 1)) * cfg.num_warps / cfg.block_t
    issue_share = SMS * ISSUE_PER_SM_CLOCK * CLOCK_HZ / per_row * row_bytes / HBM_BYTES_PER_S
    share = min(1.0, issue_share, row["latency_bound_share"]) * row["wave_fill"]
    return {"loop_instructions_per_row_at_counts": round(per_row, 1),
            "entry_steps_per_tile": round(steps, 2),
            "predicted_hbm_share_at_counts": round(share, 4)}  # fmt: skip


def planned_row(query, segs, hkv: int, row_bytes: float, alone=None, entry_counts=None) -> tuple:
    """(figures, configuration, resources) of the planned path's launch
    (`planned_decode`) over `segs`, compiled for sm_90, and its plan at TARGET_BATCH x
    TARGET_CONTEXT with the occupancy that compile achieves. `alone`: the resources of the
    packed segment's call alone; then the loop figures are those of the loop of this
    compile closest to its loop in size (the packed segment's, among one loop per
    segment)."""
    from kvq.runtime.kernels.decode import _splits_triton as splits_kern

    d = query.shape[-1]
    pre = any(s.key.pre_rope for s in segs)
    rope = gpu_decode.rope_tables(sum(s.rows for s in segs), "cpu") if pre else None
    call = planned.planned_call(query, segs, scaling=d**-0.5, softcap=None, half=True,
                                rope=rope)  # fmt: skip
    fn = splits_kern.decode_splits_kernel
    # several splits: partial states in `part` (`out` is the reduction's: None here)
    args = {**call.args, "part": torch.empty(1), "out": None, "splits": 8, "ASM": ASM}
    opts = call.config.options()
    # every parameter by name: runtime ones follow constexprs in the signature
    res = compile_offline(fn, (), args, options=opts)
    compiled = res
    if alone is not None:
        size = alone.loop_instructions
        packed_loop = min(res.loops, key=lambda body: abs(sum(body.values()) - size))
        res = dataclasses.replace(res, loop=packed_loop)
    plan = plan_splits(TARGET_BATCH * hkv, TARGET_CONTEXT, sms=SMS,
                       programs_per_sm=res.programs_per_sm, block_t=call.config.block_t)  # fmt: skip
    row = model(res, call.config.block_t, opts["num_warps"], _stages(res, opts), row_bytes,
                plan.fill)  # fmt: skip
    row["runtime_args"] = runtime_arguments(fn, args)
    counts = None if entry_counts is None else counts_for(entry_counts, d)
    if alone is None and res.inner and counts is not None:
        row.update(at_counts(res, call.config, counts, row, row_bytes))
    if len(segs) == 1:  # the same packed rows in a layer's call: its runtime arguments
        around = layer_segments(segs[0])
        rope = gpu_decode.rope_tables(sum(s.rows for s in around), "cpu") if pre else None
        layer = planned.planned_call(query, around, scaling=d**-0.5, softcap=None, half=True,
                                     rope=rope)  # fmt: skip
        layer_args = {**layer.args, "part": torch.empty(1), "out": None, "splits": 8, "ASM": ASM}
        row["runtime_args_layer"] = runtime_arguments(fn, layer_args)
    picked = {"BLOCK_T": call.config.block_t, **opts, "registers": res.registers,
              "shared_bytes": res.shared_bytes, "loop_instructions": res.loop_instructions,
              "loop_async_copies": res.loop_async_copies, "plan": plan.as_dict()}  # fmt: skip
    if alone is not None:  # every segment's loop, instructions per iteration
        picked["segment_loops"] = [sum(body.values()) for body in compiled.loops]
    return row, picked, compiled


def _old_fill(hkv: int, programs_per_sm: int) -> float:
    """Wave fill of the launcher before its plan: ceil(4 x SMs / programs) splits of 128-row
    multiples, whatever the occupancy."""
    work = TARGET_BATCH * hkv
    tiles = -(-TARGET_CONTEXT // 128)
    splits = max(1, min(tiles, -(-4 * SMS // work)))
    per = -(-math.ceil(TARGET_CONTEXT / splits) // 128) * 128
    programs = work * -(-TARGET_CONTEXT // per)
    slots = SMS * programs_per_sm
    return programs / (-(-programs // slots) * slots)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--dots", default="tf32", choices=da.DOT_MODES)
    ap.add_argument("--json", help="write the item-5 targets per (format, shape) here")
    ap.add_argument("--md", help="write them as a markdown table here")
    ap.add_argument("--entry-counts", type=Path,
                    help="real rows' key-entry counts (bench/key_entry_counts.py --json)")  # fmt: skip
    ap.add_argument("--entries-per-step", type=int,
                    help="ablation: key entries of each row per step of their pass, instead "
                    "of the launcher's (planned_decode.kernel_config)")  # fmt: skip
    ap.add_argument("--survey", action="store_true",
                    help="also compile every autotuner configuration (the table)")  # fmt: skip
    args = ap.parse_args()
    entry_counts = json.loads(args.entry_counts.read_text()) if args.entry_counts else None
    if args.entries_per_step:  # every launch's configuration, pre- and post-RoPE keys
        launcher = planned.kernel_config
        planned.kernel_config = lambda *a, **k: dataclasses.replace(
            launcher(*a, **k), key_entries_per_step=args.entries_per_step)  # fmt: skip
    rows = targets(args.shapes, args.formats, entry_counts)
    survey_rows = survey(args.shapes, args.formats, args.dots) if args.survey else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": "sm_90", "model": {"sms": SMS, "clock_hz": CLOCK_HZ,
                       "hbm_bytes_per_s": HBM_BYTES_PER_S, "latency_s": LATENCY_S,
                       "batch": TARGET_BATCH, "context": TARGET_CONTEXT},
                       "rows": rows, "survey": survey_rows}, f, indent=1)  # fmt: skip
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(rows))


def markdown(rows: list[dict]) -> str:
    """The targets as a markdown table, one line per (shape, format, call)."""
    head = ("| shape | format | call | spill B | registers | warps/SM | instr/row "
            "| instr/row at real counts (steps/tile) | I2F in loop "
            "| MMA | KB in flight/SM | predicted HBM share (at real counts) | path |")  # fmt: skip
    lines = ["# Decode launch at batch 16 x 32K, sm_90 compile (no GPU)", "",
             "`PYTHONPATH=$PWD:$PWD/bench python bench/kernel_resources.py --json F --md F` "
             "(static model in the module doc). call: `packed`, the packed segment alone; "
             "`layer`, the whole-layer call of a pre-RoPE layout (sink + packed + residual "
             "rows; instr/row of its packed loop). nuq4: KVQuant NUQ4 as stored (pre-RoPE "
             "keys, ~1% exceptions, value slots); nuq4-post: the same with post-RoPE keys. "
             "At real counts: with `--entry-counts`, the key-entry pass taken as often as "
             "real rows' tiles need (module doc).",
             "", head, "|" + "---|" * 13]  # fmt: skip
    for r in rows:
        path = "planned" if r["config"].get("plan") else "general"
        real, share = "-", f"{r['predicted_hbm_share']}"
        if "loop_instructions_per_row_at_counts" in r:
            real = f"{r['loop_instructions_per_row_at_counts']} ({r['entry_steps_per_tile']})"
            share += f" ({r['predicted_hbm_share_at_counts']})"
        lines.append(
            f"| {r['shape']} | {r['format']} | {r.get('call', 'packed')} | {r['spill_bytes']} "
            f"| {r['config']['registers']} | {r['warps_per_sm']} "
            f"| {r['loop_instructions_per_row']} | {real} | {r['int_to_float_in_loop']} "
            f"| {r['mma_instructions']} | {r['bytes_in_flight_per_sm'] / 1024:.1f} "
            f"| {share} | {path} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
