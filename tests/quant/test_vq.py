"""Vector codebooks: group layouts, digits, nearest centroids, and the error they buy."""

import pytest
import torch

from kvq.errors import KvqError
from kvq.quant import nuq, vq


def test_groups_are_permutations_and_keys_group_rope_pairs():
    for dim in (2, 4):
        for pairs in (False, True):
            g = vq.channel_groups(16, dim, pairs)
            assert g.shape == (16 // dim, dim)
            assert torch.equal(g.reshape(-1).sort().values, torch.arange(16))
    assert vq.channel_groups(16, 2, True)[3].tolist() == [3, 11]  # (c, c + D/2)
    assert vq.channel_groups(16, 4, True)[1].tolist() == [2, 3, 10, 11]
    with pytest.raises(KvqError):
        vq.channel_groups(10, 4, False)


@pytest.mark.parametrize("bits,dim", [(1, 4), (2, 4), (3, 2), (4, 2)])
def test_centroids_round_trip_exactly_through_digits(bits, dim):
    g = torch.Generator().manual_seed(0)
    k = 2 ** (bits * dim)
    codebook = torch.rand(k, dim, generator=g) * 2 - 1
    groups = vq.channel_groups(8, dim, False)
    pick = torch.randint(0, k, (2, 1, 5, 8 // dim), generator=g)
    x = codebook[pick].reshape(2, 1, 5, 8)  # rows made of centroids
    digits = vq.encode(x, codebook, torch.ones(1, 8), groups, bits)
    assert digits.dtype == torch.uint8 and int(digits.max()) < 2**bits
    assert torch.equal(vq.decode(digits, codebook, groups, bits), x)


def test_weighted_search_prefers_the_heavy_channel():
    codebook = torch.tensor([[0.0, 1.0], [1.0, 0.0], [-1.0, -1.0], [1.0, 1.0]])
    x = torch.tensor([0.55, 0.55]).view(1, 1, 1, 2)
    groups = torch.tensor([[0, 1]])
    heavy0 = vq.decode(
        vq.encode(x, codebook, torch.tensor([[10.0, 1.0]]), groups, 1), codebook, groups, 1
    )
    heavy1 = vq.decode(
        vq.encode(x, codebook, torch.tensor([[1.0, 10.0]]), groups, 1), codebook, groups, 1
    )
    assert heavy0.flatten().tolist() == [1.0, 1.0] or heavy0.flatten()[0] == 1.0
    assert heavy1.flatten()[1] == 1.0


def test_joint_codes_beat_scalar_codes_at_equal_bits_on_correlated_pairs():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6000, 1, generator=g)
    x = torch.cat([a, 0.9 * a + 0.3 * torch.randn(6000, 1, generator=g)], 1) / 4  # [N, 2]
    x = x.clamp(-1, 1)
    w = torch.ones_like(x)
    cb2 = vq.fit_codebook(x[:3000], w[:3000], 2)
    cb1 = nuq.fit_codebook(x[:3000].reshape(-1), 2)
    rows = x[3000:].view(1, 1, -1, 2)
    groups = torch.tensor([[0, 1]])
    e2 = vq.decode(vq.encode(rows, cb2, torch.ones(1, 2), groups, 2), cb2, groups, 2) - rows
    e1 = nuq.nuq_decode(nuq.nuq_encode(rows, cb1), cb1) - rows
    assert e2.square().mean() < 0.8 * e1.square().mean()


def test_fit_is_deterministic_and_refuses_too_few_vectors():
    x = torch.rand(500, 2, generator=torch.Generator().manual_seed(1)) * 2 - 1
    w = torch.ones_like(x)
    assert torch.equal(vq.fit_codebook(x, w, 2, seed=3), vq.fit_codebook(x, w, 2, seed=3))
    with pytest.raises(KvqError, match="cannot fit"):
        vq.fit_codebook(x[:10], w[:10], 2)
    with pytest.raises(KvqError, match="centroids"):
        vq.check_dims(4, 4)


@pytest.mark.parametrize(
    "dim,layout", [(2, "pairs"), (2, "neighbours"), (4, "pairs"), (4, "shuffled")]
)
def test_decode_puts_each_centroid_coordinate_on_its_channel(dim, layout):
    """decode == its definition (a scatter): channel groups[g, j] of a row holds coordinate j
    of the centroid that group's digits name, for the calibrator's two layouts (RoPE pairs,
    neighbouring channels) and any other permutation."""
    g = torch.Generator().manual_seed(dim)
    bits, d = 2, 16
    codebook = torch.randn(2 ** (bits * dim), dim, generator=g).half()
    if layout == "shuffled":
        groups = torch.randperm(d, generator=g).view(d // dim, dim)
    else:
        groups = vq.channel_groups(d, dim, layout == "pairs")
    digits = torch.randint(0, 2**bits, (2, 3, 5, d), generator=g, dtype=torch.uint8)
    named = digits.long().view(2, 3, 5, d // dim, dim)
    idx = sum(named[..., j] << (j * bits) for j in range(dim))  # [2, 3, 5, G]
    want = torch.empty(2, 3, 5, d)
    want[..., groups.reshape(-1)] = codebook.float()[idx].reshape(2, 3, 5, d)
    assert torch.equal(vq.decode(digits, codebook, groups, bits), want)


def test_decode_refuses_a_digit_past_a_short_codebook():
    groups = vq.channel_groups(4, 2, False)
    codebook = torch.zeros(10, 2)  # 10 of the 16 centroids 2 x 2 bits could name
    digits = torch.tensor([[[[1, 2, 3, 3]]]], dtype=torch.uint8)  # second group: 15
    with pytest.raises(KvqError, match="out of range"):
        vq.decode(digits, codebook, groups, 2)
    assert vq.decode(digits[..., :2].repeat(1, 1, 1, 2), codebook, groups, 2).shape == (1, 1, 1, 4)
