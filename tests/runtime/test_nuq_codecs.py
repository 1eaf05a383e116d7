"""KVQuant codecs: codebook lookup, exact holes, variable-length key exceptions."""

import pytest
import torch

from kvq.errors import KvqError
from kvq.quant import nuq, sparse
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs import make_codec
from kvq.runtime.codecs.nuq import SPARSE_DTYPE
from tests.conftest import nuq_key_state

H, D = 2, 16


def _key_state(bits=4, fraction=0.05, seed=0):
    return nuq_key_state(bits, H, D, fraction, seed)


def _key_codec(bits=4, fraction=0.05):
    scheme = QuantScheme(
        format="nuq", bits=bits, axis="channel", lifetime="static", outlier_fraction=fraction
    )
    return make_codec(scheme, D, torch.float32, _key_state(bits, fraction), "layers.0.key")


def _value_codec(bits=3, fraction=0.125):
    scheme = QuantScheme(format="nuq", bits=bits, axis="token", outlier_fraction=fraction)
    cb = nuq.fit_codebook(
        torch.rand(5000, generator=torch.Generator().manual_seed(1)) * 2 - 1, bits
    )
    return make_codec(scheme, D, torch.float32, {"codebook": cb}, "layers.0.value")


def test_key_outliers_decode_exactly_and_dense_matches_reference():
    codec = _key_codec()
    x = torch.randn(3, H, 7, D, generator=torch.Generator().manual_seed(2)) * 4
    rows, flat = codec.encode(x)
    assert rows["codes"].dtype == torch.uint8 and rows["codes"].shape[-1] == D // 2
    out = codec.decode(rows, flat)
    lower, upper = codec._lower.float(), codec._upper.float()
    mask = sparse.threshold_outliers(x, lower, upper)
    assert mask.any(), "the test needs some outliers"
    # holes: outlier coordinates come back as the stored value, never dense + sparse
    assert torch.equal(out[mask], x[mask].to(SPARSE_DTYPE).float())
    # inliers: the reference composition of the shared numeric core
    ref = nuq.denormalize(
        nuq.nuq_decode(
            nuq.nuq_encode(nuq.normalize(x, codec._scale, codec._center), codec.codebook),
            codec.codebook,
        ),
        codec._scale,
        codec._center,
    )
    assert torch.equal(out[~mask], ref[~mask])
    assert int(rows["sparse_count"].sum()) == int(mask.sum()) == flat["sparse_index"].numel()


def test_key_entries_of_any_row_range_decode_like_the_whole():
    codec = _key_codec()
    x = torch.randn(2, H, 9, D, generator=torch.Generator().manual_seed(3)) * 4
    rows, flat = codec.encode(x)
    whole = codec.decode(rows, flat)
    per_row = rows["sparse_count"].long().sum(dim=(0, 1))
    ptr = torch.cat([torch.zeros(1, dtype=torch.long), per_row.cumsum(0)])
    a, b = 3, 7
    part_rows = {n: t[:, :, a:b] for n, t in rows.items()}
    part_flat = {n: t[ptr[a] : ptr[b]] for n, t in flat.items()}
    assert torch.equal(codec.decode(part_rows, part_flat), whole[:, :, a:b])


def test_value_rows_keep_fixed_exceptions_exactly():
    codec = _value_codec()
    x = torch.randn(1, H, 5, D, generator=torch.Generator().manual_seed(4))
    x[0, 0, 0, 3] = 50.0  # one huge value must not coarsen the row
    rows, _ = codec.encode(x)
    out = codec.decode(rows, {})
    assert out[0, 0, 0, 3] == torch.tensor(50.0).to(SPARSE_DTYPE).float()
    k = sum(sparse.tail_counts(D, 0.125))
    assert rows["sparse_index"].shape[-1] == k
    inlier_err = (out - x).abs()
    assert inlier_err[0, 0, 0].max() < 1.0  # the row's range came from its inliers


def test_missing_state_and_bit_mismatch_are_refused():
    scheme = QuantScheme(
        format="nuq", bits=4, axis="channel", lifetime="static", outlier_fraction=0.01
    )
    state = _key_state()
    for missing in ("codebook", "lower", "scale"):
        broken = {k: v for k, v in state.items() if k != missing}
        with pytest.raises(KvqError, match=f"layers.3.key.{missing}"):
            make_codec(scheme, D, torch.float32, broken, "layers.3.key")
    wrong = dict(state, codebook=nuq.uniform_codebook(3))
    with pytest.raises(KvqError, match="declares 4 bits"):
        make_codec(scheme, D, torch.float32, wrong, "layers.3.key")
