"""vLLM's TurboQuant presets (`vllm:turboquant_*`): the codebook against values from an
independent run of vLLM's algorithm, the key bucketing and norm correction, the value
encoder against a float32 transcription, the boundary layers, the caches through
generate with their storage, the Triton refusal by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvq.engines.formats import engine_policy, parse
from kvq.errors import KvqError
from kvq.quant import turboquant
from kvq.quant.schemes import FULL_PRECISION, turboquant_boundary
from kvq.runtime.codecs import make_codec
from tests.conftest import make_tiny_model, tiny_tokenizer
from tests.engines.helpers import generate_through

# vLLM's centroids.py iteration re-run apart from kvq (docs/ research note), as float32
LEVELS_128_3 = [0.02165369503200054, 0.06679026037454605, 0.11872146278619766,
                0.19006584584712982]  # fmt: skip
LEVELS_128_4 = [0.011351509019732475, 0.034306857734918594, 0.058060530573129654,
                0.08330143988132477, 0.11103852838277817, 0.14300189912319183,
                0.18282662332057953, 0.2413817048072815]  # fmt: skip
LEVELS_256_3 = [0.015311474911868572, 0.04722784459590912, 0.08394875377416611,
                0.13439685106277466]  # fmt: skip


@pytest.mark.parametrize(
    "d, bits, upper", [(128, 3, LEVELS_128_3), (128, 4, LEVELS_128_4), (256, 3, LEVELS_256_3)]
)
def test_the_codebook_is_vllms(d, bits, upper):
    c = turboquant.levels(d, bits)
    assert c.dtype == torch.float32 and c.tolist() == [-x for x in upper[::-1]] + upper
    assert torch.equal(turboquant.midpoints(d, bits), (c[:-1] + c[1:]) / 2)


def test_keys_bucket_ties_up_and_decode_norm_corrected():
    d, bits = 64, 4
    mids = turboquant.midpoints(d, bits)
    rot = turboquant.rotation(d)
    torch.testing.assert_close(rot @ rot, torch.eye(d), rtol=0, atol=1e-6)
    # a coordinate on a midpoint goes to the upper level; below it, to the lower
    j = torch.arange(d) % len(mids)
    on = mids[j]  # [D]
    assert torch.equal(turboquant.bucket(on, bits).long(), j + 1)
    below = torch.nextafter(on, torch.tensor(-1.0))
    assert torch.equal(turboquant.bucket(below, bits).long(), j)
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(2)) * 3
    index, norm = turboquant.encode_keys(x, bits)
    y = (x / (torch.linalg.vector_norm(x, dim=-1, keepdim=True) + turboquant.NORM_EPS)) @ rot
    assert torch.equal(index, turboquant.bucket(y, bits)) and norm.dtype == torch.float16
    assert torch.equal(norm, torch.linalg.vector_norm(x, dim=-1, keepdim=True).half())
    # decode: c / sqrt(sum c^2 + 1e-16) * n, turned back
    c = turboquant.levels(d, bits)[index.long()]
    want = (c / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16) * norm.float()) @ rot
    assert torch.equal(turboquant.decode_keys(index, norm, bits), want)
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(64, d, generator=g)
    for b, limit in ((4, 0.15), (3, 0.25)):
        err = (turboquant.decode_keys(*turboquant.encode_keys(rows, b), b) - rows).norm()
        assert err / rows.norm() < limit


def test_values_match_a_float32_transcription():
    """(v - min) / scale + 0.5, floored: ties round up; fp16 scale and minimum."""
    codes, scale, lo = turboquant.encode_values(torch.tensor([[0.0, 0.1, 0.3, 3.0]]), 4)
    assert codes.tolist() == [[0, 1, 2, 15]] and scale.dtype == lo.dtype == torch.float16
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(50, 64, generator=g) * 4 + 1, torch.zeros(2, 64)])
    f = np.float32
    xs = x.numpy()
    for bits, top in ((4, 15), (3, 7)):
        mn = xs.min(-1, keepdims=True)
        s = np.maximum((xs.max(-1, keepdims=True) - mn) / f(top), f(1e-8)).astype(f)
        ref = np.clip(np.trunc((xs - mn) / s + f(0.5)), 0, top).astype(np.uint8)
        codes, scale, lo = turboquant.encode_values(x, bits)
        assert np.array_equal(codes.numpy(), ref)
        assert np.array_equal(scale.numpy(), s.astype(np.float16))
        assert np.array_equal(lo.numpy(), mn.astype(np.float16))


def test_the_first_and_last_two_layers_stay_unquantized():
    assert turboquant_boundary(32) == {0, 1, 30, 31}
    assert turboquant_boundary(4) == {0, 1, 2, 3}
    assert turboquant_boundary(3) == {0, 2}
    policy = engine_policy("vllm:turboquant_k3v4_nc", 18, 256)
    exact = [i for i, lp in enumerate(policy.layers) if lp.key == lp.value == FULL_PRECISION]
    assert exact == [0, 1, 16, 17]
    assert parse("vllm:turboquant_k8v4").key.scheme.format == "fp8"  # FP8 keys, scale 1
    with pytest.raises(KvqError, match="power-of-two head_dim"):
        engine_policy("vllm:turboquant_4bit_nc", 8, 96)


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory):
    """A tiny Gemma 3 with six layers: two of them quantized under TurboQuant."""
    out = tmp_path_factory.mktemp("tiny-gemma3-6")
    types = ["sliding_attention", "full_attention"] * 3
    make_tiny_model("gemma3", num_hidden_layers=6, layer_types=types).save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


@pytest.mark.parametrize(
    "preset, bits", [("turboquant_k8v4", (8, 4)), ("turboquant_4bit_nc", (4, 4)),
                     ("turboquant_k3v4_nc", (3, 4)), ("turboquant_3bit_nc", (3, 3))]
)  # fmt: skip
def test_presets_run_through_generate_and_store_their_bits(six_layers, preset, bits):
    model, cache = generate_through(six_layers, f"vllm:{preset}")
    # 4 boundary layers in the model's dtype, 2 quantized: K codes + an fp16 norm (FP8:
    # codes), V codes + fp16 scale and minimum (+ the FP8 keys' unit scales: rel=1e-3)
    d, (k, v), full = model.config.head_dim, bits, 8 * model.dtype.itemsize
    quantized = (k + (16 if k < 8 else 0) / d + v + 32 / d) / 2
    ledger = cache.nbytes()
    assert ledger.total / ledger.fp16_bytes == pytest.approx(
        (4 * full + 2 * quantized) / (6 * 16), rel=1e-3
    )


def test_rotated_keys_decode_on_the_reference_only():
    from kvq.runtime.kernels.decode.attention import decode_path
    from kvq.runtime.kernels.decode.segments import Segment

    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 2, 40, 64, generator=g) for _ in range(2))  # [B, H_kv, T, D]
    q = torch.randn(1, 4, 1, 64, generator=g)  # [B, H_q, Q, D]
    layer = engine_policy("vllm:turboquant_4bit_nc", 8, 64).layers[3]
    kc, vc = (make_codec(s, 64, torch.float32, {}, "x") for s in (layer.key, layer.value))
    seg = Segment(kc.packed(*kc.encode(k)), vc.packed(*vc.encode(v)))
    path = decode_path(q, [seg], None, backend="auto", device="cuda")
    assert path.kernel == "reference" and "rotated rows" in path.reason
    torch.testing.assert_close(
        kc.decode(*kc.encode(k)), turboquant.decode_keys(*turboquant.encode_keys(k, 4), 4)
    )
