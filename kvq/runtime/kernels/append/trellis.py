"""Trellis appends: the Viterbi search of each new row (`kvq.quant.trellis.encode`).

`trellis_encode_reference` is the torch search (a few torch ops per coordinate: on a GPU,
about 2 x D launches per append and layer side, the step time of a trellis cache);
`trellis_encode_triton` runs it as one launch, a program per row (`_trellis_triton`), with
the same arithmetic in the same order, so the digits agree; `trellis_encode(...,
backend=None)` dispatches through `resolve_backend` (Triton for CUDA tensors).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.quant import trellis
from kvq.quant.qparams import check_finite
from kvq.runtime.kernels.backend import resolve_backend

# the largest state the kernel searches: 2^window costs per program in registers
MAX_WINDOW = 12
# scratch of the search's choices per launch (D x 2^(window - bits) bytes a row): a prefill's
# rows go in chunks under it
SCRATCH_BYTES = 64 << 20


def trellis_encode_reference(x: Tensor, weight: Tensor, table: Tensor, bits: int,
                             window: int) -> Tensor:  # fmt: skip
    """x [..., D] normalised values, weight broadcastable to x -> uint8 digits [..., D]."""
    return trellis.encode(x, weight, table, bits, window)


def trellis_encode_triton(x: Tensor, weight: Tensor, table: Tensor, bits: int,
                          window: int) -> Tensor:  # fmt: skip
    """`trellis_encode_reference` as one Triton launch (windows up to MAX_WINDOW bits;
    wider ones take the reference)."""
    trellis.check_window(bits, window)
    if window > MAX_WINDOW:
        return trellis_encode_reference(x, weight, table, bits, window)
    check_finite(x, "normalised input")
    from kvq.runtime.kernels.append import _trellis_triton

    shape = x.shape
    rows = x.reshape(-1, shape[-1]).float().contiguous()
    w = weight.float().expand(shape).reshape(-1, shape[-1]).contiguous()
    out = torch.empty(rows.shape, dtype=torch.uint8, device=x.device)
    if rows.numel():
        q = 1 << (window - bits)
        step = max(1, SCRATCH_BYTES // (shape[-1] * q))
        back = torch.empty((min(step, rows.shape[0]), shape[-1], q), dtype=torch.uint8,
                           device=x.device)  # fmt: skip
        tab = table.float().to(x.device).contiguous()
        for i in range(0, rows.shape[0], step):
            _trellis_triton.launch(rows[i : i + step], w[i : i + step], tab, back,
                                   out[i : i + step], bits, window)  # fmt: skip
    return out.view(shape)


def trellis_encode(x: Tensor, weight: Tensor, table: Tensor, bits: int, window: int,
                   backend: str | None = None) -> Tensor:  # fmt: skip
    """The Viterbi digits of x on `backend` (None: `KVQ_BACKEND`, else Triton for CUDA
    tensors, the reference elsewhere)."""
    if resolve_backend(backend, x.device) == "triton":
        return trellis_encode_triton(x, weight, table, bits, window)
    return trellis_encode_reference(x, weight, table, bits, window)
