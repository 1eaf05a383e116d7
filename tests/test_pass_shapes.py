"""Every calibration pass a user serves from, and the calibration-free layouts, on the
unusual model shapes of tests/test_model_shapes.py (head_dim no multiple of 32 or 64, MQA,
GQA 8, sliding windows shorter than the prompt, Qwen2 biases, YaRN / Llama 3 / linear rope
scaling) and Qwen2.5 0.5B's 7 query heads per KV head.
test_model_shapes runs KVQuant 3-bit on every shape; here each other layout runs
on the shapes that stress it (PAIRS), calibrated on tiny windows, loaded and served:
* the cache stores what attention hands it, within the layout's bits, at its own scale;
* a model transform (SmoothAttention, rotate) leaves the model's output unchanged;
* `model.generate` on a left-padded batch of two prompts of different lengths gives each
  sequence what it gets alone;
* a decode step of that padded batch on the Triton backend (its CPU interpreter) equals
  the reference.
KVQ_PASS_SHAPES=all runs every layout on every shape (about 10 minutes on one core; the
refused combinations then fail with their one-line KvqError, see test_refusals).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from kvq.artifacts.compat import load_artifact
from kvq.calibrators.options import (
    ActScalesOptions,
    AutoOptions,
    ChannelScalesOptions,
    IntactKVOptions,
    KVQuantOptions,
    KVScalesOptions,
    PrefixQuantOptions,
    RotateOptions,
    SmoothAttentionOptions,
    TrellisOptions,
    TuneOptions,
    VQOptions,
)
from kvq.errors import KvqError
from kvq.models.loading import load_model
from kvq.pipeline import cache_for
from kvq.runtime.prefix import load_prefix
from tests.cli.test_cli import _one_line_error, _run
from tests.conftest import calibrate, make_tiny_model, tiny_tokenizer
from tests.test_model_shapes import SHAPES as ODD_SHAPES

# many interpreted Triton launches or every model family: `make test-quick` skips it
pytestmark = pytest.mark.slow

# Qwen2.5 0.5B's head layout (14 query heads on 2 KV heads, head_dim 64, tied embeddings):
# 7 query heads per KV head, no power of two, in no shape of test_model_shapes
SHAPES = ODD_SHAPES | {
    "qwen2-d64-gqa7-tied": ("qwen2", dict(head_dim=64, num_attention_heads=14,
                                          tie_word_embeddings=True)),
}  # fmt: skip

# a pass's chain (base first) with small settings: the user's defaults where they are cheap
PASSES = {
    "channel-scales": (ChannelScalesOptions(bits=4, value_group=16),),
    "kv-scales-int8": (KVScalesOptions(granularity="head", kv_format="int8"),),
    "kv-scales-fp8": (KVScalesOptions(),),
    "smoothattention": (SmoothAttentionOptions(),),  # kv4-qserve
    "rotate": (RotateOptions(layout="int8"),),
    "act-scales": (ActScalesOptions(layout="kv4-qserve"),),
    "vq": (VQOptions(bits=3, fisher=False),),
    "trellis": (TrellisOptions(bits=3, fisher=False, mixed="fisher", static_tokens=0),),
    # --prefer speed (the default): the layouts whose appends are cheap
    "auto2": (AutoOptions(bits=2),),  # rotate -> 4-D vq, --mixed loss
    "auto3": (AutoOptions(bits=3),),  # rotate -> 2-D vq, --mixed fisher
    "auto4": (AutoOptions(bits=4),),  # kvquant
    "prefixquant": (PrefixQuantOptions(eta=2.0),),  # int8 after the found prefix
    "intactkv": (ChannelScalesOptions(bits=4, value_group=16), IntactKVOptions(steps=2)),
    "tune": (KVQuantOptions(bits=3, fisher=False), TuneOptions(steps=2, checkpoints=1)),
}
# calibration-free layouts; KIVI's residual window shorter than the prompt, so groups form
POLICIES = ("kivi2-g16-r8", "kivi4-g16-r8", "kv4-qserve", "int2", "fp8-e4m3-dynamic")
# relative error of a row by its scheme's bits (--mixed moves a layer-side down to 1)
ROW_ERROR = {1: 0.9, 2: 0.6, 3: 0.3, 4: 0.2, 8: 0.05}

PAIRS = [  # (layout, the shape that stresses it)
    ("channel-scales", "llama-d80-mqa-llama3-tied"),  # static per-channel keys, MQA, d 80
    ("kv-scales-int8", "gemma3-d256-gqa2-window8"),  # per-head scales, sliding layers
    ("kv-scales-fp8", "qwen2-d112-gqa4-yarn"),  # post-RoPE keys under YaRN's attention factor
    ("smoothattention", "qwen2-d112-gqa4-yarn"),  # lambda folded into q/k biases
    ("rotate", "llama-d100-gqa2"),  # no Hadamard of 100: a random orthogonal matrix
    ("act-scales", "llama-d96-gqa8-linear"),
    ("vq", "llama-d96-gqa8-linear"),  # 8 query heads on one KV head
    ("auto2", "llama-d80-mqa-llama3-tied"),
    ("auto3", "qwen2-d112-gqa4-yarn"),
    ("auto4", "mistral-d128-mha-window6"),  # pre-RoPE NUQ keys evicted from a window
    ("prefixquant", "llama-d96-gqa8-linear"),
    ("vq", "qwen2-d64-gqa7-tied"),
    ("trellis", "gemma3-d256-gqa2-window8"),  # Gemma's head, evicted from a sliding window
    ("trellis", "llama-d100-gqa2"),  # rows that fill no whole byte of 3-bit digits
    ("intactkv", "llama-d80-mqa-llama3-tied"),
    ("tune", "llama-d100-gqa2"),
    ("kivi2-g16-r8", "qwen2-d112-gqa4-yarn"),
    ("kivi4-g16-r8", "llama-d80-mqa-llama3-tied"),
    ("kv4-qserve", "mistral-d128-mha-window6"),
    ("kv4-qserve", "qwen2-d64-gqa7-tied"),
    ("int2", "llama-d96-gqa8-linear"),
    ("fp8-e4m3-dynamic", "llama-d100-gqa2"),
]  # fmt: skip
if os.environ.get("KVQ_PASS_SHAPES") == "all":
    PAIRS = [(p, s) for p in [*PASSES, *POLICIES] for s in SHAPES]
# the Triton interpreter costs 2-20 s a step on these shapes: the layouts with their own
# kernel families (static INT, FP8, QServe, KIVI, NUQ, vector and trellis codes, a prefix)
TRITON = [p for p in PAIRS if p[0] not in ("act-scales", "auto3", "tune", "smoothattention")]

PROMPT, SHORT = 29, 7  # past every window of SHAPES; no multiple of a kernel tile


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """shape name -> its saved tiny model's directory, built once per module."""
    built = {}

    def get(name: str):
        if name not in built:
            family, overrides = SHAPES[name]
            built[name] = model_dir = tmp_path_factory.mktemp(name)
            make_tiny_model(family, **overrides).save_pretrained(model_dir)
            tiny_tokenizer().save_pretrained(model_dir)
        return built[name]

    return get


@pytest.fixture(scope="module")
def served(models, data, tmp_path_factory):
    """(layout, shape) -> (loaded model, artifact or None, cache factory(backend)); the
    model is loaded afresh per layout, as its artifact's transforms fold into it."""
    built = {}

    def get(method: str, shape: str):
        if (method, shape) in built:
            return built[method, shape]
        model_dir = models(shape)
        loaded, artifact = load_model(str(model_dir)), None
        if method in POLICIES:
            make = lambda backend=None: cache_for(loaded, policy=method, backend=backend)  # noqa: E731
        else:
            base = None
            for i, options in enumerate(PASSES[method]):
                out = tmp_path_factory.mktemp(f"{shape}-{method}") / f"step{i}"
                calibrate(model_dir, data, out, options, base=base)
                base = out
            artifact = load_artifact(base, loaded)
            make = lambda backend=None: cache_for(loaded, artifact=artifact, backend=backend)  # noqa: E731
        make()  # folds the artifact's transforms into the model now
        built[method, shape] = loaded, artifact, make
        return built[method, shape]

    return get


def _padded_batch():
    """(long, short) prompts, and them as a left-padded batch: ids and mask [2, PROMPT]."""
    g = torch.Generator().manual_seed(3)
    long = torch.randint(3, 500, (PROMPT,), generator=g)
    short = torch.randint(3, 500, (SHORT,), generator=g)
    ids = torch.zeros(2, PROMPT, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0], mask[0] = long, 1
    ids[1, PROMPT - SHORT :], mask[1, PROMPT - SHORT :] = short, 1
    return (long, short), ids, mask


@pytest.mark.parametrize("method, shape", PAIRS)
def test_cached_rows_are_what_attention_handed_within_the_bits(served, method, shape):
    loaded, _, make_cache = served(method, shape)
    (long, _), _, _ = _padded_batch()
    cache, handed = make_cache("reference"), {}
    update = cache.update

    def recording(key, value, layer_idx, *args, **kwargs):
        handed[layer_idx] = (key.detach().float().clone(), value.detach().float().clone())
        return update(key, value, layer_idx, *args, **kwargs)

    cache.update = recording
    with torch.no_grad():
        loaded.model(long[None], cache=cache)
    del cache.update
    for i, layer in enumerate(cache.layers):
        got = layer.visible_rows(layer.state)  # key post-RoPE, value: [1, H_kv, visible, D]
        for side, g, want in zip(("key", "value"), got, handed[i], strict=True):
            bound = ROW_ERROR[getattr(layer.policy, side).bits]
            want = want[:, :, want.shape[2] - g.shape[2] :]  # a sliding layer keeps its window
            assert g.shape == want.shape, (i, side)
            err = ((g - want).norm() / want.norm()).item()
            assert 0 < err < bound, (
                i,
                side,
                getattr(layer.policy, side),
                err,
            )  # quantized, and close
            assert abs((g.norm() / want.norm()).item() - 1) < bound / 2, (i, side)


@pytest.mark.parametrize("method, shape", [p for p in PAIRS if p[0] in ("smoothattention",
                                           "rotate", "auto2", "auto3")])  # fmt: skip
def test_a_folded_transform_leaves_the_model_unchanged(models, served, method, shape):
    loaded, artifact, _ = served(method, shape)
    assert any(".smooth." in n or ".rotate." in n for n in artifact.tensors)
    plain = load_model(str(models(shape)))
    (long, _), _, _ = _padded_batch()
    with torch.no_grad():
        want, got = plain.model(long[None]).logits, loaded.model(long[None]).logits
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("method, shape", PAIRS)
def test_padded_batch_generates_what_each_sequence_gets_alone(served, method, shape):
    loaded, _, make_cache = served(method, shape)
    rows, ids, mask = _padded_batch()

    def generate(x, m=None):
        with torch.no_grad():
            return loaded.model.generate(
                x, attention_mask=m, cache=make_cache(), max_new_tokens=4, do_sample=False,
                pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip

    batch = generate(ids, mask)
    # a batch's rounding can flip a low-bit code now and then; a flipped trellis decision
    # moves the Viterbi path, so the levels of the elements after it, and every later
    # layer's inputs (seen on an AMD EPYC VM: logits 0.05 apart out of 0.5 after prefill)
    atol = 1e-1 if method == "trellis" else 2e-3
    for i, row in enumerate(rows):
        alone = generate(row[None])
        for step, want in enumerate(alone.logits):
            torch.testing.assert_close(batch.logits[step][i], want[0], atol=atol, rtol=1e-5)
            token, alone_token = (
                batch.sequences[i, PROMPT + step],
                alone.sequences[0, row.numel() + step],
            )
            if token != alone_token:  # only a near tie may go either way; then paths part
                top = want[0].topk(2).values
                assert top[0] - top[1] < 2 * atol, (i, step)
                break


@pytest.mark.parametrize("method, shape", TRITON)
def test_triton_decode_step_equals_the_reference(served, method, shape):
    """A padded batch's prefill on the reference, then one decode step on each backend
    (Triton: its append kernels where the layout has one, and its attention kernel)."""
    loaded, artifact, make_cache = served(method, shape)
    _, ids, mask = _padded_batch()
    cache = make_cache("reference")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate places a padded batch
    with torch.no_grad():
        loaded.model(ids, attention_mask=mask, position_ids=positions, cache=cache)
    if artifact is not None and load_prefix(artifact) is not None:
        assert cache.layers[0].prefix_rows(cache.layers[0].state) is not None
    step = torch.tensor([[17], [23]])
    mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
    positions = positions[:, -1:] + 1
    logits = {}
    for backend in ("reference", "triton"):
        twin = copy.deepcopy(cache)
        twin.backend = backend
        with torch.no_grad():
            out = loaded.model(step, attention_mask=mask, position_ids=positions, cache=twin)
        logits[backend] = out.logits
    ref = logits["reference"]
    # each layer's attention agrees within 3e-7, but a trellis search (torch, both backends)
    # on the next layer's K/V so perturbed can flip a near-tie and move the path
    atol = (1e-2 if method == "trellis" else 1e-4) * ref.abs().max().item()
    torch.testing.assert_close(logits["triton"], ref, atol=atol, rtol=0)


@pytest.mark.parametrize("method, shape, needle", [
    ("int2", "llama-d100-gqa2", "group size 32 does not divide head_dim 100"),
    ("kivi2", "llama-d80-mqa-llama3-tied", "group size 32 does not divide head_dim 80"),
])  # fmt: skip
def test_a_policy_whose_groups_do_not_fit_the_head_is_refused(models, method, shape, needle):
    with pytest.raises(KvqError, match=needle):
        cache_for(load_model(str(models(shape))), policy=method)


def test_cli_calibrate_export_eval_and_refuse_another_model(models, data, tmp_path):
    """The user's path on an odd shape: calibrate, export the manifest, run-eval; the
    artifact against a model of another head_dim or layer count is a one-line refusal."""
    model_dir, art = models("llama-d100-gqa2"), tmp_path / "A"
    small = ["--dataset", data, "--samples", 2, "--seqlen", 24]
    made = _run("calibrate", "auto", "--bits", 4, "--model", model_dir, *small, "--out", art)
    assert made.exit_code == 0, made.output
    shown = _run("export", "manifest", art)
    assert shown.exit_code == 0, shown.output
    manifest, _ = json.JSONDecoder().raw_decode(shown.stdout)  # then the validity line
    assert manifest["architecture"]["head_dim"] == 100
    evaluate = ["--dataset", data, "--windows", 1, "--seqlen", 16, "--tasks", "ppl"]
    ran = _run("run-eval", "--model", model_dir, "--artifact", art, *evaluate)
    assert ran.exit_code == 0, ran.output
    family, overrides = SHAPES["llama-d100-gqa2"]
    for change, needle in (({"head_dim": 112}, "head_dim"), ({"num_hidden_layers": 3}, "layers")):
        other = tmp_path / needle
        make_tiny_model(family, **(overrides | change)).save_pretrained(other)
        tiny_tokenizer().save_pretrained(other)
        refused = _run("run-eval", "--model", other, "--artifact", art, *evaluate)
        _one_line_error(refused, "incompatible", needle)


def test_channel_scales_default_value_group_on_head_dim_100_is_one_line(models, data, tmp_path):
    """--v-group 32 (the default) cannot group a head of 100: refused before anything is
    written, with the way out (a divisor, or 0: one group per head)."""
    out = tmp_path / "A"
    result = _run("calibrate", "channel-scales", "--model", models("llama-d100-gqa2"),
                  "--dataset", data, "--samples", 1, "--seqlen", 16, "--out", out)  # fmt: skip
    _one_line_error(result, "--v-group 32 does not divide head_dim 100", "0: one group per head")
    assert not out.exists()
