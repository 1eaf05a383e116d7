"""A cache's state beyond one forward on the odd shapes of test_pass_shapes, for the layouts
that carry more than rows: sink rows, NUQ / vector-code exceptions (flat entries), KIVI
groups and their exact residual window, prefix rows (PrefixQuant, IntactKV) and sliding
windows shorter than the prompt. What must hold:
* save mid-generation, load into a fresh cache, continue: what the original continues with;
* fork after the prompt, continue both ways: each what a cache that saw only its own tokens
  gives;
* crop a rejected draft, continue: what a cache that never saw the draft gives, and
  assisted decoding (which crops) equals greedy;
* beam search keeps each beam's rows together: a returned beam's score is what a fresh
  cache fed that beam's tokens gives, and on the Triton backend what the reference gives;
* a left-padded batch (each sequence's own group phase) survives save / load and a crop.
Each pair asserts first that its cache holds the state it is here for (CARRIES).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from kvq.errors import KvqError
from kvq.runtime.saved import restore_cache
from tests import test_pass_shapes as shapes
from tests.test_pass_shapes import PROMPT, _padded_batch

# many interpreted Triton launches or every model family: `make test-quick` skips it
pytestmark = pytest.mark.slow

models, served = shapes.models, shapes.served  # its module fixtures: the tiny models, calibrated

# (layout, shape) -> the state beyond rows its layers carry after a prompt past the window
CARRIES = {
    ("auto4", "mistral-d128-mha-window6"): {"sink", "exceptions", "evicted"},  # NUQ, pre-RoPE
    ("auto4", "gemma3-d256-gqa2-window8"): {"sink", "exceptions", "evicted"},
    ("vq", "qwen2-d64-gqa7-tied"): {"sink", "exceptions"},  # 7 query heads a KV head
    ("vq", "mistral-d128-mha-window6"): {"sink", "exceptions", "evicted"},
    ("kivi2-g16-r8", "qwen2-d112-gqa4-yarn"): {"residual"},  # groups of 16 and exact rows
    ("kivi2-g16-r8", "mistral-d128-mha-window6"): {"evicted"},  # a closed group evicted
    ("kivi4-g16-r8", "llama-d80-mqa-llama3-tied"): {"residual"},
    ("kivi4-g16-r8", "gemma3-d256-gqa2-window8"): {"residual", "evicted"},
    ("prefixquant", "llama-d96-gqa8-linear"): {"prefix"},  # the rows the pass found
    ("prefixquant", "gemma3-d256-gqa2-window8"): {"prefix", "evicted"},
    ("intactkv", "llama-d80-mqa-llama3-tied"): {"sink", "prefix"},  # trained prefix rows
    ("intactkv", "mistral-d128-mha-window6"): {"sink", "prefix", "evicted"},
    ("kv4-qserve", "mistral-d128-mha-window6"): {"sink", "evicted"},  # its exact first token
    ("kv-scales-int8", "gemma3-d256-gqa2-window8"): {"evicted"},  # sliding and global, d 256
}  # fmt: skip
PAIRS = list(CARRIES)
N, M = 3, 4  # tokens generated before a save / fork, and after


def _tokens(n, seed, b=1):
    return torch.randint(3, 500, (b, n), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, cache, **kwargs):
    kwargs = dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True) | kwargs
    with torch.no_grad():
        return model.generate(ids, cache=cache, **kwargs)


@torch.no_grad()
def _feed(model, cache, ids, one_by_one=False):
    """Logits [B, T, V] of `ids` appended to `cache` in one forward or token by token."""
    if not one_by_one:
        return model(ids, cache=cache).logits
    return torch.cat([model(ids[:, i : i + 1], cache=cache).logits for i in range(ids.shape[1])], 1)


@pytest.mark.parametrize("method, shape", PAIRS)
def test_saved_mid_generation_continues_as_the_original(served, tmp_path, method, shape):
    loaded, _, make_cache = served(method, shape)
    (long, _), _, _ = _padded_batch()
    first = _generate(loaded.model, long[None], make_cache(), max_new_tokens=N)
    original = first.past_key_values
    carried = set()
    for layer in original.layers:
        st = layer.state
        held = {
            "sink": st.sink is not None,
            "exceptions": any(f.length for f in st.flat.values()),
            "residual": st.main.length > 0 and st.residual.length > 0,  # groups and exact rows
            "prefix": st.prefix is not None,
            "evicted": st.evicted > 0,
        }
        carried |= {name for name, h in held.items() if h}
    assert carried == CARRIES[method, shape]
    path = tmp_path / "state.safetensors"
    original.save(path)
    restored = restore_cache(make_cache(), path)  # what QuantizedKVCache.load returns
    assert restored.get_seq_length() == original.get_seq_length() == PROMPT + N - 1
    assert restored.nbytes() == original.nbytes()
    more = dict(max_new_tokens=M, output_logits=True)
    got = _generate(loaded.model, first.sequences, restored, **more)
    want = _generate(loaded.model, first.sequences, original, **more)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # the same rows, bit for bit
    whole = _generate(loaded.model, long[None], make_cache(), max_new_tokens=N + M)
    assert torch.equal(got.sequences, whole.sequences)


@pytest.mark.parametrize("method, shape", PAIRS)
def test_forked_caches_continue_as_each_alone(served, method, shape):
    loaded, _, make_cache = served(method, shape)
    model = loaded.model
    (long, _), _, _ = _padded_batch()
    cache = make_cache()
    _feed(model, cache, long[None])
    twin = cache.fork()
    # a chunk, then single steps: groups close, residual rows move, the window evicts
    a, b = _tokens(2 * M, 1), _tokens(2 * M, 2)
    got_a = torch.cat([_feed(model, cache, a[:, :M]), _feed(model, cache, a[:, M:], True)], 1)
    got_b = torch.cat([_feed(model, twin, b[:, :M]), _feed(model, twin, b[:, M:], True)], 1)
    for cont, got in ((a, got_a), (b, got_b)):
        alone = make_cache()
        _feed(model, alone, long[None])
        want = torch.cat(
            [_feed(model, alone, cont[:, :M]), _feed(model, alone, cont[:, M:], True)], 1
        )
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert cache.get_seq_length() == twin.get_seq_length() == PROMPT + 2 * M


@pytest.mark.parametrize("method, shape", PAIRS)
def test_cropped_draft_leaves_no_trace(served, method, shape):
    loaded, _, make_cache = served(method, shape)
    model = loaded.model
    (long, _), _, _ = _padded_batch()
    cache = make_cache()
    _feed(model, cache, long[None])
    _feed(model, cache, _tokens(2, 3), one_by_one=True)  # accepted tokens
    cache.activate_past_recording()
    never = copy.deepcopy(cache)
    _feed(model, cache, _tokens(4, 4))  # a rejected draft of 4 tokens
    _feed(model, cache, _tokens(1, 5))  # and the verified token after it: 5 to roll back
    cache.crop(-5)
    assert cache.get_seq_length() == never.get_seq_length() == PROMPT + 2
    step = _tokens(M, 6)
    got = _feed(model, cache, step, one_by_one=True)
    want = _feed(model, never, step, one_by_one=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    # the public path: assisted decoding verifies drafts and crops the rejected ones
    greedy = _generate(loaded.model, long[None], make_cache(), max_new_tokens=6)
    assisted = _generate(
        loaded.model, long[None], make_cache(), max_new_tokens=6, assistant_model=model
    )
    assert torch.equal(assisted.sequences, greedy.sequences)


@pytest.mark.parametrize("method, shape", PAIRS)
def test_beam_search_keeps_each_beams_rows_together(served, method, shape):
    loaded, _, make_cache = served(method, shape)
    model = loaded.model
    (long, _), _, _ = _padded_batch()
    beams = _generate(
        model, long[None], make_cache(), max_new_tokens=M, num_beams=2, num_return_sequences=2,
        length_penalty=0.0, output_scores=True,
    )  # fmt: skip
    assert beams.sequences.shape == (2, PROMPT + M)
    for seq, score in zip(beams.sequences, beams.sequences_scores, strict=True):
        # a fresh cache fed the prompt, then the beam's tokens one step at a time
        alone = make_cache()
        logits = [_feed(model, alone, long[None])[:, -1]]
        new = seq[PROMPT:][None]
        logits += list(_feed(model, alone, new[:, :-1], one_by_one=True).unbind(1))
        logp = torch.stack(logits, 1).float().log_softmax(-1)  # [1, M, V]
        want = logp.gather(-1, new[..., None]).sum()
        torch.testing.assert_close(score, want, atol=1e-3, rtol=1e-4)


@torch.no_grad()
def _padded_steps(model, cache, ids, mask, tokens):
    """Logits [2, T, V] of `tokens` [2, T] fed one step at a time after a padded batch
    whose mask so far is `mask`, positions as generate gives them; returns the new mask."""
    out = []
    for t in range(tokens.shape[1]):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        pos = mask.sum(-1, keepdim=True) - 1
        out.append(model(tokens[:, t : t + 1], attention_mask=mask, position_ids=pos,
                         cache=cache).logits)  # fmt: skip
    return torch.cat(out, 1), mask


@pytest.mark.parametrize("method, shape", PAIRS)
def test_padded_batch_saved_and_cropped(served, tmp_path, method, shape):
    """A left-padded batch's state (each sequence's group phase, first real token) survives
    save / load, and a crop of a rejected step leaves no trace."""
    loaded, _, make_cache = served(method, shape)
    model = loaded.model
    _, ids, mask = _padded_batch()
    cache = make_cache()
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        model(ids, attention_mask=mask, position_ids=pos, cache=cache)
    _, mask = _padded_steps(model, cache, ids, mask, _tokens(2, 7, b=2))
    cache.save(tmp_path / "state.safetensors")
    restored = restore_cache(make_cache(), tmp_path / "state.safetensors")
    plain = copy.deepcopy(cache)  # as saved
    cache.activate_past_recording()
    never = copy.deepcopy(cache)
    _padded_steps(model, cache, ids, mask, _tokens(3, 8, b=2))  # rejected
    cache.crop(-3)
    step = _tokens(M, 9, b=2)
    # compared bit for bit with a cache in the same recording state: while recording, a
    # padded batch keeps more exact rows (masked), which moves fp32 sums by an ulp or so
    for name, other, ref in (("cropped", cache, never), ("restored", restored, plain)):
        got, _ = _padded_steps(model, other, ids, mask, step)
        want, _ = _padded_steps(model, ref, ids, mask, step)
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("method, shape", [
    ("kivi2-g16-r8", "qwen2-d112-gqa4-yarn"),  # a padded batch's exact rows, dropped
    ("kv4-qserve", "mistral-d128-mha-window6"),  # rows the window dropped
])  # fmt: skip
def test_crop_past_dropped_rows_is_a_one_line_refusal(served, method, shape):
    """Without activate_past_recording a cache drops what greedy decoding no longer needs;
    a crop back past those rows is refused (KvqError: the CLI's one line), the cache
    left as it was."""
    loaded, _, make_cache = served(method, shape)
    model = loaded.model
    (long, _), ids, mask = _padded_batch()
    cache = make_cache()
    if method.startswith("kivi"):
        with torch.no_grad():
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            model(ids, attention_mask=mask, position_ids=pos, cache=cache)
        _padded_steps(model, cache, ids, mask, _tokens(3, 8, b=2))
        n, needle = 3, "exact rows are gone"
    else:
        _feed(model, cache, long[None])
        _feed(model, cache, _tokens(3, 1))
        n, needle = 5, "sliding window has already dropped"
    seen = cache.get_seq_length()
    with pytest.raises(KvqError, match=f"{needle}.*activate_past_recording"):
        cache.crop(-n)
    assert cache.get_seq_length() == seen


# the Triton interpreter costs 5-25 s a beam search here: one pair by default (NUQ
# exceptions, a sink and an evicting window), KVQ_STATE_TRITON=all for the four families
TRITON = [("auto4", "mistral-d128-mha-window6")]
if os.environ.get("KVQ_STATE_TRITON") == "all":
    TRITON += [("vq", "qwen2-d64-gqa7-tied"), ("kivi2-g16-r8", "qwen2-d112-gqa4-yarn"),
               ("prefixquant", "llama-d96-gqa8-linear")]  # fmt: skip


@pytest.mark.parametrize("method, shape", TRITON)
def test_beam_search_on_triton_equals_the_reference(served, method, shape):
    """Beam search on a left-padded batch: the Triton backend (its append kernels writing
    the pages that reorder_cache then picks from, and its attention) gives the reference's
    beams and scores."""
    loaded, _, make_cache = served(method, shape)
    _, ids, mask = _padded_batch()
    out = {}
    for backend in ("reference", "triton"):
        out[backend] = _generate(
            loaded.model, ids, make_cache(backend), attention_mask=mask, max_new_tokens=2,
            num_beams=2, num_return_sequences=2, output_scores=True,
        )  # fmt: skip
    ref, got = out["reference"], out["triton"]
    assert got.sequences.shape == (4, PROMPT + 2)
    assert torch.equal(got.sequences, ref.sequences)
    torch.testing.assert_close(got.sequences_scores, ref.sequences_scores, atol=1e-4, rtol=0)
