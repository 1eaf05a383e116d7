"""Trellis codes (`kvq calibrate trellis`, what `kvq calibrate auto` stores) on the planned
decode path: each channel's state read from its unit of codes and the one before it, its
level gathered from the table indexed oldest digit lowest (`planned_layouts.trellis_table`),
KVQuant's normalisers and exact exceptions applied as for the vq layouts. Parity with the
reference under the interpreter (sink, main and residual rows in one launch; GQA and MQA;
masks; one and two query positions), the routes, and greedy generate."""

from __future__ import annotations

import pytest
import torch

from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs import make_codec
from kvq.runtime.kernels.decode import planned_layouts
from kvq.runtime.kernels.decode.attention import (
    Segment,
    decode_attention_triton,
    decode_path,
)
from kvq.runtime.packed import PackedRows
from tests.runtime.kernels.helpers import calibrated_vq, greedy
from tests.runtime.kernels.test_decode_attention import (
    ATOL,
    DEVICE,
    _check,
    _nuq_key_state,
    _rope,
    _to,
    _trellis_state,
)
from tests.runtime.kernels.test_planned_decode import (
    _check_masks_and_scattered_rows,
    _check_moving_exceptions,
    _pre_rope_layer,
    _window_mask,
)

# many interpreted Triton launches or every model family: `make test-quick` skips it
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _trellis_segment(k, v, bits, window, fraction, positions, value_fraction=None):
    """Trellis main rows as the codecs write them: keys before RoPE with the static NUQ
    normaliser and flat exceptions, values with a per-row normaliser and slots."""
    d, heads = k.shape[-1], k.shape[1]
    vf = fraction if value_fraction is None else value_fraction
    ks = QuantScheme("trellis", bits, axis="channel", lifetime="static",
                     outlier_fraction=fraction, window=window)  # fmt: skip
    vs = QuantScheme("trellis", bits, outlier_fraction=vf, window=window)
    kst = _nuq_key_state(k, bits, fraction)
    del kst["codebook"]
    kst |= _trellis_state(window, heads, d)
    kc = make_codec(ks, d, torch.float32, kst, "layers.0.key")
    vc = make_codec(vs, d, torch.float32, _trellis_state(window, heads, d, seed=1),
                    "layers.0.value")  # fmt: skip
    kp = kc.packed(*kc.encode(k))
    kp = PackedRows(**{**kp.__dict__, "pre_rope": True})
    return Segment(kp, vc.packed(*vc.encode(v)), positions)


def _trellis_layer(bits, window, b, hkv, d, rows, fraction, start=0, pad=(), sink=2,
                   residual=5, seed=0, value_fraction=None):  # fmt: skip
    """A layer's segments as a trellis cache hands them to attention (`_pre_rope_layer`):
    trellis main rows."""

    def encode(k, v, pos):
        return _trellis_segment(k, v, bits, window, fraction, pos, value_fraction)

    return _pre_rope_layer(encode, b, hkv, d, rows, start, pad, sink, residual, seed)


# (digit bits, window): auto's 4-, 3-, 2- and 1-bit layers (window 12; 3-bit digits
# straddle words: read in 3-byte units), a short 2-bit window
LAYOUTS = [(4, 12), (3, 12), (2, 12), (1, 12), (2, 8)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fraction", [0.0, 0.05])
def test_trellis_layer_call_matches_reference_gqa(layout, fraction, planned_calls):
    """GQA, head_dim 64: each digit width, with and without exceptions (flat key entries
    corrected rotated, value slots), one planned launch over sink, main and residual rows,
    a left-padded sequence under its mask."""
    b, d = 2, 64
    segs = _trellis_layer(*layout, b, 2, d, rows=150, fraction=fraction, start=37, pad=(1,),
                          seed=3)  # fmt: skip
    main = segs[1]
    assert main.key.kind == main.value.kind == "trellis" and main.key.pre_rope
    if fraction:
        assert main.key.sparse_index.numel() and main.value.slot_index is not None
    total = sum(s.rows for s in segs)
    mask = _window_mask(b, 1, total, window=total, pad=9)
    _check(torch.randn(b, 8, 1, d) * 2, segs, rope=_rope(d), mask=mask)
    assert len(planned_calls) == 1


@pytest.mark.parametrize("layout", [(4, 12), (3, 12)])
def test_trellis_layer_call_matches_reference_mqa_256(layout, planned_calls):
    """MQA, head_dim 256 (Gemma 3), auto's 4-bit value exceptions (0.5%: 2 slots) and 1%
    key entries; the exceptions move the result far beyond the tolerance, so a kernel that
    dropped (or misplaced) them would fail."""
    b, d = 2, 256
    segs = _trellis_layer(*layout, b, 1, d, rows=100, fraction=0.03, start=5, seed=4,
                          value_fraction=0.005)  # fmt: skip
    _check_moving_exceptions(segs, heads=4, planned_calls=planned_calls)


@pytest.mark.parametrize("q_len", [1, 2])
def test_trellis_with_masks_and_query_blocks(q_len, planned_calls):
    """Sliding-window mask with padding, causal without a mask (Q = 1 and 2), and rows at
    scattered positions (each tile gathers its rows' own table rows)."""
    b, d = 2, 64
    _check_masks_and_scattered_rows(
        _trellis_layer(4, 12, b, 2, d, rows=140, fraction=0.05, start=5, pad=(0,), seed=5),
        q_len,
        heads=4,
    )
    assert len(planned_calls) == 3


@pytest.mark.parametrize("side", ["key", "value"])
def test_the_table_in_decode_order_breaks_parity(monkeypatch, side):
    """The kernel reads each state oldest digit lowest: handed the table in the order
    `kvq.quant.trellis` indexes it (newest lowest), the result leaves the reference far
    behind, so the reordering is what parity rests on."""
    b, d = 1, 64
    segs = _trellis_layer(4, 12, b, 2, d, rows=90, fraction=0.0, seed=7)
    q, segs_d, rope = _to((torch.randn(b, 4, 1, d) * 2, segs, _rope(d)), DEVICE)
    good = decode_attention_triton(q, segs_d, scaling=d**-0.5, rope=rope)
    table = getattr(segs_d[1], side).table
    build = planned_layouts.trellis_table

    def unordered(t, bits, window, half):
        out = build(t, bits, window, half)
        return t.to(out.dtype).contiguous() if t is table else out

    monkeypatch.setattr(planned_layouts, "trellis_table", unordered)
    bad = decode_attention_triton(q, segs_d, scaling=d**-0.5, rope=rope)
    assert (bad - good).abs().max().item() > 100 * ATOL


def test_trellis_layouts_route_to_the_planned_kernel_and_the_rest_say_why():
    """The calibrator's trellis layouts take the planned kernel; states above 12 bits
    (tables of more than 4096 levels), keys stored after RoPE and word-read rows off
    4-byte boundaries keep the general kernel, with the reason."""
    b, d = 1, 64
    q = torch.randn(b, 4, 1, d)
    for bits in (1, 2, 3, 4):
        segs = _trellis_layer(bits, 12, b, 2, d, rows=40, fraction=0.05)
        assert decode_path(q, segs, device="cuda").kernel == "planned"
    wide = _trellis_layer(4, 16, b, 2, d, rows=40, fraction=0.0)
    assert "states of 16 bits" in decode_path(q, wide, device="cuda").reason
    main = _trellis_layer(4, 12, b, 2, d, rows=40, fraction=0.0)[1]
    post = Segment(PackedRows(**{**main.key.__dict__, "pre_rope": False}), main.value)
    assert "after RoPE" in decode_path(q, [post], device="cuda").reason
    data = main.key.data
    shifted = torch.empty(data.numel() + 1, dtype=torch.uint8)[1:].view(data.shape)
    shifted.copy_(data)
    off = Segment(PackedRows(**{**main.key.__dict__, "data": shifted}), main.value,
                  main.positions)  # fmt: skip
    assert "whole units" in decode_path(q, [off], device="cuda").reason


@torch.no_grad()
def test_generate_with_an_auto_trellis_cache_takes_the_planned_path(monkeypatch, planned_calls,
                                                                    paths):  # fmt: skip
    """Public path: what `kvq calibrate auto --bits 4` stores (trellis codes, 12-bit
    states, pre-RoPE keys with 1% exceptions, 0.5% value slots, a sink row) on a tiny
    Gemma 3 (head_dim 64, MQA, one sliding-window and one global layer: each layer's
    appends are Viterbi searches in Triton's interpreter, most of the test's time): greedy generate with a left-padded
    sequence gives the reference backend's tokens, every attention call takes the
    planned kernel, the trellis rows included, and the appends' Viterbi searches run as
    Triton launches (`trellis_encode`)."""
    from kvq.calibrators.options import TrellisOptions
    from kvq.runtime.kernels.append import _trellis_triton

    searches = []
    launch = _trellis_triton.launch
    monkeypatch.setattr(_trellis_triton, "launch", lambda *a: searches.append(1) or launch(*a))

    options = TrellisOptions(bits=4, v_outliers=0.005)
    layers = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    model, ad, policy, tensors, g = calibrated_vq(options, DEVICE, head_dim=64, **layers)
    assert all(lp.key.format == "trellis" for lp in policy.layers)
    ids = torch.randint(3, 200, (2, 12), generator=g).to(DEVICE)
    ids[1, :3] = 0  # left padding

    def generate(backend):
        return greedy(monkeypatch, model, policy, tensors, ad, ids, backend)

    want = generate("reference")
    assert not planned_calls and not paths and not searches
    assert torch.equal(generate("triton"), want)
    assert {p.kernel for p in paths} == {"planned"} and searches
    mains = [s for _, segs in planned_calls for s in segs if s.key.kind == "trellis"]
    assert mains and all(s.key.pre_rope and s.value.kind == "trellis" for s in mains)
    assert sum(s.key.sparse_index.numel() for s in mains if s.key.sparse_index is not None)
