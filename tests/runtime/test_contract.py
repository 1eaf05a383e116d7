"""The cache contract: every kvq layout through every transformers generation path.

Each layout runs on tiny Llama, Qwen2 and Gemma 3 models (Gemma's sliding window is 8,
so the long prompts below pass twice the window). What must hold:
* full precision reproduces `DynamicCache` token for token (INT8 too, where noted);
* every layout is self-consistent: left padding, assisted decoding, prompt lookup,
  chunked prefill, continuing a returned cache and a deep copy change nothing;
* beam search, beam sampling and several return sequences run and keep the cache's
  batch rows, codes and sink rows together;
* every `Cache` method transformers calls behaves as transformers' own caches do.

KVQ_CONTRACT_HF=1 adds transformers' `QuantizedCache` (quanto, 4 bits) as a layout, for
`bench/cache_contract.py`'s comparison; it is not expected to pass everything.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from transformers import DynamicCache

from kvq.artifacts.store import read_artifact
from kvq.calibrators.options import ChannelScalesOptions, KVQuantOptions
from kvq.models.loading import load_model
from kvq.pipeline import cache_for
from kvq.quant.schemes import CachePolicy, LayerPolicy, named_policy
from kvq.runtime.cache import QuantizedKVCache, build_cache
from tests.conftest import FAMILY_CONFIGS, calibrate

# many interpreted Triton launches or every model family: `make test-quick` skips it
pytestmark = pytest.mark.slow

FAMILIES = ["llama", "qwen2", "gemma3"]
# named layouts (policy, sink tokens) and calibrated artifacts (pass options)
NAMED = {
    "fp16": ("fp16", 0),
    "int8": ("int8", 0),
    "int4-sink2": ("int4", 2),
    # small groups and windows, so these short prompts reach quantized groups
    "kivi4-g4-r6": ("kivi4-g4-r6", 1),
    "kivi2-g8-r8": ("kivi2-g8-r8", 0),
    "kv4-qserve": ("kv4-qserve", 0),  # its own sink: the first token exact
    "fp8-e4m3": ("fp8-e4m3", 0),  # static scale 1.0
}
ARTIFACTS = {
    "channel-scales": ChannelScalesOptions(bits=4, value_group=8, sink=1),
    "kvquant": KVQuantOptions(bits=3, fisher=False, sink=2),
}
LAYOUTS = [*NAMED, *ARTIFACTS] + (["hf-quanto"] if os.environ.get("KVQ_CONTRACT_HF") else [])
MATCHES_DYNAMIC = {"fp16", "int8"}  # layouts whose greedy tokens equal DynamicCache's
NEW = 6  # new tokens per generate call


@pytest.fixture(scope="module")
def setups(tiny_model_dir, data, tmp_path_factory):
    """family -> (loaded model, {artifact layout: Artifact}), built once per module."""
    built = {}

    def get(family: str):
        if family not in built:
            model_dir = tiny_model_dir(family)
            loaded = load_model(str(model_dir))
            artifacts = {}
            for name, options in ARTIFACTS.items():
                out = tmp_path_factory.mktemp(f"{family}-{name}") / "ART"
                calibrate(model_dir, data, out, options)
                artifacts[name] = read_artifact(out)
            built[family] = (loaded, artifacts)
        return built[family]

    return get


class Case:
    """One family and layout: the model, and a fresh cache on demand."""

    def __init__(self, loaded, artifacts, layout: str):
        self.loaded, self.model, self.layout = loaded, loaded.model, layout
        self.artifacts = artifacts

    def cache(self):
        if self.layout == "hf-quanto":
            from transformers import QuantizedCache

            return QuantizedCache(backend="quanto", config=self.model.config, nbits=4)
        if self.layout in ARTIFACTS:
            return cache_for(self.loaded, artifact=self.artifacts[self.layout])
        name, sink = NAMED[self.layout]
        if not sink:
            return cache_for(self.loaded, policy=name)
        info = self.loaded.adapter.info
        policy = named_policy(name, info.num_layers, info.head_dim)
        if sink:
            lp = LayerPolicy(**{**policy.layers[0].__dict__, "sink_tokens": sink})
            policy = CachePolicy(name=f"{name}-sink{sink}", layers=(lp,) * info.num_layers)
        return build_cache(self.model, policy, {}, self.loaded.adapter)

    @torch.no_grad()
    def generate(self, ids, cache="fresh", **kwargs):
        cache = self.cache() if cache == "fresh" else cache
        kwargs.setdefault("max_new_tokens", NEW)
        kwargs.setdefault("do_sample", False)
        kwargs.setdefault("pad_token_id", 0)
        return self.model.generate(ids, cache=cache, **kwargs)


# every other family kvq takes, on the layouts that differ in kind: exact rows, residual
# groups, calibrated pre-RoPE codes with sink tokens
MORE_FAMILIES = list(FAMILY_CONFIGS)
MORE_LAYOUTS = ["int8", "kivi2-g8-r8", "kvquant"]
CASES = [(f, lay) for f in FAMILIES for lay in LAYOUTS]
CASES += [(f, lay) for f in MORE_FAMILIES for lay in MORE_LAYOUTS]


@pytest.fixture(params=CASES, ids=lambda p: "-".join(p))
def case(request, setups):
    family, layout = request.param
    loaded, artifacts = setups(family)
    return Case(loaded, artifacts, layout)


def _ids(n, seed=0, b=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (b, n), generator=g)


def _left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.numel() for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.numel() :] = r
        mask[i, width - r.numel() :] = 1
    return ids, mask


# --- generation paths ---------------------------------------------------------------------


def test_greedy_matches_dynamic_cache_where_lossless(case):
    ids = _ids(20)  # past twice Gemma's window of 8
    got = case.generate(ids)
    assert got.shape == (1, 20 + NEW)
    if case.layout in MATCHES_DYNAMIC:
        want = case.generate(ids, cache=DynamicCache(config=case.model.config))
        assert torch.equal(got, want)
    assert torch.equal(case.generate(ids), got)  # deterministic


def test_sampling_runs_and_is_reproducible(case):
    ids = _ids(12, seed=1)
    torch.manual_seed(5)
    a = case.generate(ids, do_sample=True, top_k=20)
    torch.manual_seed(5)
    b = case.generate(ids, do_sample=True, top_k=20)
    assert torch.equal(a, b)


def test_left_padding_changes_nothing(case):
    long, short = _ids(18, seed=2)[0], _ids(7, seed=3)[0]
    ids, mask = _left_pad([long, short])
    if case.layout != "hf-quanto":
        # layer 0 sees the same inputs padded or not: every real row it stores, sink rows
        # included, must be what the sequence alone stores, up to fp32 matmul rounding
        # (which can move a row kept exact in fp16 by one fp16 step)
        padded = case.cache()
        with torch.no_grad():
            positions = (mask.cumsum(1) - 1).clamp(min=0)  # as generate gives them
            case.model(ids, attention_mask=mask, position_ids=positions, cache=padded)
        layer = padded.layers[0]
        got = layer.visible_rows(layer.state)
        for i, row in enumerate((long, short)):
            alone = case.cache()
            with torch.no_grad():
                case.model(row[None], cache=alone)
            want = alone.layers[0].visible_rows(alone.layers[0].state)
            visible = want[0].shape[2]
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(
                    g[i : i + 1, :, g.shape[2] - visible :], w, atol=1e-5, rtol=2**-10
                )
    # end to end: equal up to the rounding of differently shaped batches, which can flip an
    # INT4 or FP8 code now and then (a flipped code then moves later layers by a quantization
    # step, an FP8 one by up to 1/8 of the value: 2.6e-3 on a Xeon's matmul kernels, Gemma 3)
    tol = 2e-5 if case.layout in MATCHES_DYNAMIC else 5e-3 if case.layout == "fp8-e4m3" else 2e-3
    out = case.generate(ids, attention_mask=mask, output_logits=True, return_dict_in_generate=True)
    for i, row in enumerate((long, short)):
        alone = case.generate(row[None], output_logits=True, return_dict_in_generate=True)
        for step, logits in enumerate(alone.logits):
            torch.testing.assert_close(out.logits[step][i], logits[0], atol=tol, rtol=1e-5)


def test_beam_search_and_return_sequences(case):
    ids = _ids(14, seed=4, b=2)
    beams = case.generate(ids, num_beams=3, num_return_sequences=2)
    assert beams.shape == (4, 14 + NEW)
    if case.layout == "fp16":
        want = case.generate(
            ids, cache=DynamicCache(config=case.model.config), num_beams=3, num_return_sequences=2
        )
        assert torch.equal(beams, want)
    torch.manual_seed(0)
    sampled = case.generate(ids, num_beams=2, do_sample=True, num_return_sequences=2)
    assert sampled.shape == (4, 14 + NEW)
    torch.manual_seed(1)
    several = case.generate(ids, do_sample=True, num_return_sequences=3)
    assert several.shape == (6, 14 + NEW)


def test_assisted_and_prompt_lookup_decoding_equal_greedy(case):
    ids = torch.cat([_ids(9, seed=5), _ids(9, seed=5)], dim=1)  # repeats: lookup finds drafts
    greedy = case.generate(ids, max_new_tokens=10)
    assisted = case.generate(ids, max_new_tokens=10, assistant_model=case.model)
    lookup = case.generate(ids, max_new_tokens=10, prompt_lookup_num_tokens=3)
    assert torch.equal(assisted, greedy)
    assert torch.equal(lookup, greedy)


def test_continuing_a_returned_cache_and_a_deep_copy(case):
    ids = _ids(19, seed=6)
    whole = case.generate(ids, max_new_tokens=2 * NEW)
    first = case.generate(ids, return_dict_in_generate=True)
    cache = first.past_key_values
    fork = copy.deepcopy(cache)
    again = case.generate(first.sequences, cache=cache)
    assert torch.equal(again, whole)
    # the copy is independent of the original, which has moved on
    assert fork.get_seq_length() == ids.shape[1] + NEW - 1
    assert torch.equal(case.generate(first.sequences, cache=fork), whole)


def test_chunked_prefill_and_inputs_embeds(case):
    ids = _ids(21, seed=7)
    want = case.generate(ids, output_logits=True, return_dict_in_generate=True)
    chunked = case.generate(ids, prefill_chunk_size=5, output_logits=True,
                            return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(chunked.sequences, want.sequences)
    for a, b in zip(chunked.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    embeds = case.model.get_input_embeddings()(ids)
    with torch.no_grad():
        from_embeds = case.model.generate(
            inputs_embeds=embeds, cache=case.cache(), max_new_tokens=NEW, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
    assert torch.equal(from_embeds, want.sequences[:, ids.shape[1] :])


# --- the Cache methods transformers calls ---------------------------------------------------


def _prefilled(case, n=20, b=2):
    cache = case.cache()
    with torch.no_grad():
        logits = case.model(_ids(n, seed=8, b=b), cache=cache).logits
    return cache, logits


def test_crop_removes_tokens_as_transformers_defines(case):
    if case.layout == "hf-quanto":
        pytest.skip("QuantizedCache cannot crop")
    cache, _ = _prefilled(case)
    cache.activate_past_recording()
    step = _ids(3, seed=9, b=2)
    with torch.no_grad():
        want = case.model(step, cache=copy.deepcopy(cache)).logits
        case.model(_ids(4, seed=10, b=2), cache=cache)  # a rejected draft of 4 tokens
    assert cache.get_seq_length() == 24
    cache.crop(0)  # removes nothing
    assert cache.get_seq_length() == 24
    cache.crop(-4)
    assert cache.get_seq_length() == 20
    with torch.no_grad():
        got = case.model(step, cache=cache).logits
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(5)


def test_batch_methods_take_any_index(case):
    cache, _ = _prefilled(case, b=3)
    assert cache.batch_size == 3
    rows = torch.tensor([2, 2, 0])  # repeated and dropped rows, as beam search produces
    ref = copy.deepcopy(cache)
    cache.reorder_cache(rows)
    step = _ids(1, seed=11, b=3)
    with torch.no_grad():
        got = case.model(step, cache=cache).logits
        for i, src in enumerate(rows.tolist()):
            one = copy.deepcopy(ref)
            one.batch_select_indices(torch.tensor([src]))
            want = case.model(step[i : i + 1], cache=one).logits
            torch.testing.assert_close(got[i : i + 1], want, atol=2e-4, rtol=1e-4)
    cache.batch_repeat_interleave(2)
    assert cache.batch_size == 6
    cache.batch_select_indices(torch.tensor([5, 0]))
    assert cache.batch_size == 2
    if isinstance(cache, QuantizedKVCache):
        assert cache.max_batch_size == 2


def test_sizes_flags_and_reset(case):
    cache, _ = _prefilled(case, n=20)
    assert cache.get_seq_length() == 20
    for i, layer in enumerate(cache.layers):
        length, offset = cache.get_mask_sizes(3, i)
        if getattr(layer, "is_sliding", False):  # Gemma's window of 8: the rest evicted
            assert length - 3 >= 7 and offset == 20 - (length - 3)
        else:
            assert (length, offset) == (23, 0)
    assert cache.is_compileable is False
    cache.reset()
    assert cache.get_seq_length() == 0
    cache2, logits = _prefilled(case, n=20)
    with torch.no_grad():
        again = case.model(_ids(20, seed=8, b=2), cache=cache).logits
    torch.testing.assert_close(again, logits)
