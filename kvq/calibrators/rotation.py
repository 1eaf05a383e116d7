"""The `rotate` pass: a randomized Hadamard rotation of every KV head's values.

Values are quantized per token (one range per row), so a channel that runs ten times
wider than the others sets the step for all of them. A rotation spreads every channel's
energy over all channels: R = H diag(s) / sqrt(D) (H the Sylvester Hadamard matrix, s
random signs per layer and KV head) leaves a row's norm alone and flattens its channels
to near-Gaussian, and folded into v_proj/o_proj (`kvq.models.rotation`) it costs nothing
at run time: the cache just stores rotated values. Keys are left alone: stored before
RoPE, only 2x2 rotations within a RoPE pair would commute with the position rotation.

A head_dim that is not a power of two takes a random orthogonal matrix instead (QR of a
Gaussian matrix, signs fixed). Measured on Gemma 3 270M: see README "Low-bit caches".
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.calibrators.base import FitContext, PassResult
from kvq.calibrators.options import RotateOptions
from kvq.quant.schemes import named_policy


def hadamard(d: int) -> Tensor:
    """The Sylvester Hadamard matrix of order d (a power of two) [D, D] float64, +-1."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def random_rotation(d: int, gen: torch.Generator) -> Tensor:
    """R [D, D] float32, orthogonal: H diag(s) / sqrt(D), or QR of a Gaussian matrix when
    D is not a power of two."""
    if d & (d - 1) == 0:
        signs = torch.randint(0, 2, (d,), generator=gen, dtype=torch.float64) * 2 - 1
        return (hadamard(d) * signs / d**0.5).float()
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()  # Haar-distributed


def fit(ctx: FitContext) -> PassResult:
    """`layers.{i}.rotate.value` [H_kv, D, D] per layer; the cache layout is --layout, else
    the base artifact's, else fp16 (a quantizing pass runs after it in the chain)."""
    options: RotateOptions = ctx.options
    adapter = ctx.loaded.adapter
    adapter.check_values_rotatable()
    info = adapter.info
    policy = None
    if options.layout is not None or ctx.base is None:
        policy = named_policy(options.layout or "fp16", info.num_layers, info.head_dim)
    gen = torch.Generator().manual_seed(options.seed)
    tensors = {
        f"layers.{i}.rotate.value": torch.stack(
            [random_rotation(info.head_dim, gen) for _ in range(info.num_kv_heads)]
        )
        for i in range(info.num_layers)
    }
    kind = "randomized Hadamard" if info.head_dim & (info.head_dim - 1) == 0 else "random"
    return PassResult(policy, tensors, report={"rotation": kind})
