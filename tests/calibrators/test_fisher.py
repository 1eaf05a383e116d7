"""Fisher diagonals: shapes, agreement with a brute-force autograd reference, sink exclusion,
no side effects on the model, and the safetensors cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from kvq.calibrators import fisher
from kvq.calibrators.fisher import FisherInfo, collect_fisher, fisher_cached, fisher_path
from kvq.errors import IncompatibleArtifact, KvqError
from kvq.models.adapters import get_adapter
from kvq.progress import Progress
from tests.conftest import TINY_VOCAB, make_tiny_model

FAMILIES = ("llama", "gemma3")
N, T = 3, 16  # T > gemma3's sliding window (8), so sliding layers are exercised
WEIGHTS_SHA = "a" * 64
WINDOWS_SHA = "b" * 64


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request):
    """(model, adapter, windows [N, T]) for one family."""
    model = make_tiny_model(request.param)
    gen = torch.Generator().manual_seed(1)
    windows = torch.randint(3, TINY_VOCAB, (N, T), generator=gen)
    return model, get_adapter(model), windows


def _keep_output(store: dict, key: tuple):
    """A forward hook keeping the site output, to take torch.autograd.grad against it."""

    def keep(_module, _inputs, output):
        store[key] = output

    return keep


def brute_force(model, adapter, windows):
    """Squared gradients per position, (key, value) each [L, H_kv, T, D], summed over windows.

    Independent of kvq.calibrators.fisher: forward hooks keep the site outputs and
    torch.autograd.grad of a loss computed from input_ids is taken against them (no tensor
    hooks, no inputs_embeds). They must stay in the graph, not become detached leaves:
    a later layer's K/V depend on an earlier layer's V through the residual stream.
    """
    info = adapter.info
    shape = (info.num_layers, info.num_kv_heads, T, info.head_dim)
    out = {"key": torch.zeros(shape), "value": torch.zeros(shape)}
    for i in range(windows.shape[0]):
        outputs, handles = {}, []
        for layer in range(info.num_layers):
            for part, site in (("key", adapter.key_pre_rope_site), ("value", adapter.value_site)):
                module, to_heads = site(layer)

                hook = _keep_output(outputs, (part, layer, to_heads))
                handles.append(module.register_forward_hook(hook))
        try:
            ids = windows[i : i + 1]
            logits = model(input_ids=ids, use_cache=False).logits
            loss = F.cross_entropy(logits[0, :-1], ids[0, 1:])
            grads = torch.autograd.grad(loss, list(outputs.values()))
        finally:
            for h in handles:
                h.remove()
        for (part, layer, to_heads), g in zip(outputs, grads, strict=True):
            out[part][layer] += to_heads(g)[0].square()  # [H_kv, T, D]
    return out["key"], out["value"]


def test_shapes_and_values(tiny):
    model, adapter, windows = tiny
    key, value = collect_fisher(model, adapter, windows, Progress())
    info = adapter.info
    for f in (key, value):
        assert f.shape == (info.num_layers, info.num_kv_heads, info.head_dim)
        assert f.dtype == torch.float32
        assert torch.isfinite(f).all() and (f >= 0).all()
        assert (f.flatten(1).sum(1) > 0).all()  # every layer gets gradient


def test_matches_brute_force_and_excludes_sinks(tiny):
    model, adapter, windows = tiny
    ref_key, ref_value = brute_force(model, adapter, windows)
    for sink in (0, 3):
        key, value = collect_fisher(model, adapter, windows, exclude_first=sink)
        for got, ref in ((key, ref_key), (value, ref_value)):
            want = ref[:, :, sink:].sum(2)
            # Scale-relative atol: tiny random models give key Fisher values around 1e-12.
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * want.max().item())
    # The excluded positions carry real gradient, so the mask is actually tested.
    assert ref_key[:, :, :3].sum() > 0 and ref_value[:, :, :3].sum() > 0


def test_finite_difference_one_element():
    """d loss / d V at one element by central differences (float64 model) vs the hook gradient.

    A value element, because the RMSNorms compute in float32 even in a float64 model and
    that rounding noise swamps the ~1e-7 key gradients of a tiny random model (the keys are
    covered by the autograd comparison above).
    """
    model = make_tiny_model("llama").double()
    adapter = get_adapter(model)
    ids = torch.randint(3, TINY_VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))
    layer, head, pos, ch = 0, 1, 4, 5
    module, to_heads = adapter.value_site(layer)
    delta = {"eps": 0.0}

    def nudge(_m, _inp, output):
        out = output.clone()
        to_heads(out)[0, head, pos, ch] += delta["eps"]  # to_heads is a view: edits `out`
        return out

    def loss_at(eps: float) -> float:
        delta["eps"] = eps
        handle = module.register_forward_hook(nudge)
        try:
            with torch.no_grad():
                logits = model(input_ids=ids, use_cache=False).logits
            return F.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
        finally:
            handle.remove()

    eps = 1e-2  # V enters the output linearly per head, so a large step stays accurate
    fd = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
    # The sums from position `pos` on minus those from `pos + 1` on leave this position alone.
    _, a = collect_fisher(model, adapter, ids, exclude_first=pos)
    _, b = collect_fisher(model, adapter, ids, exclude_first=pos + 1)
    got = (a - b)[layer, head, ch].item()
    assert got > 0
    assert got == pytest.approx(fd**2, rel=1e-3, abs=0)


def test_model_left_untouched(tiny):
    model, adapter, windows = tiny
    frozen = next(model.parameters())
    frozen.requires_grad_(False)  # a caller's own freeze must survive too
    model.train(True)
    try:
        collect_fisher(model, adapter, windows[:1])
        assert all(p.grad is None for p in model.parameters())
        assert not frozen.requires_grad
        assert all(p.requires_grad for p in model.parameters() if p is not frozen)
        assert model.training
    finally:
        frozen.requires_grad_(True)
        model.train(False)


def test_hooks_removed_after_error(tiny):
    model, adapter, windows = tiny

    class Boom(Progress):
        def _open(self, name, total):
            assert name == "fisher" and total == N
            stage = super()._open(name, total)
            stage._advance = lambda n: (_ for _ in ()).throw(RuntimeError("boom"))
            return stage

    with pytest.raises(RuntimeError, match="boom"):
        collect_fisher(model, adapter, windows, Boom())
    assert all(not m._forward_hooks for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())


def test_progress_stage_and_bad_sink(tiny):
    model, adapter, windows = tiny
    progress = Progress()
    collect_fisher(model, adapter, windows[:1], progress)
    assert "fisher" in progress.seconds
    with pytest.raises(KvqError):
        collect_fisher(model, adapter, windows, exclude_first=T)
    with pytest.raises(KvqError):
        collect_fisher(model, adapter, windows, exclude_first=-1)


def test_fisher_info_round_trip():
    info = FisherInfo(torch.rand(2, 1, 4), torch.rand(2, 1, 4), 30, WINDOWS_SHA, WEIGHTS_SHA)
    back = FisherInfo.from_tensors(
        info.to_tensors(), tokens=30, windows_sha256=WINDOWS_SHA, weights_sha256=WEIGHTS_SHA
    )
    assert torch.equal(back.key, info.key) and torch.equal(back.value, info.value)
    assert set(info.to_tensors()) == {"fisher.key", "fisher.value"}
    with pytest.raises(IncompatibleArtifact):
        FisherInfo.from_tensors(
            {"fisher.key": info.key}, tokens=30, windows_sha256="", weights_sha256=""
        )


def test_cache_hit_and_mismatch(tiny, tmp_path, monkeypatch):
    model, adapter, windows = tiny
    windows = windows[:2]  # four computations below; two windows keep them cheap
    first = fisher_cached(
        model,
        adapter,
        windows,
        WINDOWS_SHA,
        WEIGHTS_SHA,
        Progress(),
        exclude_first=1,
        cache_dir=tmp_path,
    )
    path = fisher_path(WEIGHTS_SHA, WINDOWS_SHA, 1, tmp_path)
    assert path.is_file() and first.tokens == 2 * (T - 1)
    assert not list(path.parent.glob("*.tmp"))  # the temp file was renamed away

    def must_not_run(*_a, **_k):
        raise AssertionError("collect_fisher ran despite a valid cache")

    monkeypatch.setattr(fisher, "collect_fisher", must_not_run)
    hit = fisher_cached(
        model, adapter, windows, WINDOWS_SHA, WEIGHTS_SHA, exclude_first=1, cache_dir=tmp_path
    )
    assert torch.equal(hit.key, first.key) and torch.equal(hit.value, first.value)
    assert (hit.tokens, hit.windows_sha256, hit.weights_sha256) == (
        first.tokens,
        WINDOWS_SHA,
        WEIGHTS_SHA,
    )
    monkeypatch.undo()

    # Same 16-hex prefix (same file name) but another full weights sha: must recompute.
    other = WEIGHTS_SHA[:16] + "c" * 48
    calls = []
    real = fisher.collect_fisher
    monkeypatch.setattr(fisher, "collect_fisher", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = fisher_cached(
        model, adapter, windows, WINDOWS_SHA, other, exclude_first=1, cache_dir=tmp_path
    )
    assert calls == [1] and again.weights_sha256 == other
    torch.testing.assert_close(again.key, first.key)

    # A torn file and a file with foreign tensors are recomputed too.
    path.write_bytes(b"not a safetensors file")
    fisher_cached(model, adapter, windows, WINDOWS_SHA, other, exclude_first=1, cache_dir=tmp_path)
    meta = {
        "format": fisher.FORMAT,
        "windows_sha256": WINDOWS_SHA,
        "weights_sha256": other,
        "exclude_first": "1",
        "tokens": "45",
    }
    foreign = {"fisher.key": torch.zeros(1, 1, 1), "fisher.value": torch.zeros(1, 1, 1)}
    save_file(foreign, str(path), metadata=meta)
    fixed = fisher_cached(
        model, adapter, windows, WINDOWS_SHA, other, exclude_first=1, cache_dir=tmp_path
    )
    assert calls == [1, 1, 1] and fixed.key.shape == first.key.shape
