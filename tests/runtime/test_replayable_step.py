"""Replayable decode steps: a single-token step of a fixed-width layout (append + planned
attention) issues the same work with the same host values step after step — the rows go
in at an offset the device holds, the planned kernel reads the row counts from the device
— and never waits on the device, so a CUDA graph captured once replays it token after
token (`KvqLayer._replayable`; everything else stays host-driven and falls back by itself).

On this CPU machine the Triton kernels run in the interpreter and the planned kernel's
compiled launch is stood in by it (`_Interpreted`), as on CUDA: each launch is recorded
with its grid and every argument.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import AttentionInterface

from kvq.errors import KvqError
from kvq.models.adapters import get_adapter
from kvq.quant.schemes import CachePolicy, LayerPolicy, named_policy
from kvq.runtime import attention as kvq_attention_module
from kvq.runtime.cache import QuantizedKVCache, build_cache, unit_scales
from kvq.runtime.kernels.append import codes as append_kernels
from kvq.runtime.kernels.decode import planned as planned_decode
from tests.conftest import make_tiny_model
from tests.runtime.kernels.helpers import (
    SYNCING,
    OpRecorder,
    interpret_compiled_launches,
    meta,
)

# many interpreted Triton launches or every model family: `make test-quick` skips it
pytestmark = pytest.mark.slow

# (family, config overrides): head_dim 32 at least, which the planned kernel takes
MODELS = {"llama": {"head_dim": 32}, "gemma3": {}}
# fixed-width layouts the planned kernel takes ("-sink2": the first two tokens kept exact);
# QServe's KV4 steps are replayable too, but its floating zero-points take the general kernel
POLICIES = ("int4", "int4-sink2", "int8", "fp8-e4m3")


class _Steps:
    """Per (decode step, layer): the aten ops of the cache's update and of the attention
    call, the append kernels' launches, and the planned kernels' compiled launches
    (kernel, grid, every argument value)."""

    def __init__(self):
        self.ops: dict = {}
        self.appends: dict = {}
        self.launches: dict = {}
        self.at = None  # (step, layer) of the call in progress

    def of(self, table: dict) -> list:
        return table.setdefault(self.at, [])


@pytest.fixture
def steps(monkeypatch):
    """Records every step of the caches built while it is active (see `_Steps`), with the
    planned kernel's compiled launch stood in by the interpreter (CUDA's launch path)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KVQ_BACKEND", "triton")
    rec = _Steps()
    interpret_compiled_launches(
        monkeypatch, on_launch=lambda *launch: rec.of(rec.launches).append(launch)
    )
    launch = append_kernels._launch

    def appended(kernel, n_units, width, *args, **options):
        rec.of(rec.appends).append((kernel, n_units, width, meta(args), meta(options)))
        return launch(kernel, n_units, width, *args, **options)

    monkeypatch.setattr(append_kernels, "_launch", appended)

    update = QuantizedKVCache.update

    def updated(self, key, value, layer_idx, *args, **kwargs):
        rec.at = (self.publications, layer_idx)
        with OpRecorder(rec.of(rec.ops)):
            return update(self, key, value, layer_idx, *args, **kwargs)

    monkeypatch.setattr(QuantizedKVCache, "update", updated)
    publish = QuantizedKVCache._publish

    def published(self, txn):
        # the last layer's attention publishes every layer (and evicts the sliding ones,
        # host-driven): recorded apart, so each layer's ops are its own
        ops = rec.of(rec.ops)
        start = len(ops)
        try:
            return publish(self, txn)
        finally:
            rec.ops.setdefault((rec.at[0], "publish"), []).extend(ops[start:])
            del ops[start:]

    monkeypatch.setattr(QuantizedKVCache, "_publish", published)

    def attended(module, query, key, value, *args, **kwargs):
        if not hasattr(key, "cache"):  # plain K/V (get_adapter's check): not a kvq step
            return kvq_attention_module.kvq_attention(module, query, key, value, *args, **kwargs)
        rec.at = (key.cache.publications, key.layer.layer_idx)
        with OpRecorder(rec.of(rec.ops)):
            return kvq_attention_module.kvq_attention(module, query, key, value, *args, **kwargs)

    # registers "kvq" (and its mask) first, then stands in for it
    kvq_attention_module.install_attention(SimpleNamespace(config=SimpleNamespace(
        _attn_implementation="kvq")))  # fmt: skip
    monkeypatch.setitem(AttentionInterface._global_mapping, "kvq", attended)
    tolist = torch.Tensor.tolist

    def counted_tolist(t):  # a device-to-host copy, dispatched as no op of its own
        if rec.at is not None:
            rec.of(rec.ops).append(("tolist", meta(t), ()))
        return tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    return rec


def _cache(model, name: str, backend: str = "triton"):
    ad = get_adapter(model)
    base, _, sink = name.partition("-sink")
    policy = named_policy(base, ad.info.num_layers, ad.info.head_dim)
    if sink:
        layer = LayerPolicy(**{**policy.layers[0].__dict__, "sink_tokens": int(sink)})
        policy = CachePolicy(name, (layer,) * ad.info.num_layers)
    cache = build_cache(model, policy, unit_scales(policy), ad, backend=backend)
    cache.prepare_replay()
    return cache


def _launch_diff(a, b) -> list[str]:
    """What differs between two launches: kernel, grid, or the parameters whose values
    differ (tensors: in shape, strides, dtype or address, except the query, the model's
    fresh tensor each eager step, and what the call allocates, output and partial
    states: under capture those come from the graph's own pool, at fixed addresses)."""
    (name_a, grid_a, values_a), (name_b, grid_b, values_b) = a, b
    if (name_a, grid_a) != (name_b, grid_b):
        return [f"{name_a}{grid_a} != {name_b}{grid_b}"]
    fresh = {"q", "out", "part"}
    names = planned_decode.inspect.signature(_kernel(name_a).fn).parameters
    return [
        param
        for param, x, y in zip(names, values_a, values_b, strict=True)
        if meta(x) != meta(y)
        or (isinstance(x, torch.Tensor) and param not in fresh and x.data_ptr() != y.data_ptr())
    ]


def _kernel(name: str):
    from kvq.runtime.kernels.decode import _splits_triton as kern

    return getattr(kern, name)


@torch.no_grad()
@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("policy", POLICIES)
def test_consecutive_decode_steps_launch_the_same_work_and_never_sync(steps, family, policy):
    """Public path: greedy generate (batch 2) of a tiny model with a fixed-width layout on
    the Triton path. After the first decode step (which copies the row counts to the
    device), consecutive steps of each layer without a sliding window issue the same aten
    ops with the same host values, launch the append kernels alike and the planned kernel
    with identical arguments (the row counts read from the device: `lengths`, no host row
    counts) and grid, and never read the device. Gemma 3's sliding-window layers (a mask
    as wide as the context) stay host-driven: their steps differ. Tokens equal those of
    the reference backend."""
    model = make_tiny_model(family, **MODELS[family])
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    got = model.generate(ids, cache=_cache(model, policy), **kw)
    decode_params = list(
        planned_decode.inspect.signature(_kernel("decode_splits_kernel").fn).parameters
    )
    for layer in range(model.config.num_hidden_layers):
        at = [(step, layer) for step in (2, 3, 4)]  # step 1 copies the counts to the device
        launches = [steps.launches[a] for a in at]
        assert launches[0] and all(len(x) == len(launches[0]) for x in launches)
        diffs = {
            n
            for x in launches[1:]
            for pair in zip(x, launches[0], strict=True)
            for n in _launch_diff(*pair)
        }
        if get_adapter(model).sliding_window(layer) is not None:
            assert diffs, layer  # host-driven: a mask as wide as the context
            continue
        assert not diffs, (layer, diffs)
        decode = dict(zip(decode_params, launches[0][0][2], strict=True))
        assert decode["lengths"] is not None and decode["rows1"] is None  # counts on the device
        ops = [steps.ops[a] for a in at]
        assert ops[1] == ops[0] and ops[2] == ops[0], layer  # the same work, host values
        assert steps.appends[at[1]] == steps.appends[at[0]] == steps.appends[at[2]]
        for a in at:
            assert not [op for op, *_ in steps.ops[a] if op in (*SYNCING, "tolist")], a
    assert torch.equal(got, model.generate(ids, cache=_cache(model, policy, "reference"), **kw))


@torch.no_grad()
@pytest.mark.parametrize("policy", ["kivi4-g4-r6", "int4"])
def test_layouts_and_batches_with_moving_parts_stay_host_driven(steps, policy):
    """KIVI's grouped residual window, and any layout in a left-padded batch (a mask at
    every step), keep host-driven steps (no device row counts) and the reference's tokens."""
    model = make_tiny_model("llama", **MODELS["llama"])
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    ids[1, :3] = 0
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, attention_mask=(ids != 0).long())
    cache = _cache(model, policy)
    got = model.generate(ids, cache=cache, **kw)
    assert all(layer._device_rows is None for layer in cache.layers)
    assert torch.equal(got, model.generate(ids, cache=_cache(model, policy, "reference"), **kw))


def _decode_step(cache, inputs, scaling):
    """One step of every layer of `cache` through its public interface: append (update)
    and the kvq attention; inputs: per layer (query, key, value), and positions [B, T]."""
    per_layer, positions = inputs
    outs = []
    for i, (q, k, v) in enumerate(per_layer):
        view, _ = cache.update(k, v, i, kwargs={"position_ids": positions})
        out, _ = kvq_attention_module.kvq_attention(None, q, view, view, None, scaling=scaling)
        outs.append(out)
    return outs


def _inputs(b, hq, hkv, d, layers, t, start, device, seed):
    g = torch.Generator().manual_seed(seed)
    per = [
        tuple(torch.randn(b, h, t, d, generator=g).to(device) for h in (hq, hkv, hkv))
        for _ in range(layers)
    ]
    positions = torch.arange(start, start + t).expand(b, t).to(device)
    return per, positions


@torch.no_grad()
@pytest.mark.parametrize("policy", ["int4", "int4-sink2"])
def test_replays_that_leave_the_host_behind_are_caught_up_by_replayed(monkeypatch, policy):
    """What a CUDA graph's replays do, emulated on the CPU: each step of every layer runs
    (append + attention) and its host side is then undone, as a replay runs no Python.
    The rows go where the device counts say and the kernel reads those counts, so every
    such step attends as an eager twin of the cache does (bit for bit), and `replayed`
    brings the host state level again: the next eager steps match the twin's too."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = make_tiny_model("llama", **MODELS["llama"])
    cache = _cache(model, policy)
    shape = (2, 4, 2, 32, model.config.num_hidden_layers)  # B, H_q, H_kv, D, layers
    scaling = 32**-0.5
    _decode_step(cache, _inputs(*shape, 12, 0, "cpu", 0), scaling)  # prefill: 64-row buffers
    assert cache.replay_room() == 0  # nothing replayable captured yet
    _decode_step(cache, _inputs(*shape, 1, 12, "cpu", 12), scaling)  # counts to the device
    room = cache.replay_room()
    assert room == 64 - cache.layers[0].state.main.length  # 13 tokens, less the sink's
    twin = copy.deepcopy(cache)
    held = [layer.state for layer in cache.layers]
    for n in range(13, 17):
        new = _inputs(*shape, 1, n, "cpu", n)
        got = _decode_step(cache, new, scaling)
        for layer, state in zip(cache.layers, held, strict=True):  # the replay's host side
            layer.state = layer._device_rows.state = state
        want = _decode_step(twin, new, scaling)
        assert all(map(torch.equal, got, want)), n
    with pytest.raises(KvqError, match="room"):
        cache.replayed(cache.replay_room() + 1)
    cache.replayed(4)
    assert [x.state.seen for x in cache.layers] == [x.state.seen for x in twin.layers] == [17] * 2
    assert cache.replay_room() == room - 4
    for n in range(17, 19):
        new = _inputs(*shape, 1, n, "cpu", n)
        got, want = _decode_step(cache, new, scaling), _decode_step(twin, new, scaling)
        assert all(map(torch.equal, got, want)), n


@torch.no_grad()
def test_reserve_makes_room_for_replays(monkeypatch):
    """`reserve` grows the main buffers ahead (the next step copies the counts to the
    device again); steps after it attend as those of a cache that grows on its own."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = make_tiny_model("llama", **MODELS["llama"])
    cache = _cache(model, "int4")
    shape = (2, 4, 2, 32, model.config.num_hidden_layers)
    scaling = 32**-0.5
    _decode_step(cache, _inputs(*shape, 12, 0, "cpu", 0), scaling)
    _decode_step(cache, _inputs(*shape, 1, 12, "cpu", 12), scaling)
    twin = copy.deepcopy(cache)
    assert cache.replay_room() == 64 - 13
    cache.reserve(200)
    assert cache.replay_room() == 0  # the next step copies the counts again
    for n in (13, 14):  # (the plan follows the capacity: other splits, other rounding)
        new = _inputs(*shape, 1, n, "cpu", n)
        got, want = _decode_step(cache, new, scaling), _decode_step(twin, new, scaling)
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
    assert cache.replay_room() == 200 - 2
    assert [x.state.main.capacity for x in cache.layers] == [13 + 200] * 2


@torch.no_grad()
@pytest.mark.parametrize("policy", ["int4", "fp8-e4m3"])
def test_a_non_finite_row_is_refused_at_the_next_host_driven_append(monkeypatch, policy):
    """A replayable step does not wait for the append checks (the kernel's flags, or the
    finiteness of the rows): it keeps them on the device, and the layer's next host-driven
    append reads them and refuses, naming the layer."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = make_tiny_model("llama", **MODELS["llama"])
    cache = _cache(model, policy)
    shape = (2, 4, 2, 32, model.config.num_hidden_layers)
    scaling = 32**-0.5
    _decode_step(cache, _inputs(*shape, 12, 0, "cpu", 0), scaling)
    _decode_step(cache, _inputs(*shape, 1, 12, "cpu", 12), scaling)
    bad = _inputs(*shape, 1, 13, "cpu", 13)
    bad[0][1][1][0, 0, 0, 3] = float("nan")  # layer 1's key
    _decode_step(cache, bad, scaling)  # replayable: nothing read
    with pytest.raises(KvqError, match="layer 1: .* NaN or Inf"):
        _decode_step(cache, _inputs(*shape, 2, 14, "cpu", 14), scaling)  # two tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
@pytest.mark.parametrize("policy", ["int4", "int4-sink2", "int8", "fp8-e4m3"])
def test_a_decode_step_captures_in_a_cuda_graph_and_replays_token_after_token(policy,
                                                                              monkeypatch):  # fmt: skip
    """Every layer's decode step (append + attention) captured once in a CUDA graph and
    replayed for several tokens, new inputs copied into the captured ones, gives what an
    eager twin of the cache (a deep copy taken before the capture) gives token by token;
    after `replayed`, eager steps of the cache go on where the replays left it."""
    monkeypatch.setenv("KVQ_BACKEND", "triton")
    model = make_tiny_model("llama", head_dim=64).cuda()
    cache = _cache(model, policy)
    shape = (2, 4, 2, 64, model.config.num_hidden_layers)
    scaling = 64**-0.5
    _decode_step(cache, _inputs(*shape, 20, 0, "cuda", 0), scaling)  # prefill
    for n in (20, 21):  # the first step copies the counts to the device; both compile
        _decode_step(cache, _inputs(*shape, 1, n, "cuda", n), scaling)
    torch.cuda.synchronize()
    twin = copy.deepcopy(cache)
    static = _inputs(*shape, 1, 22, "cuda", 0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _decode_step(cache, static, scaling)
    replays = range(22, 30)
    for n in replays:
        new = _inputs(*shape, 1, n, "cuda", 100 + n)
        for dst, src in zip(static[0], new[0], strict=True):
            for x, y in zip(dst, src, strict=True):
                x.copy_(y)
        static[1].copy_(new[1])
        graph.replay()
        eager = _decode_step(twin, new, scaling)
        torch.cuda.synchronize()
        for got, want in zip(outs, eager, strict=True):
            torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    cache.replayed(len(replays) - 1)
    new = _inputs(*shape, 1, 30, "cuda", 130)
    for got, want in zip(_decode_step(cache, new, scaling), _decode_step(twin, new, scaling),
                         strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, atol=2e-3, rtol=0)


@torch.no_grad()
def test_eager_decoding_stays_host_driven_until_a_replay_is_prepared(monkeypatch):
    """Without `prepare_replay` a decode step keeps host counts and its checks immediate:
    a non-finite row is refused at the step that appends it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = make_tiny_model("llama", **MODELS["llama"])
    ad = get_adapter(model)
    policy = named_policy("int4", ad.info.num_layers, ad.info.head_dim)
    cache = build_cache(model, policy, unit_scales(policy), ad, backend="triton")
    shape = (2, 4, 2, 32, model.config.num_hidden_layers)
    scaling = 32**-0.5
    _decode_step(cache, _inputs(*shape, 12, 0, "cpu", 0), scaling)
    _decode_step(cache, _inputs(*shape, 1, 12, "cpu", 12), scaling)
    assert all(layer._device_rows is None for layer in cache.layers)
    assert cache.replay_room() == 0
    bad = _inputs(*shape, 1, 13, "cpu", 13)
    bad[0][1][1][0, 0, 0, 3] = float("nan")  # layer 1's key
    with pytest.raises(KvqError, match="NaN or Inf"):  # at this very step
        _decode_step(cache, bad, scaling)
