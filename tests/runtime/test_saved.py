"""Cache state beyond one request: fork (copy on write), release, save and load."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvq
from kvq.calibrators.options import KVQuantOptions
from kvq.errors import KvqError
from kvq.runtime.cache import QuantizedKVCache
from tests.conftest import calibrate


@pytest.fixture(scope="module")
def llama(tiny_model_dir, data, tmp_path_factory):
    """A kvq-loaded tiny Llama and a KVQuant artifact for it (sparse keys, two sinks)."""
    model_dir = tiny_model_dir("llama")
    out = tmp_path_factory.mktemp("kvquant") / "ART"
    calibrate(model_dir, data, out, KVQuantOptions(bits=3, fisher=False, sink=2))
    model, _ = kvq.load_model(str(model_dir))
    return model, out


def _ids(n, seed, b=1):
    return torch.randint(3, 300, (b, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_fork_shares_pages_until_either_side_appends(llama):
    model, art = llama
    prompt = _ids(12, 0)
    cache = kvq.make_cache(model, artifact=art)
    model(prompt, cache=cache)
    twin = cache.fork()
    page = cache.layers[0].state.main.buffers["k.codes"]
    assert twin.layers[0].state.main.buffers["k.codes"] is page  # shared, not copied
    a, b = _ids(3, 1), _ids(3, 2)
    got_a = model(a, cache=cache).logits
    got_b = model(b, cache=twin).logits
    assert twin.layers[0].state.main.buffers["k.codes"] is not page  # copied on append
    for cont, got in ((a, got_a), (b, got_b)):
        fresh = kvq.make_cache(model, artifact=art)
        model(prompt, cache=fresh)
        torch.testing.assert_close(got, model(cont, cache=fresh).logits)
    assert cache.get_seq_length() == twin.get_seq_length() == 15


@torch.no_grad()
def test_release_frees_finished_rows_and_keeps_the_rest(llama):
    model, art = llama
    ids = _ids(10, 3, b=3)
    cache = kvq.make_cache(model, artifact=art)
    model(ids, cache=cache)
    before = cache.nbytes()
    keep = cache.release(torch.tensor([False, True, False]))
    assert keep.tolist() == [0, 2] and cache.batch_size == 2
    assert cache.nbytes().codes < before.codes
    step = _ids(1, 4, b=3)
    got = model(step[keep], cache=cache).logits
    ref = kvq.make_cache(model, artifact=art)
    model(ids, cache=ref)
    want = model(step, cache=ref).logits[keep]
    torch.testing.assert_close(got, want)
    with pytest.raises(KvqError, match="bool"):
        cache.release(torch.tensor([0, 1]))


@torch.no_grad()
def test_save_and_load_round_trip(llama, tmp_path):
    model, art = llama
    ids = _ids(14, 5, b=2)
    cache = kvq.make_cache(model, artifact=art)
    model(ids, cache=cache)
    cache.save(tmp_path / "state.safetensors")
    loaded = QuantizedKVCache.load(tmp_path / "state.safetensors", model, artifact=art)
    assert loaded.nbytes() == cache.nbytes()
    step = _ids(1, 6, b=2)
    torch.testing.assert_close(model(step, cache=loaded).logits, model(step, cache=cache).logits)
    assert loaded.get_seq_length() == 15


@torch.no_grad()
def test_load_refuses_another_layout_model_or_a_tampered_file(llama, tiny_model_dir, tmp_path):
    model, art = llama
    cache = kvq.make_cache(model, artifact=art)
    model(_ids(9, 7), cache=cache)
    path = tmp_path / "state.safetensors"
    cache.save(path)
    with pytest.raises(KvqError, match="another artifact"):
        QuantizedKVCache.load(path, model, policy="int4")
    other, _ = kvq.load_model(str(tiny_model_dir("qwen2")))
    with pytest.raises(KvqError, match="another model"):
        QuantizedKVCache.load(path, other, policy="int4")
    tensors = load_file(path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors["layers.0.main.k.codes"] = tensors["layers.0.main.k.codes"][..., :-1].contiguous()
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(KvqError, match="wrong shape"):
        QuantizedKVCache.load(path, model, artifact=art)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(KvqError, match="cannot read"):
        QuantizedKVCache.load(tmp_path / "junk.safetensors", model, artifact=art)
