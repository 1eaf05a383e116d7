"""The planned decode path (kvq.runtime.kernels.planned_decode): every segment of a call in
one launch, split by the launch plan, plus at most one reduction; parity with the
reference under the interpreter, and what one call costs the host (launches, syncs,
allocations) under a torch dispatch counter."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs import make_codec
from kvq.runtime.kernels import planned_decode
from kvq.runtime.kernels.decode_attention import Segment, decode_attention_triton
from kvq.runtime.packed import PackedRows
from tests.runtime.kernels.test_decode_attention import (
    DEVICE,
    _check,
    _codec_segment,
    _data,
    _to,
)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


@pytest.fixture
def planned_calls(monkeypatch):
    """Counts the calls that took the planned path."""
    calls = []
    run = planned_decode.run_planned

    def spy(*args, **kwargs):
        calls.append(args)
        return run(*args, **kwargs)

    monkeypatch.setattr(planned_decode, "run_planned", spy)
    return calls


def _full(x: torch.Tensor) -> PackedRows:
    return PackedRows("full", x.shape[-1], x.clone())


def _layer_segments(kind, b, hkv, d, rows, sink=2, residual=5, seed=0):
    """What a layer hands attention: full-precision sink rows, packed main rows, the
    full-precision residual window."""
    k, v = _data(b, hkv, sink + rows + residual, d, seed)
    k = k + 2.0  # a common key offset: the folded key bias carries real weight
    kp, vp = _codec_segment(kind, k[:, :, sink : sink + rows], v[:, :, sink : sink + rows])
    segs = [Segment(kp, vp)]
    if sink:
        segs.insert(0, Segment(_full(k[:, :, :sink]), _full(v[:, :, :sink])))
    if residual:
        segs.append(Segment(_full(k[:, :, -residual:]), _full(v[:, :, -residual:])))
    return segs


@pytest.mark.parametrize("kind", ["int4-channel", "int8-channel-sym"])
@pytest.mark.parametrize("d, hq, hkv", [(64, 8, 2), (128, 4, 1)])
def test_sink_main_and_residual_in_one_launch_match_reference(kind, d, hq, hkv, planned_calls):
    segs = _layer_segments(kind, 2, hkv, d, rows=150, seed=3)
    _check(torch.randn(2, hq, 1, d) * 2, segs)
    assert len(planned_calls) == 1


def _per_token_segment(bits, group, k, v):
    """K and V per token in groups (the calibration-free int4 / int8 policies' layout)."""
    scheme = QuantScheme("int", bits, group_size=group)
    d = k.shape[-1]
    kc = make_codec(scheme, d, torch.float32, {}, "layers.0.key")
    vc = make_codec(scheme, d, torch.float32, {}, "layers.0.value")
    return Segment(kc.packed(*kc.encode(k)), vc.packed(*vc.encode(v)))


@pytest.mark.parametrize("bits, group, d", [(4, 32, 64), (4, 64, 256), (8, 16, 64)])
def test_per_token_group_keys_decode_like_values(bits, group, d, planned_calls):
    """Per-token key qparams cannot fold into the query: the kernel applies them to the
    decoded key tile, as it does the values'."""
    k, v = _data(2, 1, 130, d, seed=bits + group)
    main = _per_token_segment(bits, group, k[:, :, 2:], v[:, :, 2:])
    assert main.key.qaxis == "row"
    sink = Segment(_full(k[:, :, :2]), _full(v[:, :, :2]))
    _check(torch.randn(2, 4, 1, d) * 2, [sink, main])
    assert len(planned_calls) == 1


@pytest.mark.parametrize("rows", [1, 63, 64, 65, 300])
def test_split_boundaries_across_segments(rows, planned_calls):
    """Row counts around the 64-row tile: splits fall on tile boundaries of the segments
    laid end to end, and a split may start in one segment and end in another."""
    segs = _layer_segments("int4-channel", 1, 2, 64, rows=rows, sink=3, residual=7, seed=rows)
    _check(torch.randn(1, 4, 1, 64), segs)
    assert len(planned_calls) == 1


def test_two_query_positions_are_causal(planned_calls):
    segs = _layer_segments("int4-channel", 2, 1, 64, rows=70, seed=4)
    _check(torch.randn(2, 3, 2, 64), segs)  # MQA, Q = 2 (speculative decode)
    assert len(planned_calls) == 1


def test_full_precision_segments_alone(planned_calls):
    k, v = _data(2, 2, 90, 64, seed=6)
    _check(torch.randn(2, 4, 1, 64), [Segment(_full(k), _full(v))])
    assert len(planned_calls) == 1


@pytest.mark.parametrize("kind", ["int4-g16", "nuq4", "int2-int3"])  # 8 codes/group plane
def test_other_layouts_keep_the_general_kernel(kind, planned_calls):
    k, v = _data(1, 2, 40, 64, seed=7)
    kp, vp = _codec_segment(kind, k, v)
    _check(torch.randn(1, 4, 1, 64), [Segment(kp, vp)])
    assert not planned_calls


def test_one_split_writes_the_output_itself(monkeypatch):
    """A single split per work item normalises in the kernel: no partials, no reduction."""
    segs = _layer_segments("int4-channel", 1, 1, 64, rows=40, sink=0, residual=0)
    launches = _count_launches(monkeypatch)
    _check(torch.randn(1, 2, 1, 64), segs)
    assert launches == ["decode_splits_kernel"]


def _count_launches(monkeypatch) -> list[str]:
    names = []
    launch = planned_decode._Launcher.launch

    def counted(self, fn, grid, args, options):
        names.append(fn.__name__)
        return launch(self, fn, grid, args, options)

    monkeypatch.setattr(planned_decode._Launcher, "launch", counted)
    return names


ALLOCATING = ("empty", "empty_like", "empty_strided", "zeros", "zeros_like", "new_empty")
SYNCING = ("_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero")


class _Ops(TorchDispatchMode):
    """Every aten op the host code issues, by name (views included)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_one_call_costs_two_launches_no_sync_and_three_allocations(monkeypatch):
    """A decode call of a layer (sink, packed main rows, residual) at batch 4: the host
    launches the decode kernel and the reduction and nothing else, allocates the partial
    states and the output, and never waits on the device. The kernels themselves are
    stubbed during the count (the interpreter copies arguments with torch ops of its own,
    which a CUDA launch does not)."""
    segs = _to(_layer_segments("int4-channel", 4, 2, 64, rows=300, seed=9), DEVICE)
    q = torch.randn(4, 8, 1, 64, device=DEVICE)
    decode_attention_triton(q, segs, scaling=0.125)  # warm: compile, fold the key qparams
    names = []
    monkeypatch.setattr(
        planned_decode._Launcher, "launch", lambda self, fn, *a: names.append(fn.__name__)
    )
    with _Ops() as mode:
        decode_attention_triton(q, segs, scaling=0.125)
    ops = mode.ops
    allocations = sum(ops[n] for n in ALLOCATING)
    syncs = sum(ops[n] for n in SYNCING)
    compute = {n: c for n, c in ops.items() if n not in ALLOCATING and not _is_view(n)}
    assert names == ["decode_splits_kernel", "combine_splits_kernel"]
    assert syncs == 0 and not compute, ops
    assert allocations <= 3, ops


def _is_view(name: str) -> bool:
    return name in ("view", "reshape", "_unsafe_view", "as_strided", "expand", "slice", "select")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_decode_call_captures_in_a_cuda_graph():
    """Plan, launches and buffers need nothing from the host that changes inside a bucket:
    one call captures in a CUDA graph and replays to the eager result."""
    segs = _to(_layer_segments("int4-channel", 4, 2, 128, rows=4000, seed=10), "cuda")
    q = torch.randn(4, 8, 1, 128, device="cuda")
    eager = decode_attention_triton(q, segs, scaling=128**-0.5)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention_triton(q, segs, scaling=128**-0.5)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager)


@torch.no_grad()
def test_generate_through_the_planned_path_matches_the_reference(monkeypatch, planned_calls):
    """Public path: greedy generate of a tiny Gemma 3 (head_dim 32, MQA) with the int4
    policy on the Triton backend gives the reference backend's tokens, and its decode
    steps take the planned path (the sliding-window layers, masked, the general kernel)."""
    from kvq.models.adapters import get_adapter
    from kvq.quant.schemes import named_policy
    from kvq.runtime.cache import build_cache
    from tests.conftest import make_tiny_model

    model = make_tiny_model("gemma3").to(DEVICE)
    ad = get_adapter(model)
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)

    def generate(backend):
        monkeypatch.setenv("KVQ_BACKEND", backend)
        cache = build_cache(model, named_policy("int4", ad.info.num_layers, ad.info.head_dim),
                            {}, ad)  # fmt: skip
        return model.generate(ids, cache=cache, max_new_tokens=5, do_sample=False,
                              pad_token_id=0)  # fmt: skip

    want = generate("reference")
    assert not planned_calls
    assert torch.equal(generate("triton"), want)
    assert planned_calls
