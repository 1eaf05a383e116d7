"""Static FP8 / INT8 K/V (per tensor, per KV head) and dynamic per-token FP8: codecs,
the cache on tiny models, the Triton kernels against the reference (interpreted)."""

import pytest
import torch

from kvq.errors import KvqError
from kvq.models.adapters import get_adapter
from kvq.quant import affine, fp8
from kvq.quant.schemes import CachePolicy, LayerPolicy, QuantScheme, named_policy
from kvq.runtime.cache import build_cache, unit_scales
from kvq.runtime.codecs import make_codec
from kvq.runtime.packed import ChunkDecoder, decode_packed
from tests.conftest import make_tiny_model


def _static(fmt, axis, scale_dtype="float32"):
    if fmt == "int8":
        return QuantScheme("int", 8, axis=axis, symmetric=True, lifetime="static",
                           scale_dtype=scale_dtype)  # fmt: skip
    return QuantScheme("fp8", 8, axis=axis, symmetric=True, lifetime="static",
                       scale_dtype=scale_dtype, fp8_format=fmt)  # fmt: skip


def _rows(b=2, h=3, t=11, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, t, d, generator=g) * torch.tensor([0.5, 4.0, 40.0])[:h, None, None]
    return x


def _scale(x, fmt, axis):
    amax = x.abs().amax(dim=(0, 2, 3)) if axis == "head" else x.abs().amax().reshape(1)
    if fmt == "int8":
        return affine.symmetric_qparams(amax, 8, torch.float32)
    return fp8.fp8_scale(amax, fmt)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "int8"])
@pytest.mark.parametrize("axis", ["tensor", "head"])
def test_static_codec_is_the_shared_quantizer(fmt, axis):
    x = _rows()
    scale = _scale(x, fmt, axis)
    codec = make_codec(_static(fmt, axis), 32, torch.float32, {"scale": scale}, "layers.0.key")
    rows, flat = codec.encode(x)
    assert rows["codes"].dtype == torch.uint8 and rows["codes"].shape == x.shape
    s = scale.expand(3) if axis == "tensor" else scale
    s = s[None, :, None, None]
    if fmt == "int8":
        want = affine.symmetric_decode(affine.symmetric_encode(x, s, 8), s)
    else:
        want = fp8.fp8_decode(fp8.fp8_encode(x, s, fmt), s)
    got = decode_packed(codec.packed(rows, flat))
    assert torch.equal(got, want)  # bit-exact with the quantizers calibration measures
    # the reference's chunk decoder reads the same rows (fp32 fma: within an ulp)
    dec = ChunkDecoder(codec.packed(rows, flat), pairs=True)
    chunk = dec.to_channels(dec.decode(0, x.shape[2]))
    torch.testing.assert_close(chunk, want, rtol=1e-6, atol=0)
    assert codec.static == {"scale": scale}  # what the ledger counts: the stored tensor


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_packed_rows_name_their_format_without_a_device_read(fmt):
    """Every decode step packs the rows again: a static codec hands out the same [H]
    scale and the format's one table each time, so the kernel's key fold is built once and
    the planned path tells the format by the table object (`fp8_format_of`)."""
    from kvq.runtime.codecs.fp8 import fp8_format_of, fp8_table

    x = _rows()
    codec = make_codec(_static(fmt, "tensor"), 32, torch.float32,
                       {"scale": _scale(x, fmt, "tensor")}, "layers.0.key")  # fmt: skip
    rows, flat = codec.encode(x)
    first, again = codec.packed(rows, flat), codec.packed(rows, flat)
    assert first.scale is again.scale and first.table is again.table
    assert first.table is fp8_table(fmt, "cpu") and fp8_format_of(first.table) == fmt
    assert fp8_format_of(first.table.clone()) is None  # another table: the general kernel


def test_dynamic_fp8_codec_scales_each_row():
    x = _rows()
    scheme = named_policy("fp8-e4m3-dynamic", 1).layers[0].key
    codec = make_codec(scheme, 32, torch.float32, {}, "layers.0.key")
    rows, flat = codec.encode(x)
    assert rows["scale"].shape == (2, 3, 11, 1) and rows["scale"].dtype == torch.float32
    want = fp8.fp8_decode(fp8.fp8_encode(x, rows["scale"], "e4m3"), rows["scale"])
    assert torch.equal(decode_packed(codec.packed(rows, flat)), want)
    # the row maximum lands on the format's maximum
    codes = rows["codes"].view(torch.float8_e4m3fn).float().abs().amax(-1)
    assert torch.equal(codes, torch.full_like(codes, 448.0))


@pytest.mark.parametrize(
    "scale, axis, match",
    [
        (torch.ones(2), "tensor", r"per-tensor scale must be \[1\]"),
        (torch.ones(1, 3), "head", r"per-head scale must be \[H_kv\]"),
        (torch.tensor([float("nan")]), "tensor", "NaN or Inf"),
        (torch.tensor([0.0]), "tensor", "positive"),
        (torch.tensor([1e37]), "tensor", "overflows float32"),
    ],
)
def test_bad_static_scales_are_refused(scale, axis, match):
    with pytest.raises(KvqError, match=match):
        make_codec(_static("e4m3", axis), 32, torch.float32, {"scale": scale}, "layers.0.key")
    with pytest.raises(KvqError, match="no layers.0.key.scale"):
        make_codec(_static("e4m3", axis), 32, torch.float32, {}, "layers.0.key")


def test_static_int_per_head_must_be_symmetric():
    scheme = QuantScheme("int", 8, axis="head", lifetime="static", scale_dtype="float32")
    with pytest.raises(KvqError, match="must be symmetric"):
        make_codec(scheme, 32, torch.float32, {"scale": torch.ones(3)}, "layers.0.key")


# --- in the cache -------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    return make_tiny_model(request.param)


def _per_head_cache(model, fmt, backend="reference"):
    ad = get_adapter(model)
    info = ad.info
    scheme = _static(fmt, "head")
    layer = LayerPolicy(key=scheme, value=scheme, key_stage="post-rope")
    policy = CachePolicy("static", (layer,) * info.num_layers)
    g = torch.Generator().manual_seed(1)
    state = {
        f"layers.{i}.{p}.scale": (torch.rand(info.num_kv_heads, generator=g) + 0.5) * 0.05
        for i in range(info.num_layers)
        for p in ("key", "value")
    }
    cache = build_cache(model, policy, state, ad, backend)
    return cache, state


def _ids(n, b=2, seed=0):
    return torch.randint(3, 200, (b, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
@pytest.mark.parametrize("name", ["fp8-e4m3", "fp8-e5m2", "fp8-e4m3-dynamic"])
def test_named_fp8_policies_run_and_stay_close(model, name):
    ad = get_adapter(model)
    policy = named_policy(name, ad.info.num_layers, ad.info.head_dim)
    state = unit_scales(policy)
    if name == "fp8-e4m3-dynamic":
        assert state == {}
    else:
        assert all(float(t) == 1.0 and t.shape == (1,) for t in state.values())
        assert len(state) == 2 * ad.info.num_layers
    ids = _ids(16)
    ref = model(ids).logits
    cache = build_cache(model, policy, state, ad)
    got = model(ids, cache=cache).logits
    # E5M2 keeps 2 mantissa bits (12.5% steps) against E4M3's 3
    assert (got - ref).abs().max() < (0.3 if "e5m2" in name else 0.1) * ref.abs().max()
    ledger = cache.nbytes()
    assert ledger.codes == ledger.fp16_bytes // 2  # one byte per element
    if "dynamic" in name:  # a float32 scale per (token, head)
        assert ledger.qparams == 2 * ledger.fp16_bytes // ad.info.head_dim
    else:  # the unit scales, counted like calibrated ones
        assert ledger.qparams == sum(t.nbytes for t in state.values())


@torch.no_grad()
@pytest.mark.parametrize("fmt", ["e4m3", "int8"])
def test_static_per_head_cache_counts_its_scales(model, fmt):
    cache, state = _per_head_cache(model, fmt)
    model(_ids(12), cache=cache)
    ledger = cache.nbytes()
    assert ledger.qparams == sum(t.nbytes for t in state.values())
    assert ledger.codes == ledger.fp16_bytes // 2


@torch.no_grad()
@pytest.mark.parametrize("fmt", ["e4m3", "int8"])
def test_triton_append_and_decode_match_the_reference(model, fmt, triton_decode_diffs):
    """Per-head static scales: Triton append writes the same bytes as the torch encode
    (layer 0), and every interpreted decode-kernel call matches the reference."""
    diffs = triton_decode_diffs
    ids = _ids(10, seed=3)
    stored = {}
    for backend in ("reference", "triton"):
        cache, _ = _per_head_cache(model, fmt, backend)
        model(ids[:, :8], cache=cache)
        for i in range(8, 10):
            model(ids[:, i : i + 1], cache=cache)
        stored[backend] = cache.layers[0].state.main.rows()
    for name, t in stored["reference"].items():
        assert torch.equal(stored["triton"][name], t), name
    assert diffs and max(diffs) < 2e-5


@torch.no_grad()
def test_triton_decode_of_dynamic_fp8_matches_reference(model, triton_decode_diffs):
    diffs = triton_decode_diffs
    ad = get_adapter(model)
    policy = named_policy("fp8-e4m3-dynamic", ad.info.num_layers, ad.info.head_dim)
    cache = build_cache(model, policy, {}, ad, "triton")
    ids = _ids(9, seed=4)
    model(ids[:, :8], cache=cache)
    model(ids[:, 8:9], cache=cache)
    assert diffs and max(diffs) < 2e-5
