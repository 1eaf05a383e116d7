"""Trellis codecs: NUQ's normalisers and exceptions, trellis dense codes, refusals, and
tables shared by layers held and counted once."""

import pytest
import torch

from kvq.errors import KvqError
from kvq.quant import trellis
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs import make_codec
from kvq.runtime.kernels.decode.attention import Segment, decode_path
from kvq.runtime.packed import decode_packed
from tests.conftest import nuq_key_state

H, D, WINDOW = 2, 16, 6


def _trellis_state(bits, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.rand(400, D, generator=g) * 2 - 1
    return {
        "trellis_table": trellis.fit_table(rows, torch.ones_like(rows), bits, WINDOW).half(),
        "trellis_weight": torch.rand(H, D, generator=g) + 0.5,
    }


def _key(bits=2, fraction=0.05):
    scheme = QuantScheme(
        format="trellis", bits=bits, axis="channel", lifetime="static",
        outlier_fraction=fraction, window=WINDOW,
    )  # fmt: skip
    state = nuq_key_state(max(bits, 2), H, D, fraction)
    del state["codebook"]
    return scheme, state | _trellis_state(bits)


def _value(bits=3, fraction=0.125):
    scheme = QuantScheme(
        format="trellis", bits=bits, axis="token", outlier_fraction=fraction, window=WINDOW
    )
    return scheme, _trellis_state(bits)


@pytest.mark.parametrize("make", [_key, _value])
def test_decode_keeps_exceptions_exact_and_bytes_equal_scalar_nuq(make):
    scheme, state = make()
    codec = make_codec(scheme, D, torch.float32, state, "layers.0.x")
    x = torch.randn(2, H, 9, D, generator=torch.Generator().manual_seed(2)) * 3
    rows, flat = codec.encode(x)
    assert rows["codes"].shape[-1] == D * scheme.bits // 8  # a NUQ row of this width
    out = codec.decode(rows, flat)
    assert out.shape == x.shape
    assert (out == x.half().float()).any()  # exceptions are stored exactly (fp16)
    assert (out - x).square().mean() / x.square().mean() < 0.3
    assert codec.row_spec(x) is None  # no in-place append kernel: `encode` (its search
    # a Triton launch on CUDA, `trellis_encode`)


def test_key_rows_are_the_shared_quantizers_search_and_decode():
    scheme, state = _key(fraction=0.0)
    state = {n: t for n, t in state.items() if n not in ("lower", "upper")}
    codec = make_codec(scheme, D, torch.float32, state, "layers.0.key")
    x = torch.randn(1, H, 5, D, generator=torch.Generator().manual_seed(3))
    rows, flat = codec.encode(x)
    scale, center = (state[n].float()[None, :, None] for n in ("scale", "center"))
    xn = ((x - center) / scale).clamp(-1, 1)
    table = state["trellis_table"]
    digits = trellis.encode(xn, state["trellis_weight"][None, :, None], table, 2, WINDOW)
    want = trellis.decode(digits, table, 2, WINDOW) * scale + center
    assert torch.allclose(codec.decode(rows, flat), want, atol=1e-6)
    packed = codec.packed(rows, flat)
    assert packed.kind == "trellis" and packed.window == WINDOW
    assert torch.allclose(decode_packed(packed), want, atol=1e-6)


def test_trellis_rows_take_the_general_kernel():
    scheme, state = _value()
    codec = make_codec(scheme, D, torch.float32, state, "layers.0.value")
    p = codec.packed(*codec.encode(torch.randn(1, H, 4, D)))
    path = decode_path(torch.randn(1, H, 1, D), [Segment(p, p)], backend="auto", device="cuda")
    assert path.kernel == "general"


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda s: s.pop("trellis_weight"), "no layers.0.value.trellis_weight"),
        (
            lambda s: s.update(trellis_table=torch.zeros(32)),
            r"trellis_table: expected shape \[64\]",
        ),
        (lambda s: s.update(trellis_weight=-torch.ones(H, D)), "non-negative"),
        (lambda s: s.update(trellis_weight=torch.ones(H, D + 1)), "trellis_weight: expected"),
        (lambda s: s.update(trellis_table=torch.full((64,), float("nan"))), "NaN"),
    ],
)
def test_mismatched_state_is_refused(edit, needle):
    scheme, state = _value()
    edit(state)
    with pytest.raises(KvqError, match=needle):
        make_codec(scheme, D, torch.float32, state, "layers.0.value")


def test_scheme_refuses_inconsistent_trellis_fields():
    with pytest.raises(KvqError, match="window"):
        QuantScheme(format="trellis", bits=2, axis="token")
    with pytest.raises(KvqError, match="multiple"):
        QuantScheme(format="trellis", bits=3, axis="token", window=8)
    with pytest.raises(KvqError, match="window"):
        QuantScheme(format="nuq", bits=2, axis="token", window=8)
    assert (
        "12-bit trellis"
        in QuantScheme(format="trellis", bits=3, axis="token", window=12).describe()
    )
