"""The decode kernel compiled for sm_90 on this CPU-only machine (kvq.runtime.kernels.offline.cubin).

The kernels run under the interpreter everywhere else in the tests; these compile the real
launches for an H100/H200 with the ptxas Triton ships, and check what only a compile shows:
that dots become tensor-core instructions, and that the register budget of the layouts the
runtime uses keeps enough warps resident without spilling.

Compiling needs a process whose triton was imported without TRITON_INTERPRET=1 (the test
session sets it), so the compiles run in one child process: this file run as a script.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest
import torch

from kvq.runtime.kernels.decode import _attention_triton as kern
from kvq.runtime.kernels.decode.attention import Segment, _fits, autotune_configs, kernel_calls
from kvq.runtime.kernels.offline.cubin import KernelResources, compile_offline
from kvq.runtime.packed import PackedRows
from tests.runtime.kernels.helpers import compile_in_child, resources

# many interpreted Triton launches or every model family: `make test-quick` skips it
pytestmark = pytest.mark.slow


def _half(*shape, lo=0.01, hi=0.05):
    return (torch.rand(*shape) * (hi - lo) + lo).half()


def _codes(b, h, t, nbytes):
    return torch.randint(0, 256, (b, h, t, nbytes), dtype=torch.uint8)


def _int4_segment(b, hkv, t, d, pre_rope):
    """Static per-channel INT4 keys, INT4 values per token in groups of 32: the layout of a
    channel-scales artifact (pre-RoPE keys by default, post-RoPE with --key-stage)."""
    key = PackedRows(
        "affine", d, _codes(b, hkv, t, d // 2), 4,
        scale=_half(hkv, d), offset=-_half(hkv, d, lo=1.0, hi=1.2), pre_rope=pre_rope,
    )  # fmt: skip
    value = PackedRows(
        "affine", d, _codes(b, hkv, t, d // 2), 4,
        scale=_half(b, hkv, t, d // 32), offset=-_half(b, hkv, t, d // 32, lo=1.0, hi=1.2),
    )  # fmt: skip
    return Segment(key, value, torch.arange(t).expand(b, t))


def _nuq4_segment(b, hkv, t, d):
    """KVQuant: codebook keys (pre-RoPE) with 2 exact exceptions per row, codebook values
    per token with 2 exception slots."""
    levels = torch.linspace(-1, 1, 16)
    n = b * hkv * t * 2
    key = PackedRows(
        "lookup", d, _codes(b, hkv, t, d // 2), 4, scale=_half(hkv, d), offset=_half(hkv, d),
        table=levels, sparse_count=torch.full((b, hkv, t), 2, dtype=torch.uint8),
        sparse_index=torch.tensor([3, d - 5], dtype=torch.uint8).repeat(n // 2),
        sparse_value=_half(n), pre_rope=True,
    )  # fmt: skip
    slots = torch.tensor([1, d // 2], dtype=torch.uint8).expand(b, hkv, t, 2).contiguous()
    value = PackedRows(
        "lookup", d, _codes(b, hkv, t, d // 2), 4, scale=_half(b, hkv, t, 1),
        offset=_half(b, hkv, t, 1), table=levels, slot_index=slots,
        slot_value=_half(b, hkv, t, 2),
    )  # fmt: skip
    return Segment(key, value, torch.arange(t).expand(b, t))


def _resources(seg, hq, dots="tf32", **options):
    b, d, t = seg.key.data.shape[0], seg.key.head_dim, seg.key.rows
    query = torch.randn(b, hq, 1, d)
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)
    ang = torch.arange(t).float()[:, None] * inv
    calls, _ = kernel_calls(query, [seg], scaling=d**-0.5, rope=(ang.cos(), ang.sin()), dots=dots)
    ((_, args, consts),) = calls
    opts = {"num_warps": 8, "num_stages": 1, **options}
    return compile_offline(kern.decode_attention_kernel, args, consts, options=opts)


CASES = {  # name -> (segment, query heads)
    "int4-pre-d128": lambda: (_int4_segment(16, 2, 256, 128, pre_rope=True), 8),
    "int4-post-d128": lambda: (_int4_segment(16, 2, 256, 128, pre_rope=False), 8),
    "int4-pre-gemma": lambda: (_int4_segment(16, 1, 256, 256, pre_rope=True), 4),
    "int4-post-gemma": lambda: (_int4_segment(16, 1, 256, 256, pre_rope=False), 4),
    "nuq4-d128": lambda: (_nuq4_segment(16, 2, 256, 128), 8),
}
JOBS = [  # (case, dots, launch options)
    ("int4-pre-d128", "tf32", {"BLOCK_T": 16}),
    ("int4-pre-d128", "fp16", {"BLOCK_T": 16}),
    ("int4-pre-d128", "ieee", {"BLOCK_T": 16}),
    ("int4-pre-gemma", "tf32", {"BLOCK_T": 16}),
    ("int4-pre-gemma", "tf32", {"BLOCK_T": 16, "num_warps": 16}),
    ("int4-post-gemma", "tf32", {"BLOCK_T": 16}),
    ("nuq4-d128", "tf32", {"BLOCK_T": 16}),
    ("int4-post-d128", "tf32", {"BLOCK_T": 32}),
    ("int4-post-d128", "tf32", {"BLOCK_T": 32, "PREFETCH": True}),
]


def _compile_jobs(jobs) -> list[dict]:
    torch.manual_seed(0)
    out = []
    for case, dots, options in jobs:
        seg, hq = CASES[case]()
        res = _resources(seg, hq, dots, **options)
        out.append({**res.as_dict(), "sass": dict(res.sass)})
    return out


@pytest.fixture(scope="module")
def compiled() -> dict[tuple, KernelResources]:
    """Every job of JOBS compiled in one child process without the interpreter."""
    rows = compile_in_child(__file__, JOBS)
    return {
        (case, dots, opts.get("num_warps", 8), opts.get("PREFETCH", False)): resources(r)
        for (case, dots, opts), r in zip(JOBS, rows, strict=True)
    }


def test_resident_programs_follow_the_register_shared_memory_and_warp_limits():
    def res(warps, regs, smem):
        return KernelResources(warps, regs, 0, smem, Counter({"HMMA": 3, "FFMA": 5}))

    assert res(8, 128, 16 * 1024).programs_per_sm == 2  # 65536 / (128 * 256)
    assert res(8, 129, 16 * 1024).programs_per_sm == 1  # 136 after rounding: 34816 each
    assert res(4, 96, 16 * 1024).warps_per_sm == 20  # 5 programs of 4 warps
    assert res(4, 32, 100 * 1024).programs_per_sm == 2  # shared memory binds first
    assert res(4, 16, 1024).programs_per_sm == 16  # 64 warp slots
    r = res(8, 64, 0)
    assert r.tensor_core_ops == 3 and r.as_dict()["instructions"] == 8


def test_the_tuner_times_the_configurations_checked_here():
    """Row tiles of 16 at both head dims, 16-warp programs only at head_dim 256, and no
    value tile beyond 64 x 128 (the configurations below are the tuner's own)."""

    def kept(d):
        return {
            (c.kwargs["BLOCK_T"], c.num_warps) for c in _fits(autotune_configs(), {}, BLOCK_D=d)
        }

    assert kept(128) == {(t, w) for t in (16, 32, 64) for w in (4, 8)}
    assert kept(256) == {(t, w) for t in (16, 32) for w in (4, 8, 16)}
    # codes that load as words: PREFETCH stands in for 2 stages; otherwise never PREFETCH
    for words in (False, True):
        variants = {
            (c.num_stages, c.kwargs["PREFETCH"])
            for c in _fits(autotune_configs(), {}, BLOCK_D=128, K_WORDS=words, V_WORDS=False)
        }
        assert variants == ({(1, False), (1, True)} if words else {(1, False), (2, False)})


@pytest.mark.parametrize("dots", ["tf32", "fp16", "ieee"])
def test_dots_become_tensor_core_instructions_except_exact_fp32(compiled, dots):
    """tf32 and fp16 dots lower to HMMA; exact fp32 ("ieee", the CUDA parity mode) to FMAs."""
    res = compiled["int4-pre-d128", dots, 8, False]
    if dots == "ieee":
        assert res.tensor_core_ops == 0 and res.sass["FFMA"] > 0
    else:
        assert res.tensor_core_ops > 0


def test_gemma_shapes_compile_without_spilling_and_folded_keys_keep_16_warps(compiled):
    """Gemma 3 270M (4 query heads, 1 KV head, head_dim 256), row tiles of 16 and 8 warps:
    the channel-scales layout compiles without spilling with pre-RoPE keys, and with
    post-RoPE keys, whose static qparams fold into the query, fits 2 programs (16 warps)
    per SM; they needed 136 registers (1 program) before the fold."""
    pre = compiled["int4-pre-gemma", "tf32", 8, False]
    post = compiled["int4-post-gemma", "tf32", 8, False]
    assert pre.stack_bytes == 0 and post.stack_bytes == 0
    assert post.warps_per_sm >= 16, post.as_dict()


def test_pre_rope_static_keys_reread_their_qparams_and_keep_16_warps(compiled):
    """Pre-RoPE keys cannot fold their static qparams (RoPE mixes channels of different
    scales); held in registers across the loop they cost about 35 registers per thread and
    half the resident warps at head_dim 128, so the kernel re-reads them (L1) per tile."""
    res = compiled["int4-pre-d128", "tf32", 8, False]
    assert res.warps_per_sm >= 16 and res.stack_bytes == 0, res.as_dict()


def test_gemma_pre_rope_keys_keep_16_warps_with_16_warp_programs(compiled):
    """At head_dim 256 a program of 8 warps needs about 140 registers per thread for
    pre-RoPE keys (8 warps per SM); the 16-warp programs the tuner may pick there spread
    the tiles thinner and keep 16 warps resident without spilling."""
    res = compiled["int4-pre-gemma", "tf32", 16, False]
    assert res.warps_per_sm >= 16 and res.stack_bytes == 0, res.as_dict()


def test_nuq_with_exceptions_keeps_16_warps_at_row_tiles_of_16(compiled):
    """KVQuant's layout (lookups, key exceptions, value slots) fits one program of 8 warps
    per SM and spills hundreds of bytes per thread at row tiles of 32 and more; at the tiles
    of 16 the tuner may now pick, at least 16 warps stay resident and at most a few words
    spill."""
    res = compiled["nuq4-d128", "tf32", 8, False]
    assert res.warps_per_sm >= 16 and res.stack_bytes <= 16, res.as_dict()


def test_prefetched_code_words_keep_16_warps_without_spilling(compiled):
    """PREFETCH holds the next tile's code words and value qparams in registers across an
    iteration. At a configuration the tuner may pick (KV4, head_dim 128, 32-row tiles, 8
    warps) that costs about 17 registers per thread, within the budget of 16 resident
    warps, and loads the same codes with fewer, wider instructions than the byte loads."""
    plain = compiled["int4-post-d128", "tf32", 8, False]
    ahead = compiled["int4-post-d128", "tf32", 8, True]
    assert ahead.stack_bytes == 0 and ahead.warps_per_sm >= 16, ahead.as_dict()
    assert ahead.registers > plain.registers  # the words held across the iteration
    assert ahead.sass["LDG"] < plain.sass["LDG"], (ahead.sass["LDG"], plain.sass["LDG"])


if __name__ == "__main__":  # the child process of `compiled`
    print(json.dumps(_compile_jobs(json.loads(sys.argv[1]))))
