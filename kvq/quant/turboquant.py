"""vLLM's TurboQuant K/V cache presets: `--kv-cache-dtype turboquant_k8v4`,
`turboquant_4bit_nc`, `turboquant_k3v4_nc`, `turboquant_3bit_nc`.

Read from vllm-project/vllm `vllm/model_executor/layers/quantization/turboquant/`
(`config.py`: the presets and `get_boundary_skip_layers`; `centroids.py`: the codebook),
`vllm/v1/attention/ops/triton_turboquant_store.py` and `triton_turboquant_decode.py`:

- keys, "k8" (k8v4): FP8 E4M3 of the row as it is, no scale;
- keys, 3 or 4 bits ("_nc" presets): n = |k|, the unit row k / (n + 1e-8) turned by the
  orthonormal Hadamard matrix H / sqrt(D) (float32 matmul, no random signs), each
  coordinate coded as its bucket among the midpoints of a Lloyd-Max codebook for
  N(0, 1/D) (ties to the upper bucket); stored: the indices and fp16(n). Decoded with
  norm correction ("nc"): c = levels[index], k' = n * c / sqrt(sum c^2 + 1e-16), turned
  back (vLLM turns the query instead: the same in exact arithmetic);
- values, 4 or 3 bits: min/max per row, scale = max((max - min) / L, 1e-8) with L = 15
  or 7, code = clamp(floor((v - min) / scale + 0.5), 0, L); stored: codes, fp16(scale),
  fp16(min); decoded as code * scale + min;
- the first two and the last two attention layers of a dense model stay unquantized,
  whatever the user asks (n = min(2, layers // 2)).

The codebook is vLLM's iteration, in float64, then float32: 2^b levels spaced evenly over
[-3.5, 3.5] sigma, then Lloyd steps (cell edges the midpoints, outer edges +-10.5 sigma,
each level the cell's mean under the Gaussian by the trapezoid rule on 200 panels) until
no level moves by 1e-10 (the levels before that step are kept) or 200 steps (the 4-bit
books stop there). Earlier vLLM releases rotated by a random orthogonal matrix, then by
a Hadamard with per-layer signs, and integrated with scipy: kvq follows the pure-Hadamard,
trapezoid release. vLLM's first prefill chunk attends to the exact K/V (only later tokens
read the codes); kvq's cache gives every query the stored rows, the decode-time view.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
from torch import Tensor

from kvq.quant.qparams import check_finite
from kvq.quant.schemes import turboquant_head_dim  # the presets, boundary: schemes.py

NORM_EPS = 1e-8  # k / (|k| + eps)
CORRECTION_EPS = 1e-16  # c / sqrt(sum c^2 + eps)
VALUE_SCALE_FLOOR = 1e-8
_STEPS, _PANELS, _TOL = 200, 200, 1e-10  # Lloyd iterations, trapezoid panels, stop


def _trapezoid(f, a: float, b: float) -> float:
    h = (b - a) / _PANELS
    inner = sum(f(a + i * h) for i in range(1, _PANELS))
    return h * (0.5 * f(a) + inner + 0.5 * f(b))


@functools.cache
def levels(d: int, bits: int) -> Tensor:
    """[2^bits] float32 ascending: the Lloyd-Max levels for one coordinate of a unit row
    of dimension d (N(0, 1/d)), computed as vLLM computes them."""
    sigma = 1.0 / math.sqrt(d)

    def pdf(x: float) -> float:
        return math.exp(-0.5 * (x / sigma) ** 2) / (math.sqrt(2 * math.pi) * sigma)

    n, lo, hi = 1 << bits, -3.5 * sigma, 3.5 * sigma
    c = [lo + (i + 0.5) * (hi - lo) / n for i in range(n)]
    for _ in range(_STEPS):
        edges = [-10.5 * sigma] + [(c[i] + c[i + 1]) / 2 for i in range(n - 1)] + [10.5 * sigma]
        new = [
            _trapezoid(lambda x: x * pdf(x), a, b) / _trapezoid(pdf, a, b)
            for a, b in itertools.pairwise(edges)
        ]
        if max(abs(x - y) for x, y in zip(new, c, strict=True)) < _TOL:
            break
        c = new
    return torch.tensor(c, dtype=torch.float32)


@functools.cache
def midpoints(d: int, bits: int) -> Tensor:
    """[2^bits - 1] float32 bucket edges, (c[i] + c[i + 1]) / 2 in float32."""
    c = levels(d, bits)
    return (c[:-1] + c[1:]) / 2


@functools.cache
def rotation(d: int) -> Tensor:
    """[D, D] float32 H / sqrt(D): symmetric and orthonormal, its own inverse."""
    from kvq.calibrators.rotation import hadamard

    turboquant_head_dim(d)
    return (hadamard(d) / math.sqrt(d)).float()


def encode_keys(x: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (indices [..., D] uint8, norm [..., 1] float16)."""
    check_finite(x, "key rows")
    d = x.shape[-1]
    k = x.float()
    norm = torch.linalg.vector_norm(k, dim=-1, keepdim=True)
    y = (k / (norm + NORM_EPS)) @ rotation(d).to(k.device)
    return bucket(y, bits), norm.to(torch.float16)


def bucket(y: Tensor, bits: int) -> Tensor:
    """Rotated unit rows y [..., D] -> level indices uint8: #{j : y >= midpoint j}, a value
    on a midpoint going to the upper level."""
    mids = midpoints(y.shape[-1], bits).to(y.device)
    return torch.searchsorted(mids, y.contiguous(), right=True).to(torch.uint8)


def key_row_scale(index: Tensor, norm: Tensor, bits: int) -> Tensor:
    """[..., 1] float32 n / sqrt(sum c^2 + 1e-16): what each row's levels are multiplied by
    (norm correction), from its indices [..., D] and stored norm."""
    c = levels(index.shape[-1], bits).to(index.device)[index.long()]
    return norm.float() / torch.sqrt(c.square().sum(-1, keepdim=True) + CORRECTION_EPS)


def decode_keys(index: Tensor, norm: Tensor, bits: int) -> Tensor:
    """-> [..., D] float32, turned back: (c / sqrt(sum c^2 + 1e-16)) * n, in vLLM's order
    (the cache's lookup rows multiply c by n / sqrt(...): within an ulp of it)."""
    d = index.shape[-1]
    c = levels(d, bits).to(index.device)[index.long()]
    unit = c / torch.sqrt(c.square().sum(-1, keepdim=True) + CORRECTION_EPS)
    return (unit * norm.float()) @ rotation(d).to(index.device)


def encode_values(v: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """v [..., D] -> (codes [..., D] uint8, scale [..., 1] float16, min [..., 1] float16)."""
    check_finite(v, "value rows")
    top = (1 << bits) - 1
    x = v.float()
    lo = x.amin(dim=-1, keepdim=True)
    scale = ((x.amax(dim=-1, keepdim=True) - lo) / top).clamp_min(VALUE_SCALE_FLOOR)
    codes = torch.floor((x - lo) / scale + 0.5).clamp_(0, top)  # >= 0: round half up
    return codes.to(torch.uint8), scale.to(torch.float16), lo.to(torch.float16)


def decode_values(codes: Tensor, scale: Tensor, lo: Tensor) -> Tensor:
    return codes.float() * scale.float() + lo.float()
