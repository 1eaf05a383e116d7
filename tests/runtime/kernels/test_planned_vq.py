"""Vector-codebook layouts (`kvq calibrate vq`, what `kvq calibrate auto --bits 2 | 3`
stores) on the planned decode path: RoPE-pair key groups and neighbouring-channel value
groups decoded by a codebook gather in the tile loop, KVQuant's normalisers and exact
exceptions applied as for NUQ4. Parity with the reference under the interpreter (sink,
main and residual rows in one launch; GQA and MQA; masks; one and two query positions),
the routes (what still takes the general kernel, and why), and greedy generate."""

from __future__ import annotations

import pytest
import torch

from kvq.runtime.kernels.decode import planned as planned_decode
from kvq.runtime.kernels.decode import planned_layouts
from kvq.runtime.kernels.decode.attention import (
    decode_attention_reference,
    decode_attention_triton,
    decode_path,
)
from tests.runtime.kernels.helpers import assert_two_launches_no_sync, calibrated_vq, greedy
from tests.runtime.kernels.test_decode_attention import ATOL, DEVICE, _check, _data, _rope, _to
from tests.runtime.kernels.test_decode_vq import _segment
from tests.runtime.kernels.test_planned_decode import (
    _check_masks_and_scattered_rows,
    _check_moving_exceptions,
    _pre_rope_layer,
    _strip_exceptions,
    _window_mask,
)

# many interpreted Triton launches or every model family: `make test-quick` skips it
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _vq_layer(widths, b, hkv, d, rows, fraction, start=0, pad=(), sink=2, residual=5, seed=0):
    """A layer's segments as a vq cache hands them to attention (`_pre_rope_layer`): vq main
    rows, keys before RoPE over RoPE pairs, values over neighbouring channels (`widths`:
    key bits, key dim, value bits, value dim)."""

    def encode(k, v, pos):
        return _segment(k, v, *widths, fraction, pre_rope=True, positions=pos)

    return _pre_rope_layer(encode, b, hkv, d, rows, start, pad, sink, residual, seed)


# (key bits, key dim, value bits, value dim): auto --bits 2 (2 x 4; its mixed widths 1 x 4
# and 3 x 2), auto --bits 3 (3 x 2; its mixed widths 2 x 2 and 4 x 2)
WIDTHS = [(2, 4, 2, 4), (3, 2, 3, 2), (1, 4, 3, 2), (4, 2, 2, 2), (2, 2, 1, 4)]


@pytest.mark.parametrize("widths", WIDTHS)
@pytest.mark.parametrize("fraction", [0.0, 0.05])
def test_vq_layer_call_matches_reference_gqa(widths, fraction, planned_calls):
    """GQA, head_dim 64: every width auto writes, with and without exceptions (flat key
    entries corrected rotated, value slots), one planned launch over sink, main and
    residual rows, a left-padded sequence under its mask."""
    b, d = 2, 64
    segs = _vq_layer(widths, b, 2, d, rows=150, fraction=fraction, start=37, pad=(1,), seed=3)
    main = segs[1]
    assert main.key.kind == main.value.kind == "vector" and main.key.pre_rope
    if fraction:
        assert main.key.sparse_index.numel() and main.value.slot_index is not None
    total = sum(s.rows for s in segs)
    mask = _window_mask(b, 1, total, window=total, pad=9)
    _check(torch.randn(b, 8, 1, d) * 2, segs, rope=_rope(d), mask=mask)
    assert len(planned_calls) == 1


@pytest.mark.parametrize("widths", [(2, 4, 2, 4), (3, 2, 3, 2)])
def test_vq_layer_call_matches_reference_mqa_256(widths, planned_calls):
    """MQA, head_dim 256 (Gemma 3: the RoPE pairs in four chunks of 32 groups for 2-D
    codebooks, two for 4-D), with exceptions; the exceptions move the result far beyond
    the tolerance, so a kernel that dropped (or misplaced) them would fail."""
    b, d = 2, 256
    segs = _vq_layer(widths, b, 1, d, rows=100, fraction=0.03, start=5, seed=4)
    _check_moving_exceptions(segs, heads=4, planned_calls=planned_calls)


@pytest.mark.parametrize("q_len", [1, 2])
def test_vq_with_masks_and_query_blocks(q_len, planned_calls):
    """Sliding-window mask with padding, causal without a mask (Q = 1 and 2), and rows at
    scattered positions (each tile gathers its rows' own table rows)."""
    b, d = 2, 64
    _check_masks_and_scattered_rows(
        _vq_layer((2, 4, 3, 2), b, 2, d, rows=140, fraction=0.05, start=5, pad=(0,), seed=5),
        q_len,
        heads=4,
    )
    assert len(planned_calls) == 3


@pytest.mark.parametrize("side", ["key", "value"])
def test_a_shuffled_codebook_breaks_parity(monkeypatch, side):
    """The gather reads each group's own centroid: the kernel handed the same codebook with
    its rows permuted (every other table unchanged) leaves the reference far behind."""
    b, d = 1, 64
    segs = _vq_layer((3, 2, 2, 4), b, 2, d, rows=90, fraction=0.0, seed=7)
    q, segs_d, rope = _to((torch.randn(b, 4, 1, d) * 2, segs, _rope(d)), DEVICE)
    good = decode_attention_triton(q, segs_d, scaling=d**-0.5, rope=rope)
    table = getattr(segs_d[1], side).table
    perm = torch.randperm(table.shape[0], generator=torch.Generator().manual_seed(0))
    build = planned_layouts.vq_table

    def shuffled(t, half):
        out = build(t, half)
        return out[perm.to(out.device)].contiguous() if t is table else out

    monkeypatch.setattr(planned_layouts, "vq_table", shuffled)
    bad = decode_attention_triton(q, segs_d, scaling=d**-0.5, rope=rope)
    assert (bad - good).abs().max().item() > 1000 * ATOL


def test_vq_layouts_route_to_the_planned_kernel_and_the_rest_say_why():
    """On CUDA, the calibrator's vq layouts take the planned kernel; groups in another
    layout, keys stored after RoPE and 4096-centroid codebooks keep the general kernel,
    each with its reason."""
    b, d = 2, 64
    k, v = _data(b, 2, 40, d, seed=8)
    pos = torch.arange(40).expand(b, 40)
    q = torch.randn(b, 4, 1, d)

    def route(**kw):
        widths = kw.pop("widths", (2, 4, 3, 2))
        seg = _segment(k, v, *widths, 0.05, positions=pos, **{"pre_rope": True, **kw})
        return decode_path(q, [seg], None, backend="auto", device="cuda")

    assert route() == route(widths=(3, 2, 2, 4)) == route(widths=(1, 4, 4, 2))
    assert route().kernel == "planned" and route().reason is None
    shuffled = route(shuffle=3)
    assert shuffled.kernel == "general" and "groups" in shuffled.reason
    post = route(pre_rope=False)
    assert post.kernel == "general" and "after RoPE" in post.reason
    wide = route(widths=(3, 4, 2, 4))
    assert wide.kernel == "general" and "4096 centroids" in wide.reason
    unpaired = route(key_pairs=False)
    assert unpaired.kernel == "general" and "RoPE pairs" in unpaired.reason


@torch.no_grad()
def test_generate_with_an_auto_vq_cache_takes_the_planned_path(monkeypatch, planned_calls,
                                                               paths):  # fmt: skip
    """Public path: what `kvq calibrate auto --bits 2` stores (4-D codebooks, per-layer
    widths by measured loss stand-in: Fisher; 1 to 3 bits, 2- and 4-D, pre-RoPE keys,
    exceptions, a sink row) on a tiny Gemma 3 (head_dim 64, MQA, sliding-window masks):
    greedy generate with a left-padded sequence gives the reference backend's tokens, and
    every attention call takes the planned kernel, vector codes included."""
    from kvq.calibrators.options import VQOptions

    options = VQOptions(bits=2, dim=4, mixed="fisher")
    model, ad, policy, tensors, g = calibrated_vq(options, DEVICE, head_dim=64)
    widths = {(lp.key.bits, lp.key.vector_dim) for lp in policy.layers}
    assert len(widths) > 1 and all(lp.key_stage == "pre-rope" for lp in policy.layers)
    ids = torch.randint(3, 200, (2, 12), generator=g).to(DEVICE)
    ids[1, :3] = 0  # left padding

    def generate(backend):
        return greedy(monkeypatch, model, policy, tensors, ad, ids, backend)

    want = generate("reference")
    assert not planned_calls and not paths
    assert torch.equal(generate("triton"), want)
    assert {p.kernel for p in paths} == {"planned"}
    mains = [s for _, segs in planned_calls for s in segs if s.key.kind == "vector"]
    assert mains and all(s.key.pre_rope and s.value.kind == "vector" for s in mains)
    assert len({(s.key.bits, s.key.vector_dim) for s in mains}) > 1
    assert sum(s.key.sparse_index.numel() for s in mains if s.key.sparse_index is not None)


@pytest.mark.parametrize("widths", [(2, 4, 2, 4), (3, 2, 3, 2)])
def test_fp16_dots_patch_value_slots_into_the_centroid_words(widths):
    """With fp16 dots (the compiled path; here interpreted) the 4-D value groups' slots are
    patched into the centroid words before the row normaliser (2-D groups replace them in
    the decoded tile): within fp16 rounding of the reference, and the slots move the result
    far beyond that (a value outlier of 12), so a patch that missed them would fail."""
    b, d = 2, 64
    segs = _vq_layer(widths, b, 2, d, rows=150, fraction=0.05, start=37, seed=3)
    assert segs[1].value.slot_index is not None
    q, segs, rope = _to((torch.randn(b, 8, 1, d) * 2, segs, _rope(d)), DEVICE)
    kw = dict(scaling=d**-0.5, softcap=None, half=True, rope=rope)
    call = planned_decode.planned_call(q, segs, **kw)
    assert call.args["V_VQ"] == widths[3] and call.args["V_SLOTS"] == 3 and call.args["HALF"]
    ref = decode_attention_reference(q, segs, scaling=d**-0.5, rope=rope)
    out = planned_decode.run_planned(q, segs, **kw)
    assert (out - ref).abs().max().item() < 2e-2
    bare = [segs[0], _strip_exceptions(segs[1]), segs[2]]
    without = planned_decode.run_planned(q, bare, **kw)
    assert (without - ref).abs().max().item() > 0.2


def test_a_vq_layer_call_costs_two_launches_no_sync_and_three_allocations():
    """A vq layer's decode call (pre-RoPE sink, vq main rows with exceptions, residual) at
    batch 4 under a sliding-window mask, through the runtime's dispatch: after the first
    call (which checks the groups and converts the codebooks once), the host launches the
    decode kernel and the reduction, allocates the partial states and the output, and never
    waits on the device (kernels stubbed during the count, as for the other layouts)."""
    from kvq.runtime.kernels.decode.attention import decode_attention

    b, d = 4, 64
    segs = _vq_layer((2, 4, 3, 2), b, 2, d, rows=300, fraction=0.05, pad=(3,), seed=9)
    total = sum(s.rows for s in segs)
    segs, rope = _to((segs, _rope(d)), DEVICE)
    q = torch.randn(b, 8, 1, d, device=DEVICE)
    mask = _window_mask(b, 1, total, window=200).to(DEVICE)
    call = dict(scaling=0.125, mask=mask, backend="triton", rope=rope)
    decode_attention(q, segs, **call)  # warm: compile, check the groups, convert the tables
    assert_two_launches_no_sync(lambda: decode_attention(q, segs, **call))
