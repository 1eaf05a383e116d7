"""kvq on model shapes the default fixtures do not have: head_dim 80, 96, 100, 112, 128 and
256, GQA ratios 1 to 8 and MQA, Llama 3 / linear / YaRN rope scaling, Qwen2 biases, tied
embeddings, Mistral's head_dim from hidden // heads, sliding windows shorter than the prompt
(Gemma 3, Mistral), prompts that are no multiple of a kernel tile.

For each shape, a KVQuant 3-bit artifact (pre-RoPE keys: the cache un-rotates the keys
attention hands it and rotates them again when it reads them) must
* store rows close to what the model hands the cache, at the scale the model gave them
  (YaRN's attention factor once inflated every pre-RoPE key by m² = 1.30);
* give the Triton kernel (interpreted on CPU) the same decode step as the reference;
* serve a left-padded batch as each sequence alone.
Unsupported combinations are one-line refusals (exit 2), never a traceback.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvq.artifacts.compat import load_artifact
from kvq.calibrators.options import KVQuantOptions
from kvq.models.loading import load_model
from kvq.pipeline import cache_for
from tests.cli.test_cli import _one_line_error, _run
from tests.conftest import calibrate, make_tiny_model, tiny_tokenizer

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}  # fmt: skip
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
             "original_max_position_embeddings": 8}  # fmt: skip
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}
SHAPES = {
    # family, config overrides (the rest: tests/conftest.py's tiny configs, hidden 64)
    "llama-d80-mqa-llama3-tied": ("llama", dict(head_dim=80, num_key_value_heads=1,
        rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)),
    "llama-d96-gqa8-linear": ("llama", dict(head_dim=96, num_attention_heads=8,
        num_key_value_heads=1, rope_parameters=LINEAR_ROPE)),
    "llama-d100-gqa2": ("llama", dict(head_dim=100)),  # OpenLLaMA 3B's head_dim
    "qwen2-d112-gqa4-yarn": ("qwen2", dict(head_dim=112, num_attention_heads=8,
        rope_parameters=YARN_ROPE)),
    "mistral-d128-mha-window6": ("mistral", dict(hidden_size=256, num_attention_heads=2,
        num_key_value_heads=2, head_dim=None, sliding_window=6)),
    "gemma3-d256-gqa2-window8": ("gemma3", dict(head_dim=256, num_key_value_heads=2)),
}  # fmt: skip
PROMPT = 29  # tokens: past every window above, no multiple of 8, 16 or 32
BITS = 3
ROW_ERROR = 0.25  # relative error of a 3-bit row (measured 0.03-0.17 on these shapes)


@pytest.fixture(scope="module")
def shapes(data, tmp_path_factory):
    """name -> (model dir, loaded model, KVQuant 3-bit artifact), built once per module."""
    built = {}

    def get(name: str):
        if name not in built:
            family, overrides = SHAPES[name]
            model_dir = tmp_path_factory.mktemp(name)
            make_tiny_model(family, **overrides).save_pretrained(model_dir)
            tiny_tokenizer().save_pretrained(model_dir)
            out = model_dir.parent / f"{name}-kvquant{BITS}"
            calibrate(model_dir, data, out, KVQuantOptions(bits=BITS, fisher=False))
            loaded = load_model(str(model_dir))
            built[name] = (model_dir, loaded, load_artifact(out, loaded))
        return built[name]

    return get


def _ids(n: int, seed: int, b: int = 2) -> torch.Tensor:
    return torch.randint(3, 500, (b, n), generator=torch.Generator().manual_seed(seed))


def _prefill(loaded, artifact, ids, backend="reference"):
    """A cache from `artifact` after `ids`, and what attention handed it per layer:
    {layer: (post-RoPE key, value)}, each [B, H_kv, T, D] float32."""
    cache = cache_for(loaded, artifact=artifact, backend=backend)
    handed, update = {}, cache.update

    def recording(key, value, layer_idx, *args, **kwargs):
        handed[layer_idx] = (key.detach().float().clone(), value.detach().float().clone())
        return update(key, value, layer_idx, *args, **kwargs)

    cache.update = recording
    with torch.no_grad():
        loaded.model(ids, cache=cache)
    del cache.update  # back to the class's method: the cache goes on as any other
    return cache, handed


@pytest.mark.parametrize("name", SHAPES)
def test_cached_rows_are_the_models_own_within_the_bits(shapes, name):
    _, loaded, artifact = shapes(name)
    cache, handed = _prefill(loaded, artifact, _ids(PROMPT, seed=0))
    assert cache.layers[0].policy.key_stage == "pre-rope"
    for i, layer in enumerate(cache.layers):
        got = layer.visible_rows(layer.state)  # key post-RoPE, value: [B, H_kv, visible, D]
        for side, g, want in zip(("key", "value"), got, handed[i], strict=True):
            want = want[:, :, want.shape[2] - g.shape[2] :]  # a sliding layer keeps its window
            assert g.shape == want.shape, (i, side)
            err = ((g - want).norm() / want.norm()).item()
            scale = (g.norm() / want.norm()).item()
            assert 0 < err < ROW_ERROR, (i, side, err)  # quantized, and close
            assert abs(scale - 1) < 0.05, (i, side, scale)  # at the model's own scale


# head_dims that are no power of two: the general kernel (the planned one takes 32 ... 256)
@pytest.mark.parametrize("name", ["llama-d80-mqa-llama3-tied", "llama-d100-gqa2",
                                  "qwen2-d112-gqa4-yarn"])  # fmt: skip
def test_triton_decode_step_equals_the_reference(shapes, name):
    """One decode step over the same cache state on both backends (the Triton kernel runs
    in its CPU interpreter)."""
    _, loaded, artifact = shapes(name)
    cache, _ = _prefill(loaded, artifact, _ids(PROMPT, seed=1))
    step = _ids(1, seed=2)
    logits = {}
    for backend in ("reference", "triton"):
        twin = copy.deepcopy(cache)
        twin.backend = backend
        with torch.no_grad():
            logits[backend] = loaded.model(step, cache=twin).logits
    ref = logits["reference"]
    torch.testing.assert_close(logits["triton"], ref, atol=1e-4 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("name", ["llama-d96-gqa8-linear", "gemma3-d256-gqa2-window8"])
def test_left_padding_serves_each_sequence_as_alone(shapes, name):
    _, loaded, artifact = shapes(name)
    long, short = _ids(PROMPT, seed=3, b=1)[0], _ids(7, seed=4, b=1)[0]
    ids = torch.zeros(2, PROMPT, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0], mask[0] = long, 1
    ids[1, PROMPT - 7 :], mask[1, PROMPT - 7 :] = short, 1

    def generate(x, m=None):
        with torch.no_grad():
            return loaded.model.generate(
                x, attention_mask=m, cache=cache_for(loaded, artifact=artifact),
                max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
                return_dict_in_generate=True,
            )  # fmt: skip

    batch = generate(ids, mask)
    for i, row in enumerate((long, short)):
        alone = generate(row[None])
        assert torch.equal(batch.sequences[i, PROMPT:], alone.sequences[0, row.numel() :])
        for step, want in enumerate(alone.logits):
            # a batch's rounding can flip a 3-bit code now and then (tests/runtime/test_contract)
            torch.testing.assert_close(batch.logits[step][i], want[0], atol=2e-3, rtol=1e-5)


def test_a_named_policy_whose_groups_do_not_fit_the_head_is_one_line(shapes, data):
    model_dir, _, _ = shapes("llama-d80-mqa-llama3-tied")
    result = _run("run-eval", "--model", model_dir, "--policy", "int4", "--dataset", data,
                  "--windows", 1, "--seqlen", 16)  # fmt: skip
    _one_line_error(result, "group size 64 does not divide head_dim 80")


def test_smoothattention_on_gemma3_with_two_kv_heads_is_one_line(shapes, data, tmp_path):
    """Gemma 3's q/k RMSNorm weights are shared by all heads: per-head scales cannot fold."""
    model_dir, _, _ = shapes("gemma3-d256-gqa2-window8")
    out = tmp_path / "smooth"
    result = _run("calibrate", "smoothattention", "--model", model_dir, "--dataset", data,
                  "--samples", 1, "--seqlen", 16, "--out", out)  # fmt: skip
    _one_line_error(result, "2 KV heads", "cannot be folded")
    assert not out.exists()
