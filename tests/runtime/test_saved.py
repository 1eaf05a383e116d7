"""Cache state beyond one request: fork (copy on write), release, save and load."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import kvq
from kvq.calibrators.options import KVQuantOptions
from kvq.errors import KvqError
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
    loaded = kvq.load_cache(tmp_path / "state.safetensors", model, artifact=art)
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
        kvq.load_cache(path, model, policy="int4")
    other, _ = kvq.load_model(str(tiny_model_dir("qwen2")))
    with pytest.raises(KvqError, match="another model"):
        kvq.load_cache(path, other, policy="int4")
    tensors = load_file(path)
    tensors["layers.0.main.k.codes"] = tensors["layers.0.main.k.codes"][..., :-1].contiguous()
    _forge(path, tensors)  # checksums recomputed: the layout checks behind them still hold
    with pytest.raises(KvqError, match="wrong shape"):
        kvq.load_cache(path, model, artifact=art)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(KvqError, match="cannot read"):
        kvq.load_cache(tmp_path / "junk.safetensors", model, artifact=art)


def _forge(path, tensors, edit=lambda meta: None):
    """Rewrite a saved state with `tensors` and checksums that match them, as a forger
    would: what the checks behind the checksums must still catch."""
    import hashlib
    import json

    from kvq.models.fingerprint import tensor_sha256

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["kvq"])
    meta["tensors"] = {n: tensor_sha256(t) for n, t in tensors.items()}
    edit(meta)
    text = json.dumps(meta, sort_keys=True)
    sha = hashlib.sha256(text.encode()).hexdigest()
    save_file(tensors, str(path), metadata={"kvq": text, "kvq_sha256": sha})


@pytest.fixture
def saved(llama, tmp_path):
    """A KVQuant cache state saved after a 2 x 11-token prompt: (model, art, path, logits)."""
    model, art = llama
    cache = kvq.make_cache(model, artifact=art)
    model(_ids(11, 8, b=2), cache=cache)
    path = tmp_path / "state.safetensors"
    cache.save(path)
    with torch.no_grad():
        logits = model(_ids(1, 9, b=2), cache=cache).logits
    return model, art, path, logits


def _load(saved):
    model, art, path, _ = saved
    return kvq.load_cache(path, model, artifact=art)


def _flip(path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


@torch.no_grad()
def test_a_byte_flipped_anywhere_is_refused(saved):
    model, art, path, logits = saved
    torch.testing.assert_close(model(_ids(1, 9, b=2), cache=_load(saved)).logits, logits)
    pristine = path.read_bytes()
    header = 8 + int.from_bytes(pristine[:8], "little")
    for at, needle in ((header + (len(pristine) - header) // 2, "checksum"),
                       (len(pristine) - 1, "checksum"), (header // 2, "checksum|not a saved|cannot read")):  # fmt: skip
        path.write_bytes(pristine)
        _flip(path, at)
        with pytest.raises(KvqError, match=needle):
            _load(saved)


def test_swapped_layers_are_refused(saved):
    _, _, path, _ = saved
    tensors = load_file(path)
    swapped = {}
    for name, t in tensors.items():
        i = name.split(".")[1]
        j = {"0": "1", "1": "0"}.get(i, i)
        swapped[name.replace(f"layers.{i}.", f"layers.{j}.", 1)] = t
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    save_file(swapped, str(path), metadata=metadata)  # the header's checksums kept
    with pytest.raises(KvqError, match="checksum"):
        _load(saved)
    _forge(path, swapped, lambda meta: meta["layers"].reverse())  # forged: order still checked
    with pytest.raises(KvqError, match="out of order"):
        _load(saved)


def test_positions_outside_the_context_are_refused(saved):
    _, _, path, _ = saved
    for bad in (-5, 10**9):
        tensors = load_file(path)
        tensors["layers.0.main.positions"][0, 0] = bad
        _forge(path, tensors)
        with pytest.raises(KvqError, match="positions"):
            _load(saved)


@torch.no_grad()
def test_a_state_saved_by_other_weights_is_refused(llama, tmp_path):
    model, art = llama
    weight = model.model.layers[0].mlp.down_proj.weight
    weight[0, 0] += 0.5  # one weight changed, in place (the config is the same)
    try:
        cache = kvq.make_cache(model, artifact=art)
        model(_ids(9, 10), cache=cache)
        cache.save(tmp_path / "state.safetensors")
    finally:
        weight[0, 0] -= 0.5
    with pytest.raises(KvqError, match="model's weights"):
        kvq.load_cache(tmp_path / "state.safetensors", model, artifact=art)


def test_a_state_without_checksums_is_refused(saved):
    _, _, path, _ = saved
    _forge(path, load_file(path), lambda meta: meta.update(format="kvq-cache-state/1"))
    with pytest.raises(KvqError, match="without checksums; save it again"):
        _load(saved)


@torch.no_grad()
def test_save_refuses_a_directory_a_missing_folder_and_an_artifact(llama, tmp_path):
    model, art = llama
    cache = kvq.make_cache(model, artifact=art)
    model(_ids(5, 11), cache=cache)
    before = {p.name: p.read_bytes() for p in art.iterdir()}
    for dest, needle in ((tmp_path, "is a directory"),
                         (tmp_path / "no" / "such" / "s.safetensors", "does not exist"),
                         (art / "tensors.safetensors", "inside the kvq artifact"),
                         (art / "state.safetensors", "inside the kvq artifact")):  # fmt: skip
        with pytest.raises(KvqError, match=needle):
            cache.save(dest)
    assert {p.name: p.read_bytes() for p in art.iterdir()} == before
    kvq.load_artifact(art, model=model)  # still loads


def test_forged_exception_slots_are_refused(saved):
    """Decode trusts the cache's exception slots (kvq's encoders make them valid), so a
    saved file's are checked once, when it loads."""
    _, _, path, _ = saved
    pristine = load_file(path)
    name = "layers.0.main.v.sparse_index"
    slots = pristine[name].shape[-1]  # the KVQuant values' exact exceptions per row
    edits = [(255, "out of range")] + ([(1, "duplicate")] if slots > 1 else [])
    for index, needle in edits:
        tensors = {n: t.clone() for n, t in pristine.items()}
        tensors[name][0, 0, 0] = index  # every slot of one row
        _forge(path, tensors)
        with pytest.raises(KvqError, match=f"layer 0.*v.sparse_index.*{needle}"):
            _load(saved)
