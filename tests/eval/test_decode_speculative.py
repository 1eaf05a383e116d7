"""run-eval's decode and speculative tasks: prompts, divergence, rollbacks, the report."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

import kvq
from kvq.errors import KvqError
from kvq.eval.tasks import get_task
from kvq.eval.tasks.base import EvalParams, TaskContext
from kvq.eval.tasks.decode import greedy
from kvq.eval.tasks.prompts import draw_prompts, prompt_length, served
from kvq.eval.tasks.speculative import DRAFT_K, draft_decode, lookup_decode
from kvq.progress import Progress
from tests.conftest import _FALLBACK_TEXT, CALIBRATION_TXT, tiny_tokenizer
from tests.eval.counting import CountingProgress

NEW = 16  # tiny models: 256 positions; 32 + 16 tokens cross gemma3's window of 8 often
COARSE = "int2"  # per-token INT2: diverges within a few tokens on the tiny gemma3


@pytest.fixture(scope="module")
def text() -> str:
    return (
        CALIBRATION_TXT.read_text(encoding="utf-8") if CALIBRATION_TXT.is_file() else _FALLBACK_TEXT
    )


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return kvq.load_model(str(tiny_model_dir("llama")))[0]


@pytest.fixture(scope="module")
def gemma(tiny_model_dir):
    """Sliding layers with a window of 8: every draft round crosses it."""
    return kvq.load_model(str(tiny_model_dir("gemma3")))[0]


def _ctx(model, policy, text, progress=None, **params) -> TaskContext:
    sizes = dict(contexts=(32,), new_tokens=NEW, prompts=2) | params
    return TaskContext(
        loaded=model._kvq_loaded,
        make_cache=lambda: kvq.make_cache(model, policy=policy),
        cache_name=policy,
        text=text,
        params=EvalParams(**sizes),
        progress=progress or Progress(),
    )


@pytest.fixture(scope="module")
def fp16_decode(llama, text):
    progress = CountingProgress()
    return get_task("decode").run(_ctx(llama, "fp16", text, progress)), progress


@pytest.fixture(scope="module")
def coarse_decode(gemma, text):
    return get_task("decode").run(_ctx(gemma, COARSE, text))


# --- prompts ------------------------------------------------------------------------------


WIKI = "\n".join(
    [" = Birds = ", ""]
    + [f" The owl number {i} flew home . Then it slept until noon . " for i in range(60)]
    + [" = = Habitat = = ", ""]
)


def test_prompts_start_at_sentences_skip_headings_and_repeat_per_seed():
    tok = tiny_tokenizer()
    ids = draw_prompts(tok, WIKI, 4, 12, seed=0)  # [4, 12]
    assert ids.shape == (4, 12) and bool((ids[:, 0] == tok.bos_token_id).all())
    for row in ids:
        passage = tok.decode(row[1:])
        assert passage.startswith(("The owl", "Then it")) and "=" not in passage
    assert torch.equal(ids, draw_prompts(tok, WIKI, 4, 12, seed=0))
    assert not torch.equal(ids, draw_prompts(tok, WIKI, 4, 12, seed=1))
    assert len({tuple(r.tolist()) for r in ids}) == 4  # distinct passages


def test_too_few_passages_are_refused():
    with pytest.raises(KvqError, match="distinct passages"):
        draw_prompts(tiny_tokenizer(), "One short sentence.", 1, 64, seed=0)


def test_prompt_length_fits_the_context_or_is_refused():
    def ctx(contexts, limit):
        adapter = SimpleNamespace(max_positions=limit)
        return SimpleNamespace(
            params=EvalParams(contexts=contexts), loaded=SimpleNamespace(adapter=adapter)
        )

    assert prompt_length(ctx((64, 32), 256), 16) == 32  # min(--contexts)
    assert prompt_length(ctx((300,), 256), 16) == 240  # cut to fit the generation
    assert prompt_length(ctx((300,), 256), 16, SimpleNamespace(length=4)) == 236
    assert prompt_length(ctx((300,), None), 16) == 300
    with pytest.raises(KvqError, match="no room for a prompt"):
        prompt_length(ctx((32,), 256), 255)


def test_a_declared_prefix_is_served_to_the_baseline_too():
    ids = torch.tensor([[2, 7, 8], [2, 9, 10]])
    spec = SimpleNamespace(token_ids=(2, 5), length=2)  # IntactKV: BOS and one more token
    base, quant = served(ids, spec, bos=2)
    assert base.tolist() == [[2, 5, 7, 8], [2, 5, 9, 10]]
    assert quant.tolist() == [[7, 8], [9, 10]]  # the prefix supplies the BOS
    assert served(ids, None, bos=2) == (ids, ids)


# --- decode -------------------------------------------------------------------------------


def test_lossless_cache_decodes_the_baseline_tokens(fp16_decode):
    section, progress = fp16_decode
    assert section["cache"] == "fp16" and section["prompt_tokens"] == 32
    assert section["params"]["new_tokens"] == NEW
    assert [p["first_divergence"] for p in section["prompts"]] == [None, None]
    assert section["mean_agreement"] == 1.0 and section["median_first_divergence"] == NEW
    for p in section["prompts"]:
        assert p["agreement"] == 1.0
        assert p["ppl_quantized_continuation"] == p["ppl_baseline_continuation"]
    assert progress.totals == {"decode": 2 * NEW + 2} and progress.advanced == 2 * NEW + 2
    rows = get_task("decode").summary(section)
    assert rows[0] == ("decode token agreement", "1.000", "1.000")
    assert rows[1] == ("decode first divergence (median)", "—", f"none in {NEW}")


def test_coarse_cache_diverges_but_is_scored(coarse_decode):
    section = coarse_decode
    assert section["mean_agreement"] < 1.0
    assert any(p["first_divergence"] is not None for p in section["prompts"])
    assert section["median_first_divergence"] < NEW
    for key in ("ppl_baseline_continuation", "ppl_quantized_continuation"):
        assert math.isfinite(section[key]) and section[key] > 1.0
        assert all(math.isfinite(p[key]) for p in section["prompts"])
    for metric, base, quant in get_task("decode").summary(section):
        assert all(isinstance(x, str) for x in (metric, base, quant))
    json.dumps(section, allow_nan=False)  # plain JSON for the report


def test_scored_perplexity_is_that_of_one_forward(llama, text):
    """The chunked teacher-forced score equals a plain no-cache forward's."""
    from kvq.eval.tasks import decode

    ids = draw_prompts(tiny_tokenizer(), text, 2, 24, seed=3)  # [2, 24]
    cont = greedy(llama, ids, 12, DynamicCache(config=llama.config))  # [2, 12]
    logits = llama(torch.cat([ids, cont], 1), use_cache=False).logits[:, 23:-1]  # [2, 12, V]
    want = -torch.log_softmax(logits, -1).gather(-1, cont[..., None]).squeeze(-1).mean(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode, "SCORE_LOGITS_BYTES", 2 * 5 * llama.config.vocab_size * 4)  # 5 a chunk
        got = decode.continuation_nll(llama, ids, cont)
    torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)


def test_divergence_plot_is_a_png(coarse_decode, tmp_path):
    (path,) = get_task("decode").plot(coarse_decode, tmp_path / "plots")
    assert path == tmp_path / "plots" / "decode_divergence.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["decode", "speculative"])
def test_no_room_for_a_prompt_is_refused(llama, text, name):
    with pytest.raises(KvqError, match="no room for a prompt"):
        get_task(name).run(_ctx(llama, "fp16", text, new_tokens=255))
    with pytest.raises(KvqError, match="at least 1"):
        get_task(name).run(_ctx(llama, "fp16", text, new_tokens=0))


# --- speculative --------------------------------------------------------------------------


def test_lossless_draft_is_always_accepted(llama, text):
    progress = CountingProgress()
    section = get_task("speculative").run(_ctx(llama, "fp16", text, progress))
    assert section["draft_k"] == DRAFT_K == 4 and section["cache"] == "fp16"
    draft = section["quantized_draft"]
    assert draft["baseline_acceptance"] == 1.0 and draft["quantized_acceptance"] == 1.0
    assert draft["drafted"] == draft["accepted"] > 0
    lookup = section["prompt_lookup"]
    assert lookup["baseline_acceptance"] == lookup["quantized_acceptance"]
    assert progress.totals == {"speculative": 8} and progress.advanced == 8
    rows = get_task("speculative").summary(section)
    assert rows[0] == ("speculative acceptance, quantized draft (k=4)", "1.000", "1.000")
    assert rows[1][0] == "prompt-lookup acceptance (k=4)"


def test_sliding_window_caches_survive_the_rollbacks(gemma, text):
    """Window 8, drafts of 4: lossless caches must stay exact through the crops, and a
    coarse one must at least roll back without error (its drafts are then often wrong)."""
    lossless = get_task("speculative").run(_ctx(gemma, "fp16", text))["quantized_draft"]
    assert lossless["baseline_acceptance"] == 1.0 and lossless["quantized_acceptance"] == 1.0
    coarse = get_task("speculative").run(_ctx(gemma, COARSE, text))
    assert coarse["quantized_draft"]["baseline_acceptance"] == 1.0
    assert coarse["quantized_draft"]["quantized_acceptance"] < 1.0
    for side in ("baseline_acceptance", "quantized_acceptance"):
        rate = coarse["prompt_lookup"][side]
        assert rate is None or 0.0 <= rate <= 1.0
    json.dumps(coarse, allow_nan=False)  # plain JSON for the report


def test_speculative_outputs_are_the_verifiers_greedy_tokens(gemma, text):
    """Whatever the draft, the tokens are the verifier's greedy ones: the unquantized
    model's for a quantized draft, the quantized cache's own for prompt lookup (which a
    wrong crop of its sliding layers would change)."""
    ids = draw_prompts(tiny_tokenizer(), text, 1, 32, seed=5)  # [1, 32]
    base = greedy(gemma, ids, NEW, DynamicCache(config=gemma.config))
    quant = greedy(gemma, ids, NEW, kvq.make_cache(gemma, policy=COARSE))
    drafted, tally = draft_decode(gemma, ids, ids, NEW, kvq.make_cache(gemma, policy=COARSE), 4)
    assert torch.equal(drafted, base) and tally.drafted > 0
    looked, _ = lookup_decode(gemma, ids, NEW, kvq.make_cache(gemma, policy=COARSE), 4)
    assert torch.equal(looked, quant)


@pytest.mark.parametrize("policy", [None, COARSE])
def test_prompt_lookup_loop_decodes_what_generate_decodes(gemma, text, policy):
    """transformers' own prompt-lookup generate gives the same tokens (it may stop early,
    at an EOS, where the loop goes on)."""

    def cache():
        return (
            DynamicCache(config=gemma.config)
            if policy is None
            else kvq.make_cache(gemma, policy=policy)
        )

    for seed in range(2):
        ids = draw_prompts(tiny_tokenizer(), text, 1, 32, seed=seed)  # [1, 32]
        mine, _ = lookup_decode(gemma, ids, NEW, cache(), DRAFT_K)
        out = gemma.generate(
            ids, attention_mask=torch.ones_like(ids), cache=cache(), do_sample=False,
            prompt_lookup_num_tokens=DRAFT_K, max_new_tokens=NEW,
        )  # fmt: skip
        theirs = out[:, ids.shape[1] :]  # [1, <= NEW]
        assert theirs.shape[1] >= 1 and torch.equal(mine[:, : theirs.shape[1]], theirs)
