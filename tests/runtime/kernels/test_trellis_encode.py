"""The trellis append's Viterbi search as one Triton launch (`trellis_encode`): the same
digits as the torch search (`kvq.quant.trellis.encode`) for every digit width, with
weightless coordinates (the exact exceptions' holes), rows in chunks, the dispatch, and
windows the kernel leaves to torch."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from kvq.quant import trellis
from kvq.runtime.kernels.append import _trellis_triton
from kvq.runtime.kernels.append import trellis as te
from tests.runtime.kernels.helpers import compile_in_child
from tests.runtime.kernels.test_decode_attention import DEVICE


def _problem(bits, window, shape=(3, 2, 64), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 0.6).clamp(-1, 1)
    w = torch.rand(*shape, generator=g)
    w[..., 5] = 0.0  # a hole: an exact exception, its level free
    table = torch.rand(1 << window, generator=g) * 2 - 1
    return x, w, table


def _error(x, w, table, digits, bits, window):
    return (w * (trellis.decode(digits.cpu(), table, bits, window) - x).square()).sum().item()


@pytest.mark.parametrize("layout", [(4, 12), (3, 12), (2, 12), (1, 12), (2, 8)])
def test_digits_are_the_torch_search(layout):
    """Every width auto writes (12-bit states) and a short window: the kernel's digits are
    the torch search's, element for element, and the path is a real search (its error
    below a greedy per-coordinate pick's)."""
    bits, window = layout
    x, w, table = _problem(bits, window)
    want = trellis.encode(x, w, table, bits, window)
    got = te.trellis_encode_triton(x.to(DEVICE), w.to(DEVICE), table, bits, window).cpu()
    assert got.dtype == torch.uint8 and got.shape == x.shape
    if DEVICE == "cpu":  # the interpreter: the same float operations, the same digits
        assert torch.equal(got, want)
    else:  # CUDA may fuse the level cost's multiply-add: near-ties may go the other way
        assert (got == want).float().mean() > 0.98
        ours, theirs = (_error(x, w, table, d, bits, window) for d in (got, want))
        assert abs(ours - theirs) <= 1e-5 * theirs
    greedy = torch.zeros_like(want)  # each digit picked alone against the previous ones
    for i in range(x.shape[-1]):
        best = None
        for c in range(1 << bits):
            greedy[..., i] = c
            err = (w[..., : i + 1] * (trellis.decode(greedy[..., : i + 1], table, bits, window)
                                      - x[..., : i + 1]).square()).sum(-1)  # fmt: skip
            best = (err, torch.full_like(err, c, dtype=torch.uint8)) if best is None else (
                torch.minimum(best[0], err), torch.where(err < best[0], c, best[1]))  # fmt: skip
        greedy[..., i] = best[1]
    assert _error(x, w, table, got, bits, window) < _error(x, w, table, greedy, bits, window)


def test_rows_in_chunks_give_the_same_digits(monkeypatch):
    """A prefill's rows go through the kernel in chunks under the scratch budget."""
    x, w, table = _problem(4, 12, shape=(5, 48), seed=1)
    whole = te.trellis_encode_triton(x, w, table, 4, 12)
    monkeypatch.setattr(te, "SCRATCH_BYTES", 2 * 48 * 256)  # two rows a launch
    launches = []
    launch = _trellis_triton.launch
    monkeypatch.setattr(_trellis_triton, "launch", lambda *a: launches.append(1) or launch(*a))
    assert torch.equal(te.trellis_encode_triton(x, w, table, 4, 12), whole)
    assert len(launches) == 3


def test_dispatch_and_wide_windows(monkeypatch):
    """`trellis_encode` takes the kernel on the Triton backend and the torch search on the
    reference; states wider than 12 bits (2^16 costs a program) stay in torch."""
    launches = []
    launch = _trellis_triton.launch
    monkeypatch.setattr(_trellis_triton, "launch", lambda *a: launches.append(a[-1]) or launch(*a))
    x, w, table = _problem(2, 8, shape=(2, 32))
    ref = te.trellis_encode(x, w, table, 2, 8, backend="reference")
    assert not launches
    assert torch.equal(te.trellis_encode(x, w, table, 2, 8, backend="triton"), ref)
    assert launches == [8]
    x, w, table = _problem(4, 16, shape=(1, 16))
    wide = te.trellis_encode(x, w, table, 4, 16, backend="triton")
    assert launches == [8] and torch.equal(wide, trellis.encode(x, w, table, 4, 16))


# (digit bits, head_dim): auto's 4-, 3- and 2-bit rows at Gemma 3's head_dim, 12-bit states
COMPILES = [(4, 256), (3, 256), (2, 256)]


def _compile(job) -> dict:
    from kvq.runtime.kernels.offline.cubin import compile_offline

    bits, d = job
    q = 1 << (12 - bits)
    args = dict(x=torch.empty(16, d), w=torch.empty(16, d), tab=torch.empty(4096),
                back=torch.empty(16, d, q, dtype=torch.uint8),
                out=torch.empty(16, d, dtype=torch.uint8), D=d, BITS=bits, WINDOW=12)  # fmt: skip
    res = compile_offline(_trellis_triton.viterbi_kernel, (), args, options={"num_warps": 8})
    step = max(res.loops, key=lambda body: sum(body.values()))  # the forward pass
    return {"registers": res.registers, "stack": res.stack_bytes, "step": sum(step.values()),
            "loops": len(res.loops)}  # fmt: skip


def test_the_search_compiles_for_sm90_without_spills():
    """sm_90 (no GPU needed): 8 warps hold the 4096 costs without spilling, a step of the
    forward pass issues under 200 instructions per warp (the torch search: 2 launches a
    step), and the trace back is a loop of its own."""
    for (bits, _), row in zip(COMPILES, compile_in_child(__file__, COMPILES), strict=True):
        assert row["stack"] == 0 and row["registers"] <= 128, (bits, row)
        assert row["step"] < 200 and row["loops"] == 2, (bits, row)


if __name__ == "__main__":  # the child process of the compile test
    print(json.dumps([_compile(tuple(j)) for j in json.loads(sys.argv[1])]))
