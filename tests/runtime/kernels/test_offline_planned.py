"""The planned decode kernel compiled for sm_90 on this CPU-only machine: the SASS targets
of the tile loop (issue 18, item 5) for KV4 at the configuration the launcher picks.

Like tests/runtime/kernels/test_offline.py, the compiles run in one child process without
TRITON_INTERPRET (this file run as a script). Per cached row of one KV head, the loop
issues at most ~55 warp-instructions for Llama-like heads (8 x 128), converts no integer
to float, multiplies on tensor cores, spills nothing and keeps >= 20 KB of codes in flight
per SM.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest
import torch

from kvq.runtime.codecs.fp8 import fp8_table
from kvq.runtime.kernels.decode.attention import Segment
from kvq.runtime.kernels.offline.cubin import PREFETCH_OP, KernelResources, inner_loop, main_loop
from kvq.runtime.kernels.planning.launch_plan import plan_splits
from kvq.runtime.packed import PackedRows
from tests.runtime.kernels.helpers import compile_in_child, resources
from tests.runtime.kernels.test_decode_attention import _rope
from tests.runtime.kernels.test_offline import _int4_segment

# many interpreted Triton launches or every model family: `make test-quick` skips it
pytestmark = pytest.mark.slow

CASES = {  # name -> (batch, KV heads, head_dim, query heads)
    "kv4-llama": (16, 8, 128, 32),
    "kv4-gemma": (16, 1, 256, 4),
    "fp8-llama": (16, 8, 128, 32),
    "kv4-pre-llama": (16, 8, 128, 32),  # keys stored before RoPE (channel-scales layout)
    "kv4-pre-gemma": (16, 1, 256, 4),
    "nuq4-dense-llama": (16, 8, 128, 32),
    "nuq4-llama": (16, 8, 128, 32),
    # KVQuant's stored layout: NUQ4 keys before RoPE with their exceptions
    "nuq4-pre-llama": (16, 8, 128, 32),
    "nuq4-pre-gemma": (16, 1, 256, 4),
    "nuq4-pre-gemma-layer": (16, 1, 256, 4),  # its whole-layer call (it spilled 8 B)
    "nuq4-dense-pre-gemma": (16, 1, 256, 4),  # no exceptions (two stages spilled 16 B)
    # Gemma 3's whole-layer call (`make demo`): pre-RoPE sink rows, KV4, residual rows
    "kv4-pre-gemma-layer": (16, 1, 256, 4),
    # vector codebooks as `kvq calibrate auto` stores them (pre-RoPE keys over RoPE pairs,
    # KVQuant's normalisers and exceptions): --bits 3 (3 x 2) and --bits 2 (2 x 4)
    "vq3-pre-llama": (16, 8, 128, 32),
    "vq2-pre-llama": (16, 8, 128, 32),
    "vq2-pre-gemma": (16, 1, 256, 4),
    "vq3-dense-pre-gemma": (16, 1, 256, 4),  # without exceptions (`kvq calibrate vq --outliers 0`)
    # trellis codes as `kvq calibrate auto` stores them: 4-bit digits with key entries and
    # value slots, 3-bit with key entries (3-byte units), 2-bit without exceptions
    "tr4-pre-llama": (16, 8, 128, 32),
    "tr4-pre-gemma": (16, 1, 256, 4),
    "tr3-pre-llama": (16, 8, 128, 32),
    "tr2-pre-llama": (16, 8, 128, 32),
}
# the NUQ4 keys' exceptions run a loop over each row's entries inside the tile loop, which
# Triton's pipeliner does not stage: their codes load in the iteration that uses them
# (vq without exceptions over 2-D groups: one stage, staged codes spilled, `kernel_config`)
# (pre-RoPE NUQ4 at head_dim 256 without entries: one stage, two spilled, `kernel_config`)
UNSTAGED = ("nuq4-llama", "nuq4-pre-llama", "nuq4-pre-gemma", "nuq4-pre-gemma-layer",
            "nuq4-dense-pre-gemma", "vq3-pre-llama", "vq2-pre-llama", "vq2-pre-gemma",
            "vq3-dense-pre-gemma", "tr4-pre-llama", "tr4-pre-gemma", "tr3-pre-llama")  # fmt: skip
# the pre-RoPE layouts with key entries (unstaged, 8 resident warps) prefetch the next
# tile's rows into L2 (`kernel_config`'s prefetch): two tiles in flight, pre-RoPE NUQ4 36.3
# KB per SM (Llama-like), 34.5 (Gemma 3; 18.1 and 17.3 unprefetched); below the 20 KB per
# SM: Gemma 3's NUQ4 without exceptions (one stage, no entries: 16.2 KB), vq's 2-bit rows
# (18.5 KB per SM for Gemma 3's 2 x 4, 20.2 Llama-like) and 3-bit ones without entries
NUQ_IN_FLIGHT_KB = {"nuq4-dense-pre-gemma": 16}
VQ_IN_FLIGHT_KB = {"vq2-pre-llama": 19.5, "vq2-pre-gemma": 18, "vq3-dense-pre-gemma": 10}
# 2-bit trellis rows without exceptions: two staged tiles of 64 x 68 B per program
TRELLIS_IN_FLIGHT_KB = {"tr2-pre-llama": 17}
PREFETCHED = ("nuq4-pre-llama", "nuq4-pre-gemma", "nuq4-pre-gemma-layer", "vq3-pre-llama",
              "vq2-pre-llama", "vq2-pre-gemma", "tr4-pre-llama", "tr4-pre-gemma",
              "tr3-pre-llama")  # fmt: skip


def _fp8_segment(b, hkv, t, d):
    """E4M3 K and V with a static scale per KV head (kv-scales, the engines' layout)."""
    table = fp8_table("e4m3")  # the codecs' table: the planned path knows its format
    codes = (torch.randint(0, 256, (2, b, hkv, t, d), dtype=torch.uint8) & 0x7E).unbind()
    scale = torch.rand(hkv) * 0.01 + 0.01
    key, value = (PackedRows("lookup", d, c, 8, scale=scale, table=table) for c in codes)
    return Segment(key, value)


def _nuq4_segment(b, hkv, t, d, exceptions: bool, pre_rope: bool = False):
    """KVQuant's NUQ4 layout with random codes, keys post-RoPE (or pre-RoPE, as KVQuant
    stores them); with exceptions as bench/gpu_decode.py lays them out: 2 flat key entries
    and 2 value slots per row."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (2, b, hkv, t, d // 2), generator=g, dtype=torch.uint8)
    table = torch.linspace(-1, 1, 16)
    key = dict(scale=torch.rand(hkv, d) + 0.5, offset=torch.rand(hkv, d))
    value = dict(
        scale=torch.rand(b, hkv, t, 1).half() + 0.5, offset=torch.rand(b, hkv, t, 1).half()
    )
    if exceptions:
        n = b * hkv * t * 2
        key |= dict(sparse_count=torch.full((b, hkv, t), 2, dtype=torch.uint8),
                    sparse_index=torch.randint(0, d, (n,), generator=g).to(torch.uint8),
                    sparse_value=torch.randn(n).half())  # fmt: skip
        slots = torch.stack([torch.zeros(b, hkv, t), torch.full((b, hkv, t), d // 2)], -1)
        value |= dict(slot_index=slots.to(torch.uint8), slot_value=torch.randn(b, hkv, t, 2).half())
    return Segment(PackedRows("lookup", d, codes[0], 4, table=table, pre_rope=pre_rope, **key),
                   PackedRows("lookup", d, codes[1], 4, table=table, **value),
                   torch.arange(t).expand(b, t))  # fmt: skip


def _vq_segment(b, hkv, t, d, bits: int, m: int, exceptions: bool = True):
    """What `kvq calibrate auto` stores: vector codes (random) over the calibrator's groups,
    a random fp16 codebook, keys before RoPE with the static normaliser and 2 flat
    exceptions per row, values with their row normaliser and 2 slots."""
    from kvq.quant import packing, vq

    g = torch.Generator().manual_seed(0)
    n_bytes = packing.packed_len(d, bits)
    codes = torch.randint(0, 256, (2, b, hkv, t, n_bytes), generator=g, dtype=torch.uint8)
    table = (torch.rand(2 ** (bits * m), m, generator=g) * 2 - 1).half()
    n = b * hkv * t * 2
    key = dict(scale=torch.rand(hkv, d) + 0.5, offset=torch.rand(hkv, d))
    value = dict(
        scale=torch.rand(b, hkv, t, 1).half() + 0.5, offset=torch.rand(b, hkv, t, 1).half()
    )
    if exceptions:
        key |= dict(sparse_count=torch.full((b, hkv, t), 2, dtype=torch.uint8),
                    sparse_index=torch.randint(0, d, (n,), generator=g).to(torch.uint8),
                    sparse_value=torch.randn(n).half())  # fmt: skip
        slots = torch.stack([torch.zeros(b, hkv, t), torch.full((b, hkv, t), d // 2)], -1)
        value |= dict(slot_index=slots.to(torch.uint8), slot_value=torch.randn(b, hkv, t, 2).half())
    return Segment(
        PackedRows("vector", d, codes[0], bits, table=table,
                   groups=vq.channel_groups(d, m, pairs=True), pre_rope=True, **key),
        PackedRows("vector", d, codes[1], bits, table=table,
                   groups=vq.channel_groups(d, m, pairs=False), **value),
        torch.arange(t).expand(b, t),
    )  # fmt: skip


def _trellis_segment(b, hkv, t, d, bits: int):
    """What `kvq calibrate auto` stores at 4, 3 and 2 bits: trellis codes (random) with
    12-bit states, a random fp16 table, keys before RoPE with the static normaliser, values
    with their row normaliser; 2 flat key exceptions per row at 3 and 4 bits, 1 value slot
    at 4."""
    from kvq.quant import packing

    g = torch.Generator().manual_seed(0)
    n_bytes = packing.packed_len(d, bits)
    codes = torch.randint(0, 256, (2, b, hkv, t, n_bytes), generator=g, dtype=torch.uint8)
    table = (torch.rand(4096, generator=g) * 2 - 1).half()
    key = dict(scale=torch.rand(hkv, d) + 0.5, offset=torch.rand(hkv, d))
    value = dict(
        scale=torch.rand(b, hkv, t, 1).half() + 0.5, offset=torch.rand(b, hkv, t, 1).half()
    )
    if bits >= 3:
        n = b * hkv * t * 2
        key |= dict(sparse_count=torch.full((b, hkv, t), 2, dtype=torch.uint8),
                    sparse_index=torch.randint(0, d, (n,), generator=g).to(torch.uint8),
                    sparse_value=torch.randn(n).half())  # fmt: skip
    if bits == 4:
        value |= dict(slot_index=torch.randint(0, d, (b, hkv, t, 1), generator=g).to(torch.uint8),
                      slot_value=torch.randn(b, hkv, t, 1).half())  # fmt: skip
    return Segment(
        PackedRows("trellis", d, codes[0], bits, table=table, window=12, pre_rope=True, **key),
        PackedRows("trellis", d, codes[1], bits, table=table, window=12, **value),
        torch.arange(t).expand(b, t),
    )


def _row_bytes(seg: Segment) -> float:
    """Bytes per cached row of one KV head: per-row tensors and flat entries of K and V."""
    b, hkv, t = seg.key.data.shape[:3]
    total = 0
    for p in (seg.key, seg.value):
        for name in ("data", "scale", "offset", "slot_index", "slot_value", "sparse_count",
                     "sparse_index", "sparse_value"):  # fmt: skip
            x = getattr(p, name)
            per_row = name.startswith("sparse_") or (x is not None and x.dim() == 4)
            if x is not None and per_row:
                total += x.numel() * x.element_size()
    return total / (b * hkv * t)


def _layer(main: Segment, sink: int = 4, residual: int = 64) -> list[Segment]:
    """A layer's decode call around `main`: full-precision (fp16) sink and residual rows
    (views of buffers with room for 64 more rows, as a cache holds them; pre-RoPE keys
    with positions after one another where main's are)."""
    b, hkv, t, d = *main.key.data.shape[:3], main.key.head_dim
    pre = main.key.pre_rope

    def full(n, start):
        buf = torch.randn(2, b, hkv, n + 64, d).half()[:, :, :, :n]
        pos = torch.arange(start, start + n).expand(b, n) if pre else None
        return Segment(
            PackedRows("full", d, buf[0], pre_rope=pre), PackedRows("full", d, buf[1]), pos
        )

    if pre:
        main = Segment(main.key, main.value, main.positions + sink)
    return [full(sink, 0), main, full(residual, sink + t)]


def _compile(case: str) -> dict:
    from kvq.runtime.kernels.decode import _splits_triton as kern
    from kvq.runtime.kernels.decode import planned as planned_decode
    from kvq.runtime.kernels.offline.cubin import compile_offline, runtime_arguments

    b, hkv, d, hq = CASES[case]
    if case.startswith("fp8"):
        seg = _fp8_segment(b, hkv, 256, d)
        row_bytes = 2 * d  # K and V codes
    elif case.startswith("tr"):
        seg = _trellis_segment(b, hkv, 256, d, int(case[2]))
        row_bytes = _row_bytes(seg)
    elif case.startswith("vq"):
        bits = int(case[2])
        seg = _vq_segment(b, hkv, 256, d, bits, 4 if bits == 2 else 2, "dense" not in case)
        row_bytes = _row_bytes(seg)
    elif case.startswith("nuq4"):
        seg = _nuq4_segment(b, hkv, 256, d, exceptions="dense" not in case,
                            pre_rope="-pre-" in case)  # fmt: skip
        row_bytes = _row_bytes(seg)
    else:
        seg = _int4_segment(b, hkv, 256, d, pre_rope="-pre-" in case)
        # raw bytes per cached row of one KV head: K and V codes, V group scale and offset
        row_bytes = d + 2 * 2 * (d // 32)
    query = torch.randn(b, hq, 1, d)
    rope = _rope(d, 512) if seg.key.pre_rope else None
    segs = _layer(seg) if case.endswith("-layer") else [seg]
    call = planned_decode.planned_call(query, segs, scaling=d**-0.5, softcap=None, half=True,
                                       rope=rope)  # fmt: skip
    fn = kern.decode_splits_kernel
    # several splits: partial states in `part` (`out` is the reduction's)
    args = {**call.args, "part": torch.empty(1), "out": None, "splits": 8}
    args["ASM"] = planned_decode.ASM  # as compiled for CUDA
    # every parameter by name: runtime ones follow constexprs in the signature
    res = compile_offline(fn, (), args, options=call.config.options())
    layer = planned_decode.planned_call(query, _layer(seg), scaling=d**-0.5, softcap=None,
                                        half=True, rope=rope)  # fmt: skip
    loop = res.loop
    # a layer call's packed loop: the one prefetching its next tile where one does (Gemma 3's
    # NUQ4 values as the A operand take a warpgroup MMA, fewer tensor-core instructions
    # than the residual rows' loop, `main_loop`'s pick)
    fetching = [body for body in res.loops if body[PREFETCH_OP]]
    if case.endswith("-layer") and fetching:
        loop = max(fetching, key=lambda body: sum(body.values()))
    return {
        **res.as_dict(),
        "runtime_args_layer": runtime_arguments(
            fn, {**layer.args, "part": torch.empty(1), "splits": 8}
        ),  # fmt: skip
        "sass": dict(res.sass),
        "loop": dict(loop),
        "block_t": call.config.block_t,
        "num_stages": call.config.num_stages,
        "row_bytes": row_bytes,
    }


@pytest.fixture(scope="module")
def compiled() -> dict[str, tuple[KernelResources, dict]]:
    rows = compile_in_child(__file__, list(CASES))
    return {case: (resources(r), r) for case, r in zip(CASES, rows, strict=True)}


def _per_row(res: KernelResources, r: dict) -> float:
    return res.loop_instructions * res.num_warps / r["block_t"]


def _assert_loop(compiled, case: str, per_row: float, warps_per_sm: int) -> None:
    """`case`'s tile loop issues at most `per_row` warp-instructions per cached row of one
    KV head, at `warps_per_sm` resident warps or more."""
    res, r = compiled[case]
    assert _per_row(res, r) <= per_row, (case, _per_row(res, r), res.loop.most_common(12))
    assert res.warps_per_sm >= warps_per_sm, (case, res.as_dict())


# spilled outside every loop (bytes): Gemma 3's NUQ4 whole-layer call (sink, packed and
# residual loops in one kernel, at the 255-register cap) keeps a few values in local
# memory across its loops, a store before and a load after per program; the loops
# themselves touch none. Its packed call alone spills nothing since the key entries' pass
# takes 4 of each row a step (it spilled 8 B taking one; the entries before the dense codes
# moved 16 B there instead)
OUTSIDE_LOOP_SPILL = {"nuq4-pre-gemma-layer": 16}


@pytest.mark.parametrize("case", list(CASES))
def test_tile_loop_has_no_int_to_float_no_spill_and_tensor_cores(compiled, case):
    res, _ = compiled[case]
    assert res.stack_bytes <= OUTSIDE_LOOP_SPILL.get(case, 0), res.as_dict()
    assert res.loop["LDL"] == res.loop["STL"] == 0, res.loop  # no local memory in the loop
    assert res.loop_int_to_float == 0, res.loop
    assert res.loop_tensor_core_ops > 0, res.loop
    if case not in UNSTAGED:
        assert res.loop_async_copies > 0, res.loop  # the raw codes are staged by cp.async
    if case in PREFETCHED:  # the next tile's rows asked of L2 while this one decodes
        assert res.loop_prefetches > 0, res.loop


@pytest.mark.parametrize("case", list(CASES))
def test_enough_bytes_in_flight_per_sm(compiled, case):
    """stages x tile bytes x resident programs >= 20 KB: the loads that 60% of the HBM peak
    needs outstanding per SM at H200 latency (tiles in flight: the stages of a staged loop,
    two where the loop prefetches the next tile into L2, else one)."""
    res, r = compiled[case]
    stages = r["num_stages"] if case not in UNSTAGED else 2 if res.loop_prefetches else 1
    in_flight = stages * r["block_t"] * r["row_bytes"] * res.programs_per_sm
    below = NUQ_IN_FLIGHT_KB | VQ_IN_FLIGHT_KB | TRELLIS_IN_FLIGHT_KB
    want = int(below[case] * 1024) if case in below else 20 * 1024
    assert in_flight >= want, (in_flight, res.as_dict())


def test_llama_like_kv4_loop_within_55_instructions_per_row(compiled):
    _assert_loop(compiled, "kv4-llama", per_row=55, warps_per_sm=16)


def test_llama_like_fp8_loop_within_55_instructions_per_row(compiled):
    """E4M3 codes decode from their bits (no table, no conversion): as cheap per row as KV8
    (the general kernel's table lookups: 92 per row)."""
    _assert_loop(compiled, "fp8-llama", per_row=55, warps_per_sm=12)


def test_llama_like_nuq4_loop_per_row(compiled):
    """KVQuant's NUQ4 (post-RoPE keys): key levels from a table of level pairs in shared
    memory (one gather per code byte), values with slots by PRMT from a table held in
    registers, the values the value dot's A operand, 16 warps per SM. Codes alone (values
    from the pair table too, in channel order): 32 per row (34 in planes); with the
    bench's exceptions (2 key entries, 2 value slots per row, 1.6% of the channels), 55
    (69 with PRMT keys and P as the A operand): the key entries' score corrections
    (gathers of the query, added through an MMA) and the slots patched into the
    lookup."""
    _assert_loop(compiled, "nuq4-dense-llama", per_row=34, warps_per_sm=16)
    _assert_loop(compiled, "nuq4-llama", per_row=58, warps_per_sm=16)


def test_pre_rope_nuq4_loops_per_row(compiled):
    """KVQuant's stored layout (NUQ4 keys before RoPE, their exceptions corrected rotated,
    value slots): levels from the byte-pair table (one gather per tile) x per-channel scale
    + centre, rotated in channel order in the loop (the query rotated per tile by one table
    row), the next tile prefetched into L2, the values from the pair table too, their slots
    redirected in its gather. Llama-like 65 per row at 8 warps per SM, Gemma 3 (8 warps per
    program) 130, nothing spilled in the loop; Gemma 3's whole-layer call keeps the packed
    loop within 5%. Counted with one step of the key entries' pass, which takes 2 entries
    of each row a step at 4 warps and 4 at 8 (`planned_decode._per_step`). Taking one a
    step counted 62 and 124 (then: PRMT values 66 and 140, PRMT keys in planes 79 and 162,
    the general kernel 252 and 426), but real rows need about three times the steps of it
    (bench/kernel_resources.py --entry-counts)."""
    _assert_loop(compiled, "nuq4-pre-llama", per_row=65.5, warps_per_sm=8)
    _assert_loop(compiled, "nuq4-pre-gemma", per_row=131, warps_per_sm=8)
    res, r = compiled["nuq4-pre-gemma"]
    layer, rl = compiled["nuq4-pre-gemma-layer"]
    assert layer.stack_bytes <= OUTSIDE_LOOP_SPILL["nuq4-pre-gemma-layer"], layer.as_dict()
    assert _per_row(layer, rl) <= 1.05 * _per_row(res, r), (_per_row(layer, rl), _per_row(res, r))


def test_vq_loops_per_row(compiled):
    """Vector codebooks as `kvq calibrate auto` stores them, with the bench's exceptions:
    each group's index read from the staged code bytes, its centroid gathered from the
    codebook (L1), normalised and rotated as NUQ4's levels. Llama-like 3 x 2: 134 per row
    at 8 warps per SM (the general kernel: 295 with a 176 B spill); 2 x 4, its value slots
    patched into the centroid words: 95 (255, 104 B); Gemma 3's 2 x 4: 235 at 8 warps
    per program (428, 24 B spill). NUQ4 (a PRMT lookup): 79 and 162."""
    _assert_loop(compiled, "vq3-pre-llama", per_row=160, warps_per_sm=8)
    _assert_loop(compiled, "vq2-pre-llama", per_row=115, warps_per_sm=8)
    _assert_loop(compiled, "vq2-pre-gemma", per_row=290, warps_per_sm=8)


def test_trellis_loops_per_row(compiled):
    """Trellis codes as `kvq calibrate auto` stores them: each channel's state cut from its
    unit and the one before it (one 64-bit funnel; the units loaded in the layout of
    their broadcast over the unit's digits: 130 -> 100 per row where they went through
    shared memory), its level gathered from the table in shared memory, normalised and
    rotated as vq's coordinates. 4-bit digits with key entries and value slots:
    Llama-like 100 per row at 8 warps per SM (the general kernel: 351), Gemma 3 221
    (681); 3-bit digits (3-byte units) with key entries 101 (564 and a 176 B spill);
    2-bit digits: 70 (568 and 1184 B)."""
    _assert_loop(compiled, "tr4-pre-llama", per_row=105, warps_per_sm=8)
    _assert_loop(compiled, "tr4-pre-gemma", per_row=230, warps_per_sm=8)
    _assert_loop(compiled, "tr3-pre-llama", per_row=105, warps_per_sm=8)
    _assert_loop(compiled, "tr2-pre-llama", per_row=75, warps_per_sm=8)


def test_gemma_pre_rope_layer_call_keeps_the_packed_loop(compiled):
    """The whole-layer call (pre-RoPE sink and residual rows around KV4) compiles without
    spilling (it spilled 472 B) and its packed loop (the one with the most MMAs) issues what
    the packed segment alone does, within 5%."""
    res, r = compiled["kv4-pre-gemma-layer"]
    alone, ra = compiled["kv4-pre-gemma"]
    assert res.stack_bytes == 0, res.as_dict()
    assert _per_row(res, r) <= 1.05 * _per_row(alone, ra), (_per_row(res, r), _per_row(alone, ra))


def test_gemma_kv4_loop_per_row(compiled):
    """Gemma 3's rows are 256 channels, twice the bytes of a Llama-like row; with values
    read as words its loop issues 56 per row (74 with byte tiles), at 12 warps per SM."""
    _assert_loop(compiled, "kv4-gemma", per_row=58, warps_per_sm=12)


def test_pre_rope_kv4_loops_per_row(compiled):
    """Keys stored before RoPE rotate in the loop (angle addition: a unit-table tile and the
    query rotated once per tile) and dequantize there (their static scales no longer fold
    into the query): Llama-like 47 per row (the general kernel: 124), Gemma 3 85 (231),
    at 8 warps per SM (184 and 255 registers)."""
    _assert_loop(compiled, "kv4-pre-llama", per_row=55, warps_per_sm=8)
    _assert_loop(compiled, "kv4-pre-gemma", per_row=95, warps_per_sm=8)


def test_a_layer_call_binds_few_runtime_arguments(compiled):
    """A layer's call (sink rows, packed rows, residual window) passes at most 25 arguments
    at run time for KV4 and fp8 (of 117 parameters: strides the layout fixes, absent
    segments and features are None, which Triton binds as constexprs), at most 32 with
    pre-RoPE keys or NUQ exceptions (positions, tables, exception arrays), at most 44 with
    both (KVQuant's layout: positions and two unit tables, NUQ tables and exceptions; vq:
    the same with codebooks; trellis codes: with their tables)."""
    for case, (_, r) in compiled.items():
        limit = 25 if case in ("kv4-llama", "kv4-gemma", "fp8-llama") else 32
        limit = 44 if case.startswith(("nuq4-pre", "nuq4-dense-pre", "vq", "tr")) else limit
        assert r["runtime_args_layer"] <= limit, (case, r["runtime_args_layer"])


def test_plan_at_the_compiled_occupancy_fills_the_waves(compiled):
    for case, (batch, hkv, _, _) in CASES.items():
        res, r = compiled[case]
        plan = plan_splits(batch * hkv, 32768, sms=132, programs_per_sm=res.programs_per_sm,
                           block_t=r["block_t"])  # fmt: skip
        assert plan.fill >= 0.9, plan.as_dict()


def test_main_loop_reads_the_backward_branch_with_the_mma():
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0020*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0030*/                   I2FP.F32.U32 R3, R2 ;
        /*0040*/               @P0 BRA 0x10 ;
        /*0050*/                   FADD R5, R5, R6 ;
        /*0060*/              @!P1 BRA 0x50 ;
        /*0070*/                   EXIT ;
    """
    loop = main_loop(sass)
    assert loop == Counter({"LDG": 1, "HMMA": 1, "I2FP": 1, "BRA": 1})
    assert inner_loop(sass) == Counter()  # the other loop lies after it, not inside


def test_inner_loop_is_the_largest_loop_inside_the_main_one():
    """The key entries' pass: a loop inside the tile loop, counted once in its body; a loop
    that only overlaps the main one (a divergent shuffle's out-of-line block branching
    back into it) is not inside it."""
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0020*/                   LDG.E.U8 R3, desc[UR4][R6.64] ;
        /*0030*/                   FFMA R4, R3, R2, R4 ;
        /*0040*/              @!P2 BRA 0x20 ;
        /*0050*/                   SHFL.BFLY PT, R5, R4, 0x1, 0x1f ;
        /*0060*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0070*/               @P0 BRA 0x10 ;
        /*0080*/                   EXIT ;
        /*0090*/                   WARPSYNC.ALL ;
        /*00a0*/                   BRA 0x50 ;
    """
    assert main_loop(sass)["HMMA"] == 1
    assert inner_loop(sass) == Counter({"LDG": 1, "FFMA": 1, "BRA": 1})


if __name__ == "__main__":  # the child process of `compiled`
    print(json.dumps([_compile(c) for c in json.loads(sys.argv[1])]))
