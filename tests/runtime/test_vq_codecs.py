"""Vector-codebook codecs: NUQ's normalisers and exceptions, joint dense codes, refusals."""

import pytest
import torch

from kvq.errors import KvqError
from kvq.quant import vq
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs import make_codec
from kvq.runtime.codecs.nuq import NuqKeyCodec
from tests.conftest import nuq_key_state

H, D = 2, 16


def _vq_state(bits, dim, pairs, seed=0):
    g = torch.Generator().manual_seed(seed)
    vectors = torch.rand(4000, dim, generator=g) * 2 - 1
    return {
        "vq_codebook": vq.fit_codebook(vectors, torch.ones_like(vectors), bits).half(),
        "vq_groups": vq.channel_groups(D, dim, pairs).to(torch.int16),
        "vq_weight": torch.rand(H, D, generator=g) + 0.5,
    }


def _key(bits=2, dim=4, fraction=0.05):
    scheme = QuantScheme(
        format="vq", bits=bits, axis="channel", lifetime="static",
        outlier_fraction=fraction, vector_dim=dim,
    )  # fmt: skip
    state = nuq_key_state(bits if bits > 1 else 2, H, D, fraction)
    del state["codebook"]
    return scheme, state | _vq_state(bits, dim, True)


def _value(bits=3, dim=2, fraction=0.125):
    scheme = QuantScheme(
        format="vq", bits=bits, axis="token", outlier_fraction=fraction, vector_dim=dim
    )
    return scheme, _vq_state(bits, dim, False)


@pytest.mark.parametrize("make", [_key, _value])
def test_decode_keeps_exceptions_exact_and_bytes_equal_scalar_nuq(make):
    scheme, state = make()
    codec = make_codec(scheme, D, torch.float32, state, "layers.0.x")
    x = torch.randn(2, H, 9, D, generator=torch.Generator().manual_seed(2)) * 3
    rows, flat = codec.encode(x)
    assert rows["codes"].shape[-1] == D * scheme.bits // 8  # what a NUQ row of this width holds
    out = codec.decode(rows, flat)
    assert out.shape == x.shape
    exact = (out == x.half().float()).float().mean()  # exceptions are stored in fp16
    assert exact > 0
    err = (out - x).square().mean() / x.square().mean()
    assert err < 0.3
    assert codec.row_spec(x) is None  # no Triton append kernel: torch encodes


def test_key_rows_match_the_shared_quantizer():
    scheme, state = _key(fraction=0.0)
    state = {n: t for n, t in state.items() if n not in ("lower", "upper")}
    codec = make_codec(scheme, D, torch.float32, state, "layers.0.key")
    x = torch.randn(1, H, 5, D, generator=torch.Generator().manual_seed(3))
    rows, flat = codec.encode(x)
    xn = (x - state["center"].float()[None, :, None]) / state["scale"].float()[None, :, None]
    cb, groups = state["vq_codebook"].float(), state["vq_groups"].long()
    digits = vq.encode(xn, cb, state["vq_weight"], groups, 2)
    want = vq.decode(digits, cb, groups, 2)
    want = want * state["scale"].float()[None, :, None] + state["center"].float()[None, :, None]
    assert torch.allclose(codec.decode(rows, flat), want, atol=1e-6)
    assert isinstance(codec, NuqKeyCodec)  # the NUQ key machinery, joint dense codes


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda s: s.pop("vq_groups"), "no layers.0.value.vq_groups"),
        (lambda s: s.update(vq_codebook=torch.zeros(16, 2)), "vq_codebook: expected shape"),
        (lambda s: s.update(vq_groups=torch.zeros(8, 2, dtype=torch.int16)), "permutation"),
        (lambda s: s.update(vq_weight=-torch.ones(H, D)), "non-negative"),
        (lambda s: s.update(vq_codebook=torch.full((64, 2), float("nan"))), "NaN"),
    ],
)
def test_mismatched_state_is_refused(edit, needle):
    scheme, state = _value()
    edit(state)
    with pytest.raises(KvqError, match=needle):
        make_codec(scheme, D, torch.float32, state, "layers.0.value")


def test_scheme_refuses_inconsistent_vq_fields():
    with pytest.raises(KvqError, match="vector_dim"):
        QuantScheme(format="vq", bits=2, axis="token")
    with pytest.raises(KvqError, match="centroids"):
        QuantScheme(format="vq", bits=4, axis="token", vector_dim=4)
    with pytest.raises(KvqError, match="vector_dim"):
        QuantScheme(format="nuq", bits=2, axis="token", vector_dim=2)
