"""Decode attention over vector-codebook rows (`kvq calibrate vq` / `auto`): the "vector"
PackedRows kind, its pure-torch decode and the Triton kernel's codebook gather
(interpreted on CPU), for keys (post- and pre-RoPE, with and without exceptions) and values.

The chain, as for the other layouts: the codec's rows -> `decode_packed` (the shared
quantizer `kvq.quant.vq.decode`, then the normaliser and the exceptions) -> the reference
== dense softmax attention over the decoded rows (`_check`) -> kernel == reference.
"""

from __future__ import annotations

import pytest
import torch

from kvq.errors import KvqError
from kvq.quant import nuq, packing, sparse, vq
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs import make_codec
from kvq.runtime.kernels.decode.attention import Segment, kernel_calls
from kvq.runtime.packed import PackedRows, decode_packed
from tests.runtime.kernels.test_decode_attention import DEVICE, _check, _data, _rope


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # the queries below are drawn from the global generator


def _codebook(bits: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if 2 ** (bits * dim) > 256:  # too many centroids to fit quickly: random ones
        return (torch.rand(2 ** (bits * dim), dim, generator=g) * 2 - 1).half()
    vectors = torch.rand(3000, dim, generator=g) * 2 - 1
    return vq.fit_codebook(vectors, torch.ones_like(vectors), bits, iters=4).half()


def _groups(d: int, dim: int, pairs: bool, shuffle: int | None) -> torch.Tensor:
    """The calibrator's layout, or (shuffle = a seed) the same groups with their order and
    the channels inside each group permuted: the stored layout is any permutation."""
    groups = vq.channel_groups(d, dim, pairs)
    if shuffle is not None:
        g = torch.Generator().manual_seed(shuffle)
        groups = groups[torch.randperm(groups.shape[0], generator=g)]
        groups = groups[:, torch.randperm(dim, generator=g)]
    return groups.to(torch.int16)


def _key_codec(k, bits, dim, fraction, shuffle=None, pairs=True):
    """A vq key codec calibrated on k itself (per-channel normaliser, thresholds)."""
    h, d = k.shape[1], k.shape[3]
    samples = k.permute(0, 2, 1, 3).reshape(-1, h, d)  # [N, H, D]
    if fraction:
        lower, upper = sparse.channel_thresholds(samples, fraction)
    else:
        lower, upper = samples.amin(0), samples.amax(0)
    scale, center = nuq.normalizer(lower, upper)
    state = {"scale": scale, "center": center}
    if fraction:
        state |= {"lower": lower, "upper": upper}
    state |= {
        "vq_codebook": _codebook(bits, dim, seed=bits * 10 + dim),
        "vq_groups": _groups(d, dim, pairs, shuffle),
        "vq_weight": torch.rand(h, d, generator=torch.Generator().manual_seed(1)) + 0.5,
    }
    scheme = QuantScheme(
        format="vq", bits=bits, axis="channel", lifetime="static",
        outlier_fraction=fraction, vector_dim=dim,
    )  # fmt: skip
    return make_codec(scheme, d, torch.float32, state, "layers.0.key")


def _value_codec(h, d, bits, dim, fraction, shuffle=None):
    state = {
        "vq_codebook": _codebook(bits, dim, seed=bits * 10 + dim + 1),
        "vq_groups": _groups(d, dim, False, shuffle),
        "vq_weight": torch.rand(h, d, generator=torch.Generator().manual_seed(2)) + 0.5,
    }
    scheme = QuantScheme(
        format="vq", bits=bits, axis="token", outlier_fraction=fraction, vector_dim=dim
    )
    return make_codec(scheme, d, torch.float32, state, "layers.0.value")


def _segment(k, v, kbits, kdim, vbits, vdim, fraction=0.0, pre_rope=False, shuffle=None,
             positions=None, key_pairs=True):  # fmt: skip
    kc = _key_codec(k, kbits, kdim, fraction, shuffle, key_pairs)
    vc = _value_codec(v.shape[1], v.shape[3], vbits, vdim, fraction, shuffle)
    kp, vp = kc.packed(*kc.encode(k)), vc.packed(*vc.encode(v))
    if pre_rope:
        kp = PackedRows(**{**kp.__dict__, "pre_rope": True})
    return Segment(kp, vp, positions)


# --- the format: what the decoders read -----------------------------------------------------


@pytest.mark.parametrize("side", ["key", "value"])
def test_codec_rows_are_vector_packed_and_decode_with_the_shared_quantizer(side):
    """The codec hands the decoders its codes (kind "vector", not decoded rows), and
    `decode_packed` is the shared quantizer's decode, the normaliser and the exceptions,
    bit for bit."""
    k, v = _data(2, 2, 21, 32, seed=1)
    seg = _segment(k, v, 3, 2, 2, 4, fraction=0.05, shuffle=3)
    p = seg.key if side == "key" else seg.value
    assert p.kind == "vector" and p.data.dtype == torch.uint8
    assert p.data.shape[-1] == packing.packed_len(32, p.bits)  # codes, not fp32 rows
    digits = packing.unpack_bits(p.data, p.bits, 32)
    x = vq.decode(digits, p.table, p.groups, p.bits)
    if side == "key":
        want = nuq.denormalize(x, p.scale[None, :, None], p.offset[None, :, None])
    else:
        want = nuq.denormalize(x, p.scale, p.offset)
        want = sparse.merge_exceptions(want, p.slot_index.long(), p.slot_value.float())
    out = decode_packed(p)
    if side == "value":
        assert torch.equal(out, want)
        return
    # keys: the flat exceptions replace their coordinates with the stored (fp16) inputs
    assert p.sparse_index.numel() > 0
    differs = out != want
    assert 0 < int(differs.sum()) <= p.sparse_index.numel()
    assert torch.equal(out[differs], k.half().float()[differs])


def test_vector_rows_refuse_mismatched_tables_and_groups():
    codes = torch.zeros(1, 1, 2, 8, dtype=torch.uint8)  # 16 channels at 4 bits
    scale = torch.ones(1, 16)
    groups = vq.channel_groups(16, 2, True)
    with pytest.raises(KvqError, match="groups"):
        PackedRows("vector", 16, codes, 4, scale=scale, table=torch.zeros(256, 2))
    with pytest.raises(KvqError, match="table of 256 x 2"):
        PackedRows("vector", 16, codes, 4, scale=scale, table=torch.zeros(16, 2), groups=groups)
    with pytest.raises(KvqError, match="groups"):
        PackedRows(
            "vector", 16, codes, 4, scale=scale, table=torch.zeros(256, 2), groups=groups[:4]
        )


# --- the kernel against the reference -------------------------------------------------------


@pytest.mark.parametrize(
    "kbits, kdim, vbits, vdim",
    [(2, 4, 2, 4), (3, 2, 3, 2), (4, 2, 2, 2), (1, 4, 3, 2)],
)
def test_kernel_matches_reference_post_rope(kbits, kdim, vbits, vdim):
    """Post-RoPE static keys without exceptions fold their normaliser into the query (the
    bare coordinates are dotted); values decode per row. 45 rows: partial tiles."""
    k, v = _data(2, 2, 45, 64, seed=2)
    seg = _segment(k, v, kbits, kdim, vbits, vdim)
    q = torch.randn(2, 4, 1, 64)  # GQA: 2 query heads per KV head
    ((_, _, consts),) = kernel_calls(q, [seg], scaling=0.125, dots="ieee")[0]
    assert (consts["K_KIND"], consts["K_VDIM"], consts["V_KIND"], consts["V_VDIM"]) == (
        3, kdim, 3, vdim,
    )  # fmt: skip
    assert not consts["K_WORDS"] and not consts["V_WORDS"]  # digits are gathered per group
    assert consts["K_SHARED"]  # RoPE-pair groups: one index read for both key halves
    _check(q, [seg])


@pytest.mark.parametrize("kbits, kdim, vbits, vdim", [(3, 4, 1, 2), (1, 2, 3, 4)])
def test_the_narrowest_and_widest_index_fields(kbits, kdim, vbits, vdim):
    """Group indices of 2 bits (1-bit digits, 2-D) and 12 bits (3-bit digits, 4-D: 4096
    centroids, the most a scheme allows), which straddle bytes; pre-RoPE keys."""
    k, v = _data(1, 2, 30, 64, seed=9)
    positions = torch.arange(30)[None]
    seg = _segment(k, v, kbits, kdim, vbits, vdim, 0.05, pre_rope=True, positions=positions)
    _check(torch.randn(1, 4, 1, 64) * 2, [seg], rope=_rope(64))


@pytest.mark.parametrize("kbits, kdim, vbits, vdim", [(2, 4, 3, 2), (3, 2, 2, 4)])
@pytest.mark.parametrize("d", [64, 96])
def test_kernel_matches_reference_pre_rope_with_exceptions(kbits, kdim, vbits, vdim, d):
    """Pre-RoPE keys (the layout `kvq calibrate vq` stores): each half of a key reads the
    digits of its RoPE pair's group, decodes its coordinate, then rotates at the row's
    position; exact exceptions (flat key entries, value slots) replace coordinates; batch
    rows sit at different positions. head_dim 96 pads the channel blocks (48 of 64)."""
    b, t = 2, 40
    k, v = _data(b, 2, t, d, seed=4)
    positions = torch.arange(t)[None] + torch.tensor([[0], [6]])
    seg = _segment(k, v, kbits, kdim, vbits, vdim, 0.05, pre_rope=True, positions=positions)
    assert seg.key.sparse_index.numel() > 0 and seg.value.slot_index is not None
    q = torch.randn(b, 4, 1, d) * 2
    _check(q, [seg], rope=_rope(d))


def test_kernel_reads_any_group_layout_beside_a_full_precision_sink():
    """Groups in an arbitrary order, channels shuffled inside them (the artifact stores the
    layout; the kernel reads it through each channel's lane), pre-RoPE keys after an
    exact sink row, MQA with head_dim 256 (Gemma 3), two query positions (causal)."""
    d, t = 256, 33
    k, v = _data(1, 1, t, d, seed=5)
    positions = torch.arange(t)[None]
    sink = Segment(
        PackedRows("full", d, k[:, :, :1].clone(), pre_rope=True),
        PackedRows("full", d, v[:, :, :1].clone()),
        positions[:, :1],
    )
    main = _segment(k[:, :, 1:], v[:, :, 1:], 2, 4, 3, 2, 0.02, pre_rope=True, shuffle=7,
                    positions=positions[:, 1:])  # fmt: skip
    q = torch.randn(1, 4, 2, d) * 3
    _check(q, [sink, main], rope=_rope(d))


@pytest.mark.parametrize("pre_rope", [False, True])
def test_key_groups_that_do_not_pair_the_halves_read_their_own_indices(pre_rope):
    """Key groups of neighbouring channels (what a model without RoPE pairs gets): the two
    halves of a key tile hold different groups, so each reads its own group indices."""
    k, v = _data(2, 2, 37, 64, seed=6)
    positions = torch.arange(37)[None].expand(2, -1)
    seg = _segment(k, v, 2, 4, 3, 2, 0.05, pre_rope=pre_rope, positions=positions,
                   key_pairs=False)  # fmt: skip
    q = torch.randn(2, 4, 1, 64)
    ((_, _, consts),) = kernel_calls(q, [seg], scaling=0.125, rope=_rope(64), dots="ieee")[0]
    assert not consts["K_SHARED"]
    _check(q, [seg], rope=_rope(64))


def test_the_tuner_times_one_pipeline_depth_for_vector_layouts():
    """Vector codes are gathers, which Triton's pipeliner leaves alone: num_stages 2 would
    compile to the num_stages 1 binary, so the tuner does not time it twice."""
    from kvq.runtime.kernels.decode import attention as da

    k, v = _data(1, 1, 20, 256, seed=7)
    seg = _segment(k, v, 3, 2, 2, 4, pre_rope=True, positions=torch.arange(20)[None])
    q = torch.randn(1, 4, 1, 256)
    ((_, _, consts),) = kernel_calls(q, [seg], scaling=0.0625, rope=_rope(256), dots="tf32")[0]
    kept = da._fits(da.autotune_configs(), {}, **consts)
    assert {c.num_stages for c in kept} == {1} and not any(c.kwargs["PREFETCH"] for c in kept)
    assert len(kept) == 6  # BLOCK_T 16, 32 x 4, 8, 16 warps at head_dim 256


# --- the public path: a calibrated vq cache under model.generate ----------------------------


@torch.no_grad()
def test_generate_with_a_mixed_vq_cache_matches_the_reference(monkeypatch):
    """Greedy generate of a tiny Gemma 3 (MQA, pre-RoPE keys, sliding-window layers) with a
    mixed-precision vq policy (1 to 3 bits, 2- and 4-D codebooks) on the Triton backend
    gives the reference backend's tokens, and its decode steps hand the kernel the vector
    codes themselves: no layer falls back to decoded rows."""
    from kvq.calibrators.options import VQOptions
    from kvq.runtime.kernels.decode import attention as da
    from tests.runtime.kernels.helpers import calibrated_vq, greedy

    model, ad, policy, tensors, g = calibrated_vq(VQOptions(bits=2, mixed=True), DEVICE)
    widths = {(lp.key.bits, lp.key.vector_dim) for lp in policy.layers}
    widths |= {(lp.value.bits, lp.value.vector_dim) for lp in policy.layers}
    assert len(widths) > 1 and all(lp.key_stage == "pre-rope" for lp in policy.layers)

    kinds = []
    kernel = da.decode_attention_triton

    def spy(query, segments, **kw):
        kinds.extend((s.key.kind, s.value.kind) for s in segments)
        return kernel(query, segments, **kw)

    monkeypatch.setattr(da, "decode_attention_triton", spy)
    ids = torch.randint(3, 200, (2, 12), generator=g).to(DEVICE)

    def generate(backend):
        return greedy(monkeypatch, model, policy, tensors, ad, ids, backend)

    want = generate("reference")
    assert not kinds
    got = generate("triton")
    assert torch.equal(got, want)
    # (sink rows are exact: "full"; the encoded rows reach the kernel as codes)
    assert ("vector", "vector") in kinds and set(kinds) <= {("full", "full"), ("vector", "vector")}
