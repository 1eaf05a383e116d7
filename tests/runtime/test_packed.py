"""PackedRows: every codec's stored rows decode identically through the shared decoder."""

import pytest
import torch

from kvq.quant import nuq, packing, sparse
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs import make_codec
from kvq.runtime.packed import PackedRows, decode_packed, entry_pointers, row_pointers

D = 64


def _rows(seed=0, b=2, h=2, t=7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, t, D, generator=g)
    x[0, 1, 3, 5] = 9.0  # an outlier
    return x


def _nuq_state(x, fraction):
    flat = x.transpose(1, 2).reshape(-1, x.shape[1], D)  # [N, H, D]
    lower, upper = sparse.channel_thresholds(flat, fraction)
    scale, center = nuq.normalizer(lower, upper)
    return {
        "codebook": nuq.uniform_codebook(4),
        "scale": scale,
        "center": center,
        "lower": lower.half(),
        "upper": upper.half(),
    }


SCHEMES = {
    "int4-token-g16": (QuantScheme("int", 4, group_size=16), {}),
    "int8-token-sym": (QuantScheme("int", 8, symmetric=True), {}),
    "int3-token": (QuantScheme("int", 3), {}),
    "int2-channel": (
        QuantScheme("int", 2, axis="channel", lifetime="static"),
        {"scale": torch.full((2, D), 0.5).half(), "offset": torch.full((2, D), -0.7).half()},
    ),
    "nuq4-value": (QuantScheme("nuq", 4, outlier_fraction=0.02), {"codebook": None}),
    "nuq4-key": (
        QuantScheme("nuq", 4, axis="channel", lifetime="static", outlier_fraction=0.02),
        None,
    ),
    "none": (QuantScheme("none", 16), {}),
}


def _codec(name: str, x):
    """SCHEMES[name]'s codec, its state fitted to rows x where the scheme needs one."""
    scheme, state = SCHEMES[name]
    if state is None:
        state = _nuq_state(x, 0.02)
    if state.get("codebook", 0) is None:
        state = {"codebook": nuq.uniform_codebook(4)}
    return make_codec(scheme, D, torch.float32, state, "layers.0.key")


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_packed_decode_matches_codec(name):
    x = _rows()
    codec = _codec(name, x)
    rows, flat = codec.encode(x)
    ref = codec.decode(rows, flat)
    assert torch.equal(decode_packed(codec.packed(rows, flat)), ref)


def test_narrow_slices_flat_entries_with_their_rows():
    scheme, _ = SCHEMES["nuq4-key"]
    x = _rows(1, t=9)
    codec = make_codec(scheme, D, torch.float32, _nuq_state(x, 0.05), "layers.0.key")
    rows, flat = codec.encode(x)
    packed = codec.packed(rows, flat)
    assert packed.sparse_index.numel() > 0
    whole = decode_packed(packed)
    for a, b in ((0, 3), (3, 9), (4, 5)):
        assert torch.equal(decode_packed(packed.narrow(a, b)), whole[:, :, a:b])


def test_entry_pointers_follow_row_batch_head_order():
    count = torch.tensor([[[1, 0, 2]], [[3, 1, 0]]], dtype=torch.uint8)  # [B=2, H=1, T=3]
    # order: (t0,b0)=1 (t0,b1)=3 (t1,b0)=0 (t1,b1)=1 (t2,b0)=2 (t2,b1)=0
    assert entry_pointers(count).tolist() == [[[0, 4, 5]], [[1, 4, 7]]]
    assert row_pointers(count).tolist() == [0, 4, 5, 7]


@pytest.mark.parametrize(
    "name, pairs",
    [
        (name, pairs)
        for name in ("int4-token-g16", "int8-token-sym", "int2-channel")
        for pairs in (False, True)
    ]
    + [("nuq4-key", True)],  # static lookup keys: natural pair order, exceptions merged
)
def test_chunk_decoder_equals_canonical_within_rounding(name, pairs):
    from kvq.runtime.packed import ChunkDecoder

    scheme, state = SCHEMES[name]
    x = _rows(4, t=9)
    if state is None:
        state = _nuq_state(x, 0.05)
    codec = make_codec(scheme, D, torch.float32, state, "layers.0.key")
    packed = codec.packed(*codec.encode(x))
    assert packed.sparse_count is None or packed.sparse_index.numel() > 0
    dec = ChunkDecoder(packed, pairs=pairs)
    assert dec.pairs == pairs
    if pairs:  # pair order: each RoPE pair (c, c + D/2) side by side
        assert torch.equal(dec.perm[1::2], dec.perm[0::2] + D // 2)
    whole = decode_packed(packed)
    want = whole[..., dec.perm]
    assert torch.equal(dec.to_channels(dec.to_planes(whole)), whole)
    for a, b in ((0, 9), (2, 5)):
        got = dec.decode(a, b).movedim(0, -2).flatten(-2)  # planes -> perm order
        torch.testing.assert_close(got, want[:, :, a:b], rtol=1e-6, atol=1e-6)
    bias = dec.row_bias(0, 9)  # [B, H, T, G]: what decode(bias=False) leaves out
    assert (bias is not None) == (scheme.axis == "token" and not pairs)
    if bias is not None:
        plain = dec.decode(0, 9, bias=False).clone()
        plain.unflatten(-1, (bias.shape[-1], -1)).add_(bias[None, ..., None])
        torch.testing.assert_close(plain, dec.decode(0, 9))


def test_value_slots_replace_in_place_and_unused_slots_are_ignored():
    """Slots replace their coordinates; a slot holding the sentinel D (unused) changes nothing,
    through the shared merge's scratch column."""
    d = 8
    codes = torch.arange(2 * 3 * d, dtype=torch.uint8).remainder(16).view(1, 2, 3, d)
    table = torch.linspace(-1, 1, 16)
    index = torch.tensor([[[1, 5], [0, 7], [2, 4]], [[6, 3], [1, 2], [5, 0]]], dtype=torch.uint8)
    value = torch.full((1, 2, 3, 2), 9.0, dtype=torch.float16)

    def decoded(idx):
        p = PackedRows("lookup", d, packing.pack_bits(codes, 4), 4, scale=torch.ones(1, 2, 3, 1),
                       table=table, slot_index=idx[None], slot_value=value)  # fmt: skip
        return decode_packed(p)

    dense = table[codes.long()]
    full = decoded(index)
    expect = dense.clone().scatter_(-1, index[None].long(), 9.0)
    assert torch.equal(full, expect)
    unused = index.clone()
    unused[0, 1, 1] = d  # row (head 0, token 1): its second slot is unused
    out = decoded(unused)
    expect[0, 0, 1, 7] = dense[0, 0, 1, 7]
    assert torch.equal(out, expect)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_decode_into_a_strided_view_matches_decode(name):
    """decode_packed(p, out=rows of a wider buffer), as attention decodes each segment into
    its rows of one layer buffer, fills exactly those rows with the same values."""
    x = _rows()
    codec = _codec(name, x)
    p = codec.packed(*codec.encode(x))
    buffer = torch.full((2, 2, 10, D), -7.0)
    filled = decode_packed(p, out=buffer[:, :, 2:9])
    assert filled.data_ptr() == buffer[:, :, 2:9].data_ptr()
    assert torch.equal(buffer[:, :, 2:9], decode_packed(p))
    assert (buffer[:, :, :2] == -7).all() and (buffer[:, :, 9:] == -7).all()
