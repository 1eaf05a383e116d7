"""The Viterbi search of trellis appends as one Triton launch (`trellis_encode`).

One program per row: the costs of the 2^window states live in registers, and each of the
row's D steps takes, per state, the least of its 2^bits predecessors (remembering which,
a byte per state group in a scratch buffer), then adds the level costs of the new digit;
the path is traced back from the least final cost. The same arithmetic, in the same
order, as `kvq.quant.trellis._search_few` (ties: the lowest leaving digit, the first
state), so the digits agree with the torch search.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def viterbi_kernel(x, w, tab, back, out, D: tl.constexpr, BITS: tl.constexpr,
                   WINDOW: tl.constexpr):  # fmt: skip
    """x, w [R, D] float32 (normalised values, search weights; rows contiguous), tab [2^WINDOW]
    float32 levels, back [R, D, Q] uint8 scratch (Q = 2^(WINDOW - BITS)), out [R, D] uint8
    digits. State s = older x K + c (c the newest digit, K = 2^BITS); its predecessors are
    older + j x Q for the K values j of the digit that leaves."""
    r = tl.program_id(0).to(tl.int64)
    S: tl.constexpr = 1 << WINDOW
    K: tl.constexpr = 1 << BITS
    Q: tl.constexpr = S // K
    levels = tl.load(tab + tl.arange(0, S))  # [S]
    squares = levels * levels
    s = tl.arange(0, S)
    cost = tl.where(s == 0, 0.0, float("inf"))  # before the row: the all-zero state
    x_row, w_row = x + r * D, w + r * D
    back_row = back + r * D * Q
    for i in tl.range(0, D):
        wi = tl.load(w_row + i)
        wx = -2.0 * wi * tl.load(x_row + i)
        best, leaving = tl.min(tl.reshape(cost, (K, Q)), axis=0, return_indices=True)  # [Q]
        tl.store(back_row + i * Q + tl.arange(0, Q), leaving.to(tl.uint8))
        err = squares * wi + levels * wx  # [S]: the level cost of each new state
        cost = tl.reshape(tl.reshape(err, (Q, K)) + best[:, None], (S,))
    state = tl.argmin(cost, axis=0).to(tl.int32)
    for n in tl.range(0, D):
        i = D - 1 - n
        tl.store(out + r * D + i, (state & (K - 1)).to(tl.uint8))
        older = state >> BITS
        state = older + tl.load(back_row + i * Q + older).to(tl.int32) * Q


def launch(x, w, table, back, out, bits: int, window: int) -> None:
    rows, d = x.shape
    warps = 8 if window >= 12 else 4
    viterbi_kernel[(rows,)](x, w, table, back, out, D=d, BITS=bits, WINDOW=window,
                           num_warps=warps)  # fmt: skip


__all__ = ["launch", "triton", "viterbi_kernel"]
