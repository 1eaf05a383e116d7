"""Bit-shift trellis codes (trellis-coded quantization, as in QTIP) over normalised rows.

A row of D normalised values x_0 .. x_{D-1} (NUQ's normalisation, `kvq.quant.nuq`) is
stored as D digits c_i of `bits` (k) bits: exactly a scalar k-bit row's payload, packed
with `kvq.quant.packing`. Coordinate i is not decoded from its own digit alone but from
the last n = window / k digits of the row, a sliding `window`-bit state of its bitstream:

    state_i = sum_{j < n} c_{i-j} << (k j)        (digits before the row count as 0)
    x_i ~ table[state_i]                           table: [2^window] levels

Neighbouring coordinates share n - 1 digits, so a row is a path through a trellis of
2^window states with 2^k branches each. Encoding is a Viterbi search for the path whose
levels have the least weighted squared error sum_i w_i (x_i - table[state_i])^2; decoding
is one gather per coordinate (each state is a function of n digits), as parallel as NUQ's
lookup. Why: a scalar code at k bits is fixed to 2^k levels per coordinate, while the
trellis picks among 2^window levels along a path, which brings a fixed-rate code close to
the rate-distortion bound on near-Gaussian data (QTIP, arXiv 2406.11235: mean squared
error 0.069 at 2 bits with a 16-bit window against Lloyd-Max's 0.118 on i.i.d. Gaussians).

The table is fitted like a codebook (`fit_table`): Lloyd iterations that alternate the
Viterbi encode with a weighted mean of the values reaching each state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant.qparams import check_finite

WINDOW = 12  # state bits: 4096 levels, a multiple of 1, 2, 3 and 4 digit bits
MAX_WINDOW = 16
_CHUNK = 1 << 20  # trellis cells (rows x states) per encode chunk: 4 MiB of float32 costs
_FEW_ROWS = 8  # up to this many rows per search, ops are few rather than cheap per element


def check_window(bits: int, window: int) -> int:
    """Digits per state (window / bits); refuses unsupported combinations."""
    if not 1 <= bits <= 4:
        raise KvqError(f"trellis codes take 1-4 bits per element, got {bits}")
    if not bits < window <= MAX_WINDOW or window % bits:
        raise KvqError(
            f"a trellis window must be a multiple of the {bits} digit bits in "
            f"({bits}, {MAX_WINDOW}], got {window}"
        )
    return window // bits


def states(digits: Tensor, bits: int, window: int) -> Tensor:
    """digits [..., D] (integers < 2^bits) -> int64 states [..., D] (see the module doc)."""
    n = check_window(bits, window)
    c = digits.long()
    out = c.clone()
    for j in range(1, min(n, c.shape[-1])):
        out[..., j:] |= c[..., :-j] << (bits * j)
    return out


def decode(digits: Tensor, table: Tensor, bits: int, window: int) -> Tensor:
    """digits [..., D] -> normalised values float32 [..., D] = table[state]."""
    if table.numel() != 1 << window:
        raise KvqError(f"a {window}-bit trellis needs a table of {1 << window} levels")
    return table.float()[states(digits, bits, window)]


def encode(x: Tensor, weight: Tensor, table: Tensor, bits: int, window: int) -> Tensor:
    """Viterbi: x [..., D] normalised values, weight broadcastable to x (non-negative),
    table [2^window] -> uint8 digits [..., D] of the least weighted squared error path."""
    check_window(bits, window)
    check_finite(x, "normalised input")
    shape = x.shape
    rows = x.reshape(-1, shape[-1]).float()
    w = weight.float().expand(shape).reshape(-1, shape[-1])
    out = torch.empty(rows.shape, dtype=torch.uint8, device=x.device)
    step = max(1, _CHUNK >> window)
    for i in range(0, rows.shape[0], step):
        out[i : i + step] = _viterbi(rows[i : i + step], w[i : i + step], table, bits, window)
    return out.view(shape)


def _viterbi(x: Tensor, w: Tensor, table: Tensor, bits: int, window: int) -> Tensor:
    """x, w [R, D] -> digits uint8 [R, D]. State s = q * K + c (q: its older digits, c the
    newest); its predecessors are p = q + j * Q for the K values j of the digit that leaves.
    The cost of a level is w (x - t)^2 less w x^2, the same for every state of a step:
    w t^2 - 2 w x t. Costs lie [S, R] (states major), so the K predecessors of every state
    are K contiguous slabs."""
    r, d = x.shape
    k, q = 1 << bits, 1 << (window - bits)
    t = table.float().to(x.device)
    squares, levels = (t * t)[:, None], t[:, None]  # [S, 1]
    w, wx = w.T.contiguous(), (-2 * w * x).T.contiguous()  # [D, R]
    search = _search_few if r <= _FEW_ROWS else _search_many
    back, cost = search(squares, levels, w, wx, k, q)  # [D, Q, R] the leaving digit j
    state = cost.argmin(0)  # [R]
    digits = torch.empty((r, d), dtype=torch.uint8, device=x.device)
    rows = torch.arange(r, device=x.device)
    for i in range(d - 1, -1, -1):
        digits[:, i] = state & (k - 1)
        older = state >> bits
        state = older + back[i][older, rows].long() * q
    return digits


def _start(k: int, q: int, r: int, device) -> Tensor:
    cost = torch.full((k * q, r), float("inf"), device=device)
    cost[0] = 0.0  # the state before the row: all-zero digits
    return cost


def _search_many(squares, levels, w, wx, k: int, q: int) -> tuple[Tensor, Tensor]:
    """The forward pass for many rows: a running minimum over the K slabs, in buffers
    reused from step to step (torch's min with indices over a dim is ~30x slower per
    element on CPU, a masked fill as slow)."""
    (d, r), s = w.shape, k * q
    cost = _start(k, q, r, w.device)
    spare = torch.empty_like(cost)
    back = torch.zeros((d, q, r), dtype=torch.uint8, device=w.device)
    best = torch.empty((q, r), device=w.device)
    lower = torch.empty((q, r), dtype=torch.bool, device=w.device)
    mark = torch.empty((q, r), dtype=torch.uint8, device=w.device)
    for i in range(d):
        best.copy_(cost[:q])
        for j in range(1, k):  # predecessors q + j Q: keep the least, remember its j
            slab = cost[j * q : (j + 1) * q]
            torch.lt(slab, best, out=lower)
            # j rises, so the last j that lowered the minimum is the largest such j
            torch.maximum(back[i], torch.mul(lower.view(torch.uint8), j, out=mark), out=back[i])
            torch.minimum(best, slab, out=best)
        torch.mul(squares, w[i], out=spare).addcmul_(levels, wx[i])
        cost, spare = spare.view(q, k, r).add_(best[:, None]).view(s, r), cost
    return back, cost


def _search_few(squares, levels, w, wx, k: int, q: int) -> tuple[Tensor, Tensor]:
    """The forward pass for a few rows (an append): every step's level costs at once, then
    two ops a step (the op count, not the elements, is the cost here). The same arithmetic
    as `_search_many`, element for element."""
    (d, r), s = w.shape, k * q
    err = torch.mul(squares[None], w[:, None, :]).addcmul_(levels[None], wx[:, None, :])
    cost = _start(k, q, r, w.device)  # err: [D, S, R]
    back = torch.empty((d, q, r), dtype=torch.int64, device=w.device)
    best = torch.empty((q, r), device=w.device)
    for i in range(d):
        torch.min(cost.view(k, q, r), 0, out=(best, back[i]))
        cost = err[i].view(q, k, r).add_(best[:, None]).view(s, r)
    return back, cost


def fit_table(
    rows: Tensor,
    weights: Tensor,
    bits: int,
    window: int = WINDOW,
    seed: int = 0,
    max_rows: int = 2048,
    iters: int = 8,
) -> Tensor:
    """Weighted Lloyd iterations: rows, weights [N, D] (normalised values in [-1, 1],
    non-negative weights; 0 at exact exceptions) -> table float32 [2^window].

    Deterministic: the subsample and the initial table come from a generator seeded by
    `seed`. The initial levels are the rows' weighted quantiles in a random order of the
    states, so every state starts with a level the data reaches; a state no value reaches
    keeps its level."""
    check_window(bits, window)
    check_finite(rows, "trellis rows")
    check_finite(weights, "trellis weights")
    x, w = rows.float().clamp(-1.0, 1.0), weights.float()
    keep = w.sum(-1) > 0
    x, w = x[keep], w[keep]
    if x.shape[0] == 0:
        raise KvqError("no calibration rows with weight to fit a trellis table")
    gen = torch.Generator().manual_seed(seed)
    if x.shape[0] > max_rows:
        pick = torch.randperm(x.shape[0], generator=gen)[:max_rows]
        x, w = x[pick], w[pick]
    s = 1 << window
    flat_x, flat_w = x.reshape(-1), w.reshape(-1)
    order = flat_x.argsort()
    cdf = flat_w[order].cumsum(0)
    u = (torch.randperm(s, generator=gen).double() + 0.5) / s * float(cdf[-1])
    at = torch.searchsorted(cdf.double(), u).clamp_max(order.numel() - 1)
    table = flat_x[order][at].float()
    for _ in range(iters):
        st = states(encode(x, w, table, bits, window), bits, window).reshape(-1)
        num = torch.zeros(s).index_add_(0, st, flat_w * flat_x)
        den = torch.zeros(s).index_add_(0, st, flat_w)
        table = torch.where(den > 0, num / den.clamp_min(1e-30), table)
    return table.contiguous()


def check_table(table: Tensor, window: int, where: str) -> None:
    """Refuse a stored table of the wrong shape or with non-finite levels."""
    if tuple(table.shape) != (1 << window,):
        raise KvqError(
            f"{where}.trellis_table: expected shape [{1 << window}], found {list(table.shape)}"
        )
    check_finite(table.float(), f"{where}.trellis_table")
