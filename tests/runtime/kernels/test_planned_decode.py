"""The planned decode path (kvq.runtime.kernels.decode.planned): every segment of a call in
one launch, split by the launch plan, plus at most one reduction; parity with the
reference under the interpreter, and what one call costs the host (launches, syncs,
allocations) under a torch dispatch counter."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs import make_codec
from kvq.runtime.kernels.decode import attention, planned_layouts
from kvq.runtime.kernels.decode import planned as planned_decode
from kvq.runtime.kernels.decode.attention import (
    Segment,
    decode_attention,
    decode_attention_reference,
    decode_attention_triton,
    decode_path,
)
from kvq.runtime.packed import PackedRows
from tests.runtime.kernels.helpers import (
    assert_two_launches_no_sync,
    greedy,
    interpret_compiled_launches,
    record_launches,
)
from tests.runtime.kernels.test_decode_attention import (
    ATOL,
    DEVICE,
    _check,
    _codec_segment,
    _data,
    _rope,
    _to,
)

# many interpreted Triton launches or every model family: `make test-quick` skips it
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _full(x: torch.Tensor) -> PackedRows:
    return PackedRows("full", x.shape[-1], x.clone())


def _layer_segments(kind, b, hkv, d, rows, sink=2, residual=5, seed=0):
    """What a layer hands attention: full-precision sink rows, packed main rows, the
    full-precision residual window."""
    k, v = _data(b, hkv, sink + rows + residual, d, seed)
    k = k + 2.0  # a common key offset: the folded key bias carries real weight
    kp, vp = _codec_segment(kind, k[:, :, sink : sink + rows], v[:, :, sink : sink + rows])
    segs = [Segment(kp, vp)]
    if sink:
        segs.insert(0, Segment(_full(k[:, :, :sink]), _full(v[:, :, :sink])))
    if residual:
        segs.append(Segment(_full(k[:, :, -residual:]), _full(v[:, :, -residual:])))
    return segs


@pytest.mark.parametrize("kind", ["int4-channel", "int8-channel-sym"])
@pytest.mark.parametrize("d, hq, hkv", [(64, 8, 2), (128, 4, 1)])
def test_sink_main_and_residual_in_one_launch_match_reference(kind, d, hq, hkv, planned_calls):
    segs = _layer_segments(kind, 2, hkv, d, rows=150, seed=3)
    _check(torch.randn(2, hq, 1, d) * 2, segs)
    assert len(planned_calls) == 1


def _per_token_segment(bits, group, k, v):
    """K and V per token in groups (the calibration-free int4 / int8 policies' layout)."""
    scheme = QuantScheme("int", bits, group_size=group)
    d = k.shape[-1]
    kc = make_codec(scheme, d, torch.float32, {}, "layers.0.key")
    vc = make_codec(scheme, d, torch.float32, {}, "layers.0.value")
    return Segment(kc.packed(*kc.encode(k)), vc.packed(*vc.encode(v)))


@pytest.mark.parametrize("bits, group, d", [(4, 32, 64), (4, 64, 256), (8, 16, 64)])
def test_per_token_group_keys_decode_like_values(bits, group, d, planned_calls):
    """Per-token key qparams cannot fold into the query: the kernel applies them to the
    decoded key tile, as it does the values'."""
    k, v = _data(2, 1, 130, d, seed=bits + group)
    main = _per_token_segment(bits, group, k[:, :, 2:], v[:, :, 2:])
    assert main.key.qaxis == "row"
    sink = Segment(_full(k[:, :, :2]), _full(v[:, :, :2]))
    _check(torch.randn(2, 4, 1, d) * 2, [sink, main])
    assert len(planned_calls) == 1


@pytest.mark.parametrize("rows", [1, 63, 64, 65, 300])
def test_split_boundaries_across_segments(rows, planned_calls):
    """Row counts around the 64-row tile: splits fall on tile boundaries of the segments
    laid end to end, and a split may start in one segment and end in another."""
    segs = _layer_segments("int4-channel", 1, 2, 64, rows=rows, sink=3, residual=7, seed=rows)
    _check(torch.randn(1, 4, 1, 64), segs)
    assert len(planned_calls) == 1


def test_two_query_positions_are_causal(planned_calls):
    segs = _layer_segments("int4-channel", 2, 1, 64, rows=70, seed=4)
    _check(torch.randn(2, 3, 2, 64), segs)  # MQA, Q = 2 (speculative decode)
    assert len(planned_calls) == 1


def test_full_precision_segments_alone(planned_calls):
    k, v = _data(2, 2, 90, 64, seed=6)
    _check(torch.randn(2, 4, 1, 64), [Segment(_full(k), _full(v))])
    assert len(planned_calls) == 1


def _window_mask(b, q_len, total, window, pad=0, batched=True):
    """[B | 1, 1, Q, total] bool: the last Q rows causal, each query sees its `window` most
    recent rows; sequence 1 of a batch left-padded by `pad` rows."""
    col = torch.arange(total)
    q_pos = torch.arange(total - q_len, total)[:, None]  # [Q, 1]
    seen = (col <= q_pos) & (col > q_pos - window)  # [Q, total]
    mask = seen[None, None].repeat(b if batched else 1, 1, 1, 1)
    if pad:
        mask[1, :, :, :pad] = False
    return mask


def _fp8_segment(fmt, lifetime, k, v, seed=0):
    """fp8 main rows through the codecs: a static scale per KV head (kv-scales, the
    engines' layout) or a scale per token (fp8-e4m3-dynamic)."""
    from kvq.quant import fp8

    axis = "head" if lifetime == "static" else "token"
    scheme = QuantScheme("fp8", 8, axis=axis, symmetric=True, scale_dtype="float32",
                         lifetime=lifetime, fp8_format=fmt)  # fmt: skip
    rows = []
    for x, part in ((k, "key"), (v, "value")):
        state = {}
        if lifetime == "static":
            state = {"scale": fp8.fp8_scale(x.abs().amax(dim=(0, 2, 3)), fmt)}  # [H]
        codec = make_codec(scheme, x.shape[-1], torch.float32, state, f"layers.0.{part}")
        rows.append(codec.packed(*codec.encode(x)))
    return Segment(*rows)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("lifetime", ["static", "dynamic"])
def test_fp8_codes_decode_from_their_bits(fmt, lifetime, planned_calls):
    """fp8 main rows (between sink and residual rows, with a sliding window mask) through
    the planned kernel: the codes' bits moved into fp16 and the format's factor folded into
    the scales give the reference's attention."""
    b, hkv, d = 2, 2, 64
    k, v = _data(b, hkv, 140, d, seed=14)
    k = k * 40.0  # wide keys: small codes land on fp8 subnormals and fp16 ones
    main = _fp8_segment(fmt, lifetime, k[:, :, 2:-5], v[:, :, 2:-5])
    assert main.key.kind == "lookup"
    segs = [Segment(_full(k[:, :, :2]), _full(v[:, :, :2])), main,
            Segment(_full(k[:, :, -5:]), _full(v[:, :, -5:]))]  # fmt: skip
    mask = _window_mask(b, 1, 140, window=100)
    _check(torch.randn(b, 4, 1, d) * 0.05, segs, mask=mask)
    _check(torch.randn(b, 4, 1, d) * 0.05, segs)
    assert len(planned_calls) == 2


@pytest.mark.parametrize("q_len, batched", [(1, True), (2, True), (1, False)])
def test_sliding_window_and_padding_masks_match_reference(q_len, batched, planned_calls):
    """A sliding-window layer's decode call (transformers' mask over the kernel rows): the
    planned kernel reads the mask in place, across tile and split boundaries, and a padded
    sequence's hidden rows weigh nothing."""
    b, hkv, d = 2, 2, 64
    segs = _layer_segments("int4-channel", b, hkv, d, rows=200, seed=11)
    total = sum(s.rows for s in segs)
    mask = _window_mask(b if batched else 1, q_len, total, window=150, pad=9 if batched else 0)
    _check(torch.randn(b, 4, q_len, d), segs, mask=mask)
    assert len(planned_calls) == 1


def test_a_fully_masked_query_row_gives_zeros_like_the_reference(planned_calls):
    """A padding position's query in a prefill sees no row: zero output, no NaN."""
    segs = _layer_segments("int8-channel-sym", 2, 1, 64, rows=70, seed=12)
    total = sum(s.rows for s in segs)
    mask = _window_mask(2, 2, total, window=total)
    mask[1, :, 0] = False
    q, segs, mask = _to((torch.randn(2, 2, 2, 64), segs, mask), DEVICE)
    ref = decode_attention_reference(q, segs, scaling=0.125, mask=mask)
    out = decode_attention_triton(q, segs, scaling=0.125, mask=mask)
    assert len(planned_calls) == 1
    assert (out - ref).abs().max().item() < ATOL
    assert not out[1, :, 0].any() and out[0].abs().amin() > 0


@pytest.mark.parametrize("kind", ["int4-g16", "nuq3", "int2-int3"])  # 8 codes/group plane
def test_other_layouts_keep_the_general_kernel(kind, planned_calls):
    k, v = _data(1, 2, 40, 64, seed=7)
    kp, vp = _codec_segment(kind, k, v)
    _check(torch.randn(1, 4, 1, 64), [Segment(kp, vp)])
    assert not planned_calls


def _positions(b, total, start=0, pad=()):
    """[B, total] RoPE positions: start, start + 1, ... per sequence; sequence i of `pad`
    left-padded by pad[i] rows, which sit at position 1 and the rest shifted back (what
    transformers' generate gives a left-padded batch)."""
    pos = torch.arange(start, start + total).repeat(b, 1)
    for i, n in enumerate(pad):
        pos[i] -= n
        pos[i, :n] = 1
    return pos


def _pre_rope(segs, positions):
    """The same segments with keys stored before RoPE at `positions` [B, total] (columns in
    segment order), as a pre-RoPE layer hands them over: sink, main and residual rows."""
    out, col = [], 0
    for seg in segs:
        key = replace(seg.key, pre_rope=True)
        out.append(Segment(key, seg.value, positions[:, col : col + seg.rows]))
        col += seg.rows
    return out


def _pre_rope_layer(encode, b, hkv, d, rows, start=0, pad=(), sink=2, residual=5, seed=0):
    """A layer's segments as a pre-RoPE cache hands them to attention: full-precision sink
    rows, the main rows `encode(keys, values, positions)` packs, the residual window, keys
    stored before RoPE; positions from `start`, sequence i left-padded by pad[i] rows."""
    total = sink + rows + residual
    k, v = _data(b, hkv, total, d, seed)
    k = k + 2.0  # a common key offset: the normaliser's centre carries real weight
    pos = _positions(b, total, start=start, pad=pad)
    main = encode(k[:, :, sink : sink + rows], v[:, :, sink : sink + rows],
                  pos[:, sink : sink + rows])  # fmt: skip

    def full(a, z):
        key = PackedRows("full", d, k[:, :, a:z].clone(), pre_rope=True)
        return Segment(key, _full(v[:, :, a:z]), pos[:, a:z])

    return [full(0, sink), main, full(sink + rows, total)]


@pytest.mark.parametrize("kind", ["int4-channel", "int8-channel-sym"])
@pytest.mark.parametrize("d, hq, hkv", [(64, 8, 2), (256, 4, 1)])
def test_pre_rope_keys_rotate_at_their_positions(kind, d, hq, hkv, planned_calls):
    """Pre-RoPE sink, main (static key qparams) and residual rows in one planned launch: a
    left-padded sequence's rows off one run of positions (the tile at the pad), the other's
    at positions that start mid-tile; splits across tiles and segments; GQA or MQA (head_dim
    256: the columns rotate in two chunks)."""
    b, rows = 2, 150
    segs = _layer_segments(kind, b, hkv, d, rows=rows, seed=21)
    total = sum(s.rows for s in segs)
    segs = _pre_rope(segs, _positions(b, total, start=37, pad=(0, 9)))
    mask = _window_mask(b, 1, total, window=total, pad=9)
    _check(torch.randn(b, hq, 1, d) * 2, segs, rope=_rope(d), mask=mask)
    assert len(planned_calls) == 1


def test_pre_rope_keys_with_speculative_query_rows(planned_calls):
    """Q = 3 causal query rows per head (speculative verify), GQA: the rotated query of each
    tile serves every row."""
    segs = _layer_segments("int4-channel", 2, 2, 64, rows=90, seed=22)
    total = sum(s.rows for s in segs)
    segs = _pre_rope(segs, _positions(2, total, start=5))
    _check(torch.randn(2, 4, 3, 64), segs, rope=_rope(64))
    assert len(planned_calls) == 1


@pytest.mark.parametrize("fmt", ["kv4-token", "kv4-token-one-group", "kv8-token", "fp8",
                                 "fp8-token"])  # fmt: skip
def test_pre_rope_keys_with_per_row_and_fp8_qparams(fmt, planned_calls):
    """Per-token key groups (each half of a row its own groups, or one group per row) and
    fp8 codes (a scale per head or per token) decode before they rotate."""
    b, d = 2, 64
    k, v = _data(b, 2, 100, d, seed=23)
    if fmt.startswith("fp8"):
        k = k * 40.0
        lifetime = "dynamic" if fmt.endswith("token") else "static"
        main = _fp8_segment("e4m3", lifetime, k[:, :, 2:], v[:, :, 2:])
    else:
        bits, group = {"kv4-token": (4, 32), "kv4-token-one-group": (4, 64),
                       "kv8-token": (8, None)}[fmt]  # fmt: skip
        main = _per_token_segment(bits, group, k[:, :, 2:], v[:, :, 2:])
    sink = Segment(_full(k[:, :, :2]), _full(v[:, :, :2]))
    segs = _pre_rope([sink, main], _positions(b, 100, start=3, pad=(0, 4)))
    mask = _window_mask(b, 1, 100, window=100, pad=4)
    q = torch.randn(b, 4, 1, d) * (0.05 if fmt.startswith("fp8") else 1.0)
    _check(q, segs, rope=_rope(d), mask=mask)
    assert len(planned_calls) == 1


def _exact_rope(d, positions=4096, theta=10000.0):
    """cos, sin tables [P, D/2] float32 whose angles are exact (float64 before rounding):
    `_rope`'s fp32 angles p x theta_f carry an error up to |p theta_f| 2^-24, which angle
    addition does not reproduce (2000 x 6e-8 = 1.2e-4 rad at position 2000)."""
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def test_pre_rope_positions_off_a_run_and_scaled_tables(planned_calls):
    """Rows at arbitrary positions (repeats, gaps, descending: every tile reads its rows'
    own table rows) and tables that carry an attention factor (YaRN-style cos and sin
    scaled by 1.3 per frequency pair: the amplitude goes onto the query) match the
    reference; so does a run of positions far from 0 under the same scaled tables (angles
    exact, see `_exact_rope`)."""
    b, d = 2, 64
    segs = _layer_segments("int4-channel", b, 2, d, rows=120, seed=24)
    total = sum(s.rows for s in segs)
    cos, sin = _exact_rope(d)
    rope = (cos * 1.3, sin * 1.3)
    scattered = torch.randint(0, 3000, (b, total), generator=torch.Generator().manual_seed(5))
    scattered[:, 40:60] = 17  # one position repeated over a tile boundary
    _check(torch.randn(b, 4, 1, d), _pre_rope(segs, scattered), rope=rope)
    _check(torch.randn(b, 4, 1, d), _pre_rope(segs, _positions(b, total, start=2000)), rope=rope)
    assert len(planned_calls) == 2


def test_pre_rope_tables_are_built_once_per_table():
    """The unit tables in plane order are cached per RoPE table object (a layer's tables
    live across decode steps), per plane count and dtype."""
    cos, sin = _rope(64, positions=300)
    a = planned_decode.rope_planes((cos, sin), 2, torch.float16)
    assert planned_decode.rope_planes((cos, sin), 2, torch.float16) is a
    tab, amp = planned_decode.rope_planes((cos * 2, sin * 2), 2, torch.float32)
    assert tab.shape == (300, 2, 32) and torch.allclose(amp, torch.full((32,), 2.0))
    # plane order: the even channels' frequencies 0, 2, ..., then the odd ones'
    torch.testing.assert_close(tab[:, 0, 16], cos[:, 1])
    torch.testing.assert_close(tab[:, 1, 1], sin[:, 2])


def _strip_exceptions(seg: Segment) -> Segment:
    """The same codes (and positions) without their exact exceptions."""
    key = replace(seg.key, sparse_count=None, sparse_index=None, sparse_value=None)
    return replace(seg, key=key, value=replace(seg.value, slot_index=None, slot_value=None))


def _check_moving_exceptions(segs, heads: int, planned_calls) -> None:
    """A pre-RoPE layer's segments (sink, main, residual) against the reference in one
    planned launch, one query row per head, and the main rows' exceptions move the result
    far beyond the tolerance: a kernel that dropped (or misplaced) them would fail (the
    triton result against the same call without them)."""
    b, d = segs[0].key.data.shape[0], segs[0].key.head_dim
    q = torch.randn(b, heads, 1, d) * 2
    out = _check(q, segs, rope=_rope(d))
    assert len(planned_calls) == 1
    bare = [segs[0], _strip_exceptions(segs[1]), segs[2]]
    q, bare, rope = _to((q, bare, _rope(d)), DEVICE)
    without = decode_attention_triton(q, bare, scaling=d**-0.5, rope=rope).cpu()
    assert (out - without).abs().max().item() > 100 * ATOL


def _check_masks_and_scattered_rows(segs, q_len: int, heads: int) -> None:
    """A layer's pre-RoPE segments against the reference under a sliding-window mask with
    padding, causal without a mask, and with the rows at scattered positions (each tile
    then gathers its rows' own RoPE table rows): three calls."""
    b, d = segs[0].key.data.shape[0], segs[0].key.head_dim
    total = sum(s.rows for s in segs)
    mask = _window_mask(b, q_len, total, window=100, pad=9)
    _check(torch.randn(b, heads, q_len, d), segs, rope=_rope(d), mask=mask)
    _check(torch.randn(b, heads, q_len, d), segs, rope=_rope(d))
    scattered = torch.randint(0, 3000, (b, total), generator=torch.Generator().manual_seed(6))
    moved = [Segment(s.key, s.value, p) for s, p in
             zip(segs, scattered.split([s.rows for s in segs], 1), strict=True)]  # fmt: skip
    _check(torch.randn(b, heads, q_len, d), moved, rope=_rope(d))


@pytest.mark.parametrize("kind", ["nuq4-dense", "nuq4"])
@pytest.mark.parametrize("d, hq, hkv", [(64, 8, 2), (128, 4, 1)])
def test_nuq4_codes_and_exceptions_in_one_launch_match_reference(kind, d, hq, hkv,
                                                                 planned_calls):  # fmt: skip
    """KVQuant's NUQ4 main rows (codebook levels, per-channel key and per-row value
    normalisers; with exceptions: the keys' flat exact entries, the values' slots) between
    sink and residual rows, GQA and MQA, through the planned kernel."""
    segs = _layer_segments(kind, 2, hkv, d, rows=150, seed=5)
    main = segs[1]
    assert main.key.kind == "lookup" and main.key.bits == 4
    if kind == "nuq4":
        assert main.key.sparse_index.numel() and main.value.slot_index is not None
    q = torch.randn(2, hq, 1, d) * 2
    out = _check(q, segs)
    assert len(planned_calls) == 1
    if kind == "nuq4":  # the exceptions move the result: the check above sees them
        bare = [segs[0], _strip_exceptions(main), segs[2]]
        q, bare = _to((q, bare), DEVICE)
        without = decode_attention_triton(q, bare, scaling=d**-0.5).cpu()
        assert (out - without).abs().max().item() > 100 * ATOL


@pytest.mark.parametrize("q_len", [1, 2])
def test_nuq4_with_masks_and_query_blocks(q_len, planned_calls):
    """NUQ4 with exceptions under a sliding-window mask with padding (Q = 1 and 2), and
    causal without a mask: the corrected scores go through the same masking."""
    b, hkv, d = 2, 2, 64
    segs = _layer_segments("nuq4", b, hkv, d, rows=140, seed=8)
    total = sum(s.rows for s in segs)
    mask = _window_mask(b, q_len, total, window=100, pad=7)
    _check(torch.randn(b, 4, q_len, d), segs, mask=mask)
    _check(torch.randn(b, 4, q_len, d), segs)
    assert len(planned_calls) == 2


@pytest.mark.parametrize("pre_rope", [False, True])
@pytest.mark.parametrize("d, hq, hkv", [(64, 8, 2), (256, 4, 1)])
def test_key_entries_of_a_long_row_take_several_steps(pre_rope, d, hq, hkv, planned_calls):
    """The keys' flat exceptions go KE entries of every row a step
    (`KernelConfig.key_entries_per_step`: pre-RoPE keys 2 at 4 warps, 4 at 8; post-RoPE
    1) until the tile's longest row is done: a row holding many times KE of them (its keys
    8x the calibrated range: nearly every channel an exception) among rows with none to a
    few, each row's steps past its own count masked, GQA and MQA."""
    b, sink, rows = 2, 2, 150
    k, v = _data(b, hkv, sink + rows + 5, d, seed=41)
    k = k + 2.0
    k[:, :, sink + 70] *= 8.0  # a row of the main rows' second tile
    kp, vp = _codec_segment("nuq4", k[:, :, sink : sink + rows], v[:, :, sink : sink + rows])
    segs = [Segment(_full(k[:, :, :sink]), _full(v[:, :, :sink])), Segment(kp, vp),
            Segment(_full(k[:, :, -5:]), _full(v[:, :, -5:]))]  # fmt: skip
    counts = kp.sparse_count.long()
    config = planned_decode.kernel_config(d, 4, rope_lut=pre_rope, key_entries=True)
    per_step = config.key_entries_per_step
    assert counts[:, :, 70].min() > 8 * max(per_step, int(counts.median()))
    mask = None
    if pre_rope:
        total = sum(s.rows for s in segs)
        segs = _pre_rope(segs, _positions(b, total, start=37, pad=(0, 9)))
        mask = _window_mask(b, 1, total, window=total, pad=9)
    _check(torch.randn(b, hq, 1, d) * 2, segs, rope=_rope(d) if pre_rope else None, mask=mask)
    assert len(planned_calls) == 1


@pytest.mark.parametrize("kind", ["nuq4-dense", "nuq4"])
@pytest.mark.parametrize("d, hq, hkv", [(64, 8, 2), (128, 4, 2), (256, 4, 1)])
def test_pre_rope_nuq4_keys_and_exceptions_match_reference(kind, d, hq, hkv, planned_calls):
    """KVQuant's stored layout: NUQ4 keys before RoPE (levels x per-channel scale + centre,
    then rotated at each row's position) with their flat exact exceptions and the values'
    slots, between pre-RoPE sink and residual rows, GQA (head_dim 64; 128: two chunks of
    16 columns) and MQA (256: two chunks of 32), a left-padded sequence under its mask. The exceptions move the
    result far beyond the tolerance: dropping them (or rotating them wrongly) fails."""
    b = 2
    segs = _layer_segments(kind, b, hkv, d, rows=150, seed=31)
    total = sum(s.rows for s in segs)
    segs = _pre_rope(segs, _positions(b, total, start=37, pad=(0, 9)))
    main = segs[1]
    assert main.key.kind == "lookup" and main.key.pre_rope
    mask = _window_mask(b, 1, total, window=total, pad=9)
    q = torch.randn(b, hq, 1, d) * 2
    out = _check(q, segs, rope=_rope(d), mask=mask)
    assert len(planned_calls) == 1
    if kind == "nuq4":
        assert main.key.sparse_index.numel() and main.value.slot_index is not None
        bare = [segs[0], _strip_exceptions(main), segs[2]]
        q, bare, rope, mask = _to((q, bare, _rope(d), mask), DEVICE)
        without = decode_attention_triton(q, bare, scaling=d**-0.5, rope=rope, mask=mask).cpu()
        assert (out - without).abs().max().item() > 100 * ATOL


@pytest.mark.parametrize("q_len", [1, 2])
def test_pre_rope_nuq4_with_masks_and_query_blocks(q_len, planned_calls):
    """Pre-RoPE NUQ4 with exceptions under a sliding-window mask with padding (Q = 1 and
    2), and causal without a mask; rows at scattered positions (each tile gathers its rows'
    own table rows) too."""
    b, hkv, d = 2, 2, 64
    segs = _layer_segments("nuq4", b, hkv, d, rows=140, seed=32)
    total = sum(s.rows for s in segs)
    pre = _pre_rope(segs, _positions(b, total, start=5, pad=(7,)))
    mask = _window_mask(b, q_len, total, window=100, pad=7)
    _check(torch.randn(b, 4, q_len, d), pre, rope=_rope(d), mask=mask)
    _check(torch.randn(b, 4, q_len, d), pre, rope=_rope(d))
    scattered = torch.randint(0, 3000, (b, total), generator=torch.Generator().manual_seed(6))
    _check(torch.randn(b, 4, q_len, d), _pre_rope(segs, scattered), rope=_rope(d))
    assert len(planned_calls) == 3


@pytest.mark.parametrize("kind", ["nuq4-dense", "nuq4"])
@pytest.mark.parametrize("pre, d, hq, hkv", [(False, 64, 8, 2), (True, 64, 8, 2),
                                             (True, 128, 4, 2)])  # fmt: skip
def test_fp16_dots_take_nuq4_levels_from_the_byte_pair_table(kind, pre, d, hq, hkv):
    """With fp16 dots (the compiled path; here interpreted) NUQ4 keys, and values without
    slots, become their levels by one gather per code byte from the 256-entry table of
    level pairs (`_pair_levels`): within fp16 rounding of the reference, keys post- and
    pre-RoPE (head_dim 128: two chunks of columns), and the exceptions still move the
    result far beyond that, so a lookup that lost them would fail."""
    b = 2
    segs = _layer_segments(kind, b, hkv, d, rows=150, seed=41)
    rope = None
    if pre:
        total = sum(s.rows for s in segs)
        segs = _pre_rope(segs, _positions(b, total, start=37, pad=(0, 9)))
        rope = _rope(d)
    q, segs, rope = _to((torch.randn(b, hq, 1, d) * 2, segs, rope), DEVICE)
    kw = dict(scaling=d**-0.5, softcap=None, half=True, rope=rope)
    call = planned_decode.planned_call(q, segs, **kw)
    assert call.args["K_LUT"] and call.args["V_LUT"] and call.args["HALF"]
    ref = decode_attention_reference(q, segs, scaling=d**-0.5, rope=rope)
    out = planned_decode.run_planned(q, segs, **kw)
    assert (out - ref).abs().max().item() < 2e-2
    if kind == "nuq4":
        bare = [segs[0], _strip_exceptions(segs[1]), segs[2]]
        without = planned_decode.run_planned(q, bare, **kw)
        assert (without - ref).abs().max().item() > 0.2


def _slotted_values(seg: Segment, slots: int, seed: int) -> Segment:
    """`seg` with its value exceptions replaced by `slots` per row: random distinct
    channels, and on every third row two slots in one code byte (channels 2j, 2j + 1), a
    third in that byte's word, a fourth in the next word; every fifth row's last slot
    unused (channel D)."""
    v = seg.value
    b, h, t, _ = v.scale.shape
    d = v.head_dim
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(d, generator=g)[:slots] for _ in range(b * h * t)])
    idx = idx.view(b, h, t, slots)
    if slots >= 2:
        word = torch.randint(0, d // 8, (b, h, t), generator=g) * 8
        byte = word + 2 * torch.randint(0, 4, (b, h, t), generator=g)
        crowd = [byte, byte + 1] + ([word + (byte - word + 4) % 8] if slots >= 3 else [])
        crowd += [(word + 8) % d + 3] if slots >= 4 else []  # another word
        every3 = torch.arange(t) % 3 == 0
        for i, ch in enumerate(crowd):
            idx[..., i] = torch.where(every3, ch, idx[..., i])
    idx[..., slots - 1] = torch.where(torch.arange(t) % 5 == 0, d, idx[..., slots - 1])
    vals = (torch.randn(b, h, t, slots, generator=g) * 4).half()
    index = torch.uint8 if d < 256 else torch.int16  # unused slots: D
    value = replace(v, slot_index=idx.to(index), slot_value=vals)
    return Segment(seg.key, value, seg.positions)


@pytest.mark.parametrize("slots, d", [(1, 64), (3, 64), (4, 64), (4, 256)])
def test_fp16_dots_redirect_nuq4_value_slots_in_the_pair_table(slots, d):
    """Pre-RoPE NUQ4 with fp16 dots: the values' slots redirect the gather of their code
    byte to per-row entries of an extended pair table (`_pair_values`), slots sharing a
    byte or a word included, unused slots skipped (head_dim 256, MQA: the numerator
    transposed, values the dot's A operand): within fp16 rounding of the reference, and
    the slots move the result far beyond that."""
    b, hkv, hq = 2, (2 if d < 256 else 1), (8 if d < 256 else 4)
    segs = _layer_segments("nuq4", b, hkv, d, rows=150, seed=43)
    total = sum(s.rows for s in segs)
    segs = _pre_rope(segs, _positions(b, total, start=11))
    segs[1] = _slotted_values(segs[1], slots, seed=slots)
    q, segs, rope = _to((torch.randn(b, hq, 1, d) * 2, segs, _rope(d)), DEVICE)
    kw = dict(scaling=d**-0.5, softcap=None, half=True, rope=rope)
    call = planned_decode.planned_call(q, segs, **kw)
    assert call.args["V_SLOTS"] == slots and call.args["V_WORDS"] and call.args["HALF"]
    ref = decode_attention_reference(q, segs, scaling=d**-0.5, rope=rope)
    out = planned_decode.run_planned(q, segs, **kw)
    assert (out - ref).abs().max().item() < 2e-2
    bare = [segs[0], replace(segs[1], value=replace(segs[1].value, slot_index=None,
                                                     slot_value=None)), segs[2]]  # fmt: skip
    without = planned_decode.run_planned(q, bare, **kw)
    assert (without - ref).abs().max().item() > 0.2


def _route_segments(fmt, d=64):
    """A layer's segments (sink, main, residual) with main rows in format `fmt`."""
    k, v = _data(2, 2, 80, d, seed=13)
    if fmt == "kv4-token":
        main = _per_token_segment(4, 32, k[:, :, 2:-5], v[:, :, 2:-5])
    elif fmt == "kv8-token":
        main = _per_token_segment(8, None, k[:, :, 2:-5], v[:, :, 2:-5])
    elif fmt.startswith("fp8"):
        lifetime = "dynamic" if fmt.endswith("token") else "static"
        main = _fp8_segment("e4m3", lifetime, k[:, :, 2:-5], v[:, :, 2:-5])
    else:
        kind = {"kv4": "int4-channel", "kv4-pre": "int4-channel", "kv8": "int8-channel-sym",
                "nuq4-pre": "nuq4"}.get(fmt, fmt)  # fmt: skip
        pre = fmt.endswith("-pre")
        kp, vp = _codec_segment(kind, k[:, :, 2:-5], v[:, :, 2:-5], pre_rope=pre)
        main = Segment(kp, vp, torch.arange(2, 75).expand(2, 73) if pre else None)
    sink = Segment(_full(k[:, :, :2]), _full(v[:, :, :2]))
    residual = Segment(_full(k[:, :, -5:]), _full(v[:, :, -5:]))
    return [sink, main, residual]


PLANNED_FORMATS = ("kv4", "kv4-pre", "kv4-token", "kv8", "kv8-token", "fp8", "fp8-token", "nuq4",
                   "nuq4-pre")  # fmt: skip
GENERAL_FORMATS = ("nuq3", "int2-int3", "int4-g16")


@pytest.mark.parametrize("fmt", PLANNED_FORMATS + GENERAL_FORMATS)
@pytest.mark.parametrize("masked", [False, True])
def test_which_kernel_a_layer_call_takes_on_cuda(fmt, masked):
    """What a CUDA decode call of a layer in `fmt` runs (asked on this CPU machine): the
    planned kernel for 4- and 8-bit affine codes, fp8 and NUQ4 with keys post- or pre-RoPE
    (exceptions included), masked (sliding window, padding) or not;
    the general kernel for the layouts the planned one does not decode; the reference on
    CPU tensors with the auto backend; the general kernel everywhere with
    KVQ_DECODE_PLANNED=0."""
    segs = _route_segments(fmt)
    q = torch.randn(2, 4, 1, 64)
    mask = _window_mask(2, 1, sum(s.rows for s in segs), window=40) if masked else None
    path = decode_path(q, segs, mask, backend="auto", device="cuda")
    if fmt in PLANNED_FORMATS:
        assert path.kernel == "planned" and path.reason is None
    else:
        assert path.kernel == "general" and path.reason
    assert decode_path(q, segs, mask, backend="auto").kernel == "reference"
    assert decode_path(q, segs, mask, backend="reference", device="cuda").kernel == "reference"


def test_the_planned_kernel_can_be_switched_off(monkeypatch):
    segs = _route_segments("kv4")
    q = torch.randn(2, 4, 1, 64)
    monkeypatch.setattr(attention, "PLANNED", False)
    path = decode_path(q, segs, backend="triton", device="cuda")
    assert path == attention.DecodePath("general", "KVQ_DECODE_PLANNED=0")


def test_narrow_pre_rope_keys_keep_the_general_kernel():
    """4-bit pre-RoPE keys of head_dim 32 hold 8 channels per plane and half: fewer than a
    dot's K of 16, so they rotate in the general kernel; 8-bit ones (16) are planned."""
    k, v = _data(2, 1, 40, 32, seed=8)
    q = torch.randn(2, 4, 1, 32)
    pos = torch.arange(40).expand(2, 40)
    for kind, planned in (("int4-channel", False), ("int8-channel-sym", True)):
        seg = Segment(*_codec_segment(kind, k, v, pre_rope=True), pos)
        path = decode_path(q, [seg], device="cuda", backend="triton")
        assert (path.kernel == "planned") == planned, path


def test_prefill_blocks_are_planned_in_chunks():
    """A query block of more than 64 rows per KV head runs on the reference with the auto
    backend; an explicit "triton" plans it in chunks of query positions that fit (2 query
    heads per KV head: 32 positions a chunk)."""
    segs = _route_segments("kv4-pre")
    long_q = torch.randn(2, 4, 40, 64)  # 2 x 40 query rows per KV head
    auto = decode_path(long_q, segs, device="cuda", backend="auto")
    assert auto.kernel == "reference" and "80 query rows" in auto.reason
    path = decode_path(long_q, segs, device="cuda", backend="triton")
    assert path == attention.DecodePath("planned", chunks=2, chunk=32)
    assert path.describe() == "triton planned kernel, 2 chunks of 32 query positions"


@pytest.mark.parametrize("fmt", ["kv4", "nuq4-pre"])
@pytest.mark.parametrize("masked", [False, True])
def test_prefill_chunks_through_the_planned_kernel_match_reference(fmt, masked, planned_calls):
    """Sink, packed main and residual rows (post-RoPE INT4 with static key qparams, or
    KVQuant's pre-RoPE NUQ4 with exceptions), MQA with 4 query heads x 20 positions: two
    planned launches of 16 and 4 positions, causal without a mask, or each with its rows
    of a sliding-window and padding mask."""
    b, d, q_len = 2, 64, 20
    kind = {"kv4": "int4-channel", "nuq4-pre": "nuq4"}[fmt]
    segs = _layer_segments(kind, b, 1, d, rows=30, seed=41)
    total = sum(s.rows for s in segs)
    rope = None
    if fmt.endswith("-pre"):
        segs, rope = _pre_rope(segs, _positions(b, total, start=5, pad=(0, 4))), _rope(d)
    mask = _window_mask(b, q_len, total, window=16, pad=4) if masked else None
    _check(torch.randn(b, 4, q_len, d) * 2, segs, rope=rope, mask=mask)
    assert [call[0].shape[2] for call in planned_calls] == [16, 4]


def test_one_split_writes_the_output_itself(monkeypatch):
    """A single split per work item normalises in the kernel: no partials, no reduction."""
    segs = _layer_segments("int4-channel", 1, 1, 64, rows=40, sink=0, residual=0)
    launches = record_launches(monkeypatch)
    _check(torch.randn(1, 2, 1, 64), segs)
    assert launches == ["decode_splits_kernel"]


@pytest.mark.parametrize("kind, masked, pre_rope", [("int4-channel", False, False),
                                                    ("int4-channel", True, False),
                                                    ("int4-channel", True, True),
                                                    ("nuq4", True, False),
                                                    ("nuq4", True, True)])  # fmt: skip
def test_one_call_costs_two_launches_no_sync_and_three_allocations(kind, masked, pre_rope):
    """A layer's decode call (sink, packed main rows, residual) at batch 4 through the
    runtime's dispatch (`decode_attention`, which picks the path), plain or with a sliding
    window mask, keys post- or pre-RoPE: the host launches the decode kernel and the
    reduction and nothing else, allocates the partial states and the output, and never
    waits on the device (pre-RoPE: the tables in plane order are built by the first call
    and reused, and no position is read on the host). The kernels themselves are stubbed
    during the count (the interpreter copies arguments with torch ops of its own, which a
    CUDA launch does not). NUQ4 main rows with exceptions (keys post- or pre-RoPE, the
    latter KVQuant's stored layout): their codebook table and the keys' first flat entries
    per row are computed once (the warm call) for unchanged rows."""
    segs = _layer_segments(kind, 4, 2, 64, rows=300, seed=9)
    total = sum(s.rows for s in segs)
    rope = None
    if pre_rope:
        segs, rope = _pre_rope(segs, _positions(4, total, pad=(3,))), _to(_rope(64), DEVICE)
    segs = _to(segs, DEVICE)
    q = torch.randn(4, 8, 1, 64, device=DEVICE)
    mask = _window_mask(4, 1, total, window=200).to(DEVICE) if masked else None
    call = dict(scaling=0.125, mask=mask, backend="triton", rope=rope)
    decode_attention(q, segs, **call)  # warm: compile, fold the key qparams
    assert_two_launches_no_sync(lambda: decode_attention(q, segs, **call))


def test_a_call_with_device_row_counts_costs_the_same():
    """With the row counts on the device (`run_planned(lengths=...)`) a call launches the
    decode kernel and the reduction, allocates their outputs and never reads the counts
    on the host."""
    segs = _to(_layer_segments("int4-channel", 4, 2, 64, rows=300, seed=9), DEVICE)
    q = torch.randn(4, 8, 1, 64, device=DEVICE)
    lengths = torch.tensor([2, 250, 3], dtype=torch.int32, device=DEVICE)
    call = dict(scaling=0.125, softcap=None, half=False, lengths=lengths)
    planned_decode.run_planned(q, segs, **call)  # warm
    assert_two_launches_no_sync(lambda: planned_decode.run_planned(q, segs, **call))


def _same(x, y) -> bool:
    """Equal argument values: tensors by what a launch reads (address, dtype, strides)."""
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return (x.data_ptr(), x.dtype, x.stride()) == (y.data_ptr(), y.dtype, y.stride())
    return type(x) is type(y) and x == y


@pytest.mark.parametrize("kind", ["int4-channel", "nuq4"])
def test_calls_of_one_layout_share_their_site(kind):
    """A layer's next decode call (a new query, one more packed row: views of the same
    buffers) fills the site its first call built instead of building the arguments again,
    and gets the arguments a freshly built site gives; rows in a buffer of another
    capacity (other strides) make another site."""
    segs = _layer_segments(kind, 2, 2, 64, rows=150, seed=3)

    def layer(rows, sink=segs[0]):
        main = segs[1]
        return [sink, Segment(main.key.narrow(0, rows), main.value.narrow(0, rows)), segs[2]]

    kw = dict(scaling=0.125, softcap=None, half=False)
    first = planned_decode.planned_call(torch.randn(2, 4, 1, 64), layer(140), **kw)
    q = torch.randn(2, 4, 1, 64)
    nxt = planned_decode.planned_call(q, layer(141), **kw)
    assert nxt.site is first.site
    assert nxt.args["q"] is q and nxt.args["rows1"] == 141 and first.args["rows1"] == 140
    planned_decode._SITES.clear()
    fresh = planned_decode.planned_call(q, layer(141), **kw)
    assert fresh.site is not first.site
    assert fresh.args.keys() == nxt.args.keys()
    assert all(_same(fresh.args[n], v) for n, v in nxt.args.items()), nxt.args
    wider = torch.zeros(2, 2, 8, 64)[:, :, :2]  # the sink rows in a buffer of 8
    wider.copy_(segs[0].key.data)
    sink = Segment(PackedRows("full", 64, wider), segs[0].value)
    other = planned_decode.planned_call(q, layer(141, sink), **kw)
    assert other.site is not fresh.site and other.args["k0_h"] == 8 * 64


@pytest.mark.parametrize("kind", ["int4-channel", "nuq4"])
def test_the_compiled_path_passes_values_in_signature_order(monkeypatch, kind):
    """The launcher's CUDA path — a compiled kernel per site and split specialisation,
    launched with the call's values in signature order (the reduction's too), no binder —
    with the interpreter standing in for the compiled kernels: successive calls of a layer
    (rows growing across a split boundary, one split and several) give the reference's
    attention, and compile once per specialisation."""
    compiles = []

    def compiled(fn, kwargs):
        assert list(kwargs) == list(fn.arg_names)  # every parameter, by name
        compiles.append(fn.__name__)

    interpret_compiled_launches(monkeypatch, on_compile=compiled)
    segs = _layer_segments(kind, 1, 1, 64, rows=300, seed=15)
    q = torch.randn(1, 2, 1, 64)
    for rows in (40, 41, 300):  # 1 split (the output written directly), then several
        main = Segment(segs[1].key.narrow(0, rows), segs[1].value.narrow(0, rows))
        _check(q, [segs[0], main, segs[2]])
    assert compiles.count("decode_splits_kernel") == 2  # DIRECT, and splits of 2 .. 15
    assert compiles.count("combine_splits_kernel") == 1


def _counted(segs, counts):
    """The segments cut to `counts` rows each (what the device counts say they hold)."""
    return [
        Segment(s.key.narrow(0, n), s.value.narrow(0, n)) for s, n in zip(segs, counts, strict=True)
    ]


@pytest.mark.parametrize("kind, masked", [("int4-channel", False), ("int4-channel", True),
                                          ("nuq4", False)])  # fmt: skip
def test_row_counts_on_the_device_drive_the_kernel(kind, masked):
    """Segments that are a cache's buffers (their rows: the capacity) with the row counts
    in a device tensor: the kernel attends over the counted rows only (the reference over
    those rows: sink, main and residual rows each at their own count, causal query rows,
    a sliding-window mask over the counted rows end to end in a buffer as wide as the
    capacities), and the launch stays the same while
    the counts move, as a CUDA graph replays it: one site, one plan."""
    b, d = 2, 64
    segs = _to(_layer_segments(kind, b, 2, d, rows=300, sink=2, residual=16, seed=16), DEVICE)
    q = torch.randn(b, 4, 2 if masked else 1, d, device=DEVICE)
    half = attention._dot_mode(q.device) != "ieee"
    calls = []
    for counts in ([2, 150, 5], [2, 151, 6], [1, 300, 0]):
        lengths = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
        mask = None
        total = sum(counts)
        if masked:  # a sliding window over the counted rows end to end, 318 columns wide
            mask = torch.zeros(b, 1, 2, 318, dtype=torch.bool)
            mask[..., :total] = _window_mask(b, 2, total, window=100)
            mask = mask.to(DEVICE)
        out = planned_decode.run_planned(q, segs, scaling=0.125, softcap=None, half=half,
                                         mask=mask, lengths=lengths)  # fmt: skip
        counted = _counted(segs, counts)
        ref_mask = None if mask is None else mask[..., :total]
        ref = decode_attention_reference(q, counted, scaling=0.125, mask=ref_mask)
        assert (out - ref).abs().max().item() < ATOL, counts
        call = planned_decode.planned_call(q, segs, scaling=0.125, softcap=None, half=half,
                                           mask=mask, lengths=lengths)  # fmt: skip
        calls.append(call)
    assert len({id(c.site) for c in calls}) == 1 and len({c.rows for c in calls}) == 1
    assert calls[0].args["rows1"] is None and calls[0].args["lengths"] is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_decode_step_with_device_row_counts_replays_over_new_rows():
    """A call over a cache's buffers with the row counts on the device, captured in a CUDA
    graph, replays over rows written after the capture: moving the counts on the device is
    all a step needs (no host value in the launch changes)."""
    segs = _to(_layer_segments("int4-channel", 4, 2, 128, rows=4000, seed=10), "cuda")
    q = torch.randn(4, 8, 1, 128, device="cuda")
    lengths = torch.tensor([2, 3000, 1], dtype=torch.int32, device="cuda")
    kw = dict(scaling=128**-0.5, softcap=None, half=True, lengths=lengths)
    planned_decode.run_planned(q, segs, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = planned_decode.run_planned(q, segs, **kw)
    for counts in ([2, 3000, 2], [2, 3064, 5]):
        lengths.copy_(torch.tensor(counts, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        eager = decode_attention_triton(q, _counted(segs, counts), scaling=128**-0.5)
        torch.testing.assert_close(out, eager, atol=2e-3, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_decode_call_captures_in_a_cuda_graph():
    """Plan, launches and buffers need nothing from the host that changes inside a bucket:
    one call captures in a CUDA graph and replays to the eager result."""
    segs = _to(_layer_segments("int4-channel", 4, 2, 128, rows=4000, seed=10), "cuda")
    q = torch.randn(4, 8, 1, 128, device="cuda")
    eager = decode_attention_triton(q, segs, scaling=128**-0.5)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention_triton(q, segs, scaling=128**-0.5)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager)


@torch.no_grad()
@pytest.mark.parametrize("key_stage", ["post-rope", "pre-rope"])
def test_generate_through_the_planned_path_matches_the_reference(monkeypatch, planned_calls,
                                                                 paths, key_stage):  # fmt: skip
    """Public path: greedy generate of a tiny Gemma 3 (head_dim 32, MQA; window 8, so the
    sliding-window layers' calls carry masks) with the int4 policy on the Triton backend
    gives the reference backend's tokens, and every attention call, prefill and decode,
    sliding-window layers included, takes the planned path; with keys stored before RoPE
    (and a sink row; head_dim 64) too, a left-padded sequence in the batch."""
    from kvq.models.adapters import get_adapter
    from kvq.quant.schemes import CachePolicy, LayerPolicy, named_policy
    from tests.conftest import make_tiny_model

    # head_dim 64 for pre-RoPE keys: 32 channels of 4-bit codes are 8 per plane and half,
    # fewer than a dot takes (those calls run on the general kernel)
    model = make_tiny_model("gemma3", **({"head_dim": 64} if key_stage == "pre-rope" else {}))
    model = model.to(DEVICE)
    ad = get_adapter(model)
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    policy = named_policy("int4", ad.info.num_layers, ad.info.head_dim)
    if key_stage == "pre-rope":
        layer = LayerPolicy(**{**policy.layers[0].__dict__, "key_stage": key_stage,
                               "sink_tokens": 1})  # fmt: skip
        policy = CachePolicy("int4-pre", (layer,) * ad.info.num_layers)
        ids[1, :3] = 0  # left padding: that sequence's positions start 3 rows later

    def generate(backend):
        return greedy(monkeypatch, model, policy, {}, ad, ids, backend)

    want = generate("reference")
    assert not planned_calls and not paths
    assert torch.equal(generate("triton"), want)
    # 4 layers x (1 prefill + 4 decode steps), each through the planned kernel
    assert len(planned_calls) == 20
    assert {p.kernel for p in paths} == {"planned"}


@torch.no_grad()
def test_generate_prefills_a_long_prompt_on_the_triton_backend(monkeypatch, planned_calls, paths):
    """Public path: an explicit Triton backend prefills a prompt longer than one kernel
    program holds (a tiny Gemma 3, 4 query heads per KV head: 16 positions a program; 24
    tokens, one sequence left-padded by 3) in chunks of 16 and 8 positions, sliding-window
    layers included, and greedy generate gives the reference backend's tokens."""
    from kvq.models.adapters import get_adapter
    from kvq.quant.schemes import named_policy
    from tests.conftest import make_tiny_model

    model = make_tiny_model("gemma3").to(DEVICE)
    ad = get_adapter(model)
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ids[1, :3] = 0
    policy = named_policy("int4", ad.info.num_layers, ad.info.head_dim)

    def generate(backend):
        return greedy(monkeypatch, model, policy, {}, ad, ids, backend)

    want = generate("reference")
    assert torch.equal(generate("triton"), want)
    prefill = [p for p in paths if p.chunks > 1]
    assert len(prefill) == ad.info.num_layers  # every layer's prefill, and only those
    assert {(p.kernel, p.chunks, p.chunk) for p in prefill} == {("planned", 2, 16)}
    # 4 layers x (16 + 8 prefill positions, then 4 decode steps of one)
    assert sorted(call[0].shape[2] for call in planned_calls) == [1] * 16 + [8] * 4 + [16] * 4


@torch.no_grad()
def test_generate_with_a_kvquant_layout_cache_through_the_planned_path(
    monkeypatch, planned_calls, paths
):
    """Public path, KVQuant's stored layout: NUQ4 keys before RoPE with per-channel
    normalisers and exact outliers, NUQ4 values with exception slots, a sink row; greedy
    generate of a tiny Gemma 3 (head_dim 64, MQA, sliding-window masks) with a left-padded
    sequence gives the reference backend's tokens, every attention call on the planned path,
    and the cache holds key exceptions (so their rotated corrections took part)."""
    from kvq.models.adapters import get_adapter
    from kvq.quant.schemes import CachePolicy, LayerPolicy
    from tests.conftest import make_tiny_model, nuq_key_state

    model = make_tiny_model("gemma3", head_dim=64).to(DEVICE)
    ad = get_adapter(model)
    hkv, d, layers = ad.info.num_kv_heads, ad.info.head_dim, ad.info.num_layers
    layer = LayerPolicy(
        QuantScheme("nuq", 4, axis="channel", lifetime="static", outlier_fraction=0.02),
        QuantScheme("nuq", 4, outlier_fraction=0.02), key_stage="pre-rope", sink_tokens=1,
    )  # fmt: skip
    policy = CachePolicy("kvquant4-pre", (layer,) * layers)
    static = {}
    for i in range(layers):
        # thresholds narrower than the tiny model's keys: a few % of entries are outliers
        key = nuq_key_state(4, hkv, d, 0.02, seed=i)
        key = {n: t * 0.3 if n != "codebook" else t for n, t in key.items()}
        static |= {f"layers.{i}.key.{n}": t.to(DEVICE) for n, t in key.items()}
        static[f"layers.{i}.value.codebook"] = key["codebook"].to(DEVICE)
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ids[1, :3] = 0

    def generate(backend):
        return greedy(monkeypatch, model, policy, static, ad, ids, backend)

    want = generate("reference")
    assert not planned_calls and not paths
    assert torch.equal(generate("triton"), want)
    assert len(planned_calls) == layers * 5  # 1 prefill + 4 decode steps per layer
    assert {p.kernel for p in paths} == {"planned"}
    # the decode calls' main rows (KVQuant's layout: pre-RoPE lookup keys) hold exceptions
    mains = [s for _, segs in planned_calls for s in segs if s.key.kind == "lookup"]
    assert mains and all(s.key.pre_rope for s in mains)
    assert sum(s.key.sparse_index.numel() for s in mains if s.key.sparse_index is not None)


def test_flat_starts_follow_the_count_rows():
    """The NUQ keys' first flat entry per (batch, head, row) is the prefix sum of the counts
    in entry order; a new view of unchanged rows reuses it, a write into the count buffer
    (an append) or more rows recompute it."""
    from kvq.runtime.packed import entry_pointers

    buf = torch.zeros(2, 3, 16, dtype=torch.uint8)
    buf[:, :, :10] = torch.randint(0, 4, (2, 3, 10), dtype=torch.uint8)
    first = planned_layouts.flat_starts(buf[:, :, :10])
    assert torch.equal(first, entry_pointers(buf[:, :, :10]))
    assert planned_layouts.flat_starts(buf[:, :, :10]) is first
    buf[0, 1, 4] += 1
    again = planned_layouts.flat_starts(buf[:, :, :10])
    assert torch.equal(again, entry_pointers(buf[:, :, :10])) and not torch.equal(again, first)
    longer = planned_layouts.flat_starts(buf[:, :, :11])
    assert longer.shape == (2, 3, 11)
