"""The documented Python API."""

import pytest
import torch

import kvq
from kvq.runtime.cache import QuantizedKVCache
from tests.cli.test_cli import _run


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return tiny_model_dir("llama")


def test_load_model_make_cache_generate(llama):
    model, tokenizer = kvq.load_model(str(llama))
    cache = kvq.make_cache(model, policy="int8")
    assert isinstance(cache, QuantizedKVCache)
    inputs = tokenizer("the cache", return_tensors="pt")
    out = model.generate(**inputs, cache=cache, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 5
    assert cache.nbytes().codes > 0


def test_load_artifact_validates_against_the_model(llama, tiny_model_dir, shared_data, tmp_path):
    art = tmp_path / "art"
    result = _run(
        "calibrate",
        "channel-scales",
        "--model",
        llama,
        "--dataset",
        shared_data / "calibration" / "groups_merged.txt",
        "--samples",
        1,
        "--seqlen",
        16,
        "--v-group",
        8,
        "--out",
        art,
    )
    assert result.exit_code == 0, result.stderr
    model, _ = kvq.load_model(str(llama))
    artifact = kvq.load_artifact(art, model=model)
    cache = kvq.make_cache(model, artifact=artifact)
    with torch.no_grad():
        model(torch.tensor([[1, 5, 9, 11]]), cache=cache)
    assert cache.get_seq_length() == 4
    other, _ = kvq.load_model(str(tiny_model_dir("qwen2")))
    with pytest.raises(kvq.IncompatibleArtifact, match="identity.model_type"):
        kvq.load_artifact(art, model=other)
    with pytest.raises(kvq.KvqError, match="kvq.load_model"):
        kvq.make_cache(torch.nn.Linear(2, 2), policy="int8")
