"""run-eval's quality numbers on a tiny model."""

import math

import torch

from kvq.eval.quality import evaluate
from kvq.models.adapters import get_adapter
from kvq.progress import Progress
from kvq.quant.schemes import named_policy
from kvq.runtime.cache import build_cache
from tests.conftest import make_tiny_model


def _setup(name):
    model = make_tiny_model("gemma3")
    ad = get_adapter(model)
    windows = torch.randint(3, 200, (2, 20), generator=torch.Generator().manual_seed(0))
    policy = named_policy(name, ad.info.num_layers, ad.info.head_dim)
    return model, windows, lambda: build_cache(model, policy, {}, ad)


def test_full_precision_cache_scores_like_the_baseline():
    for protocol in ("prefill", "decode"):
        model, windows, make = _setup("fp16")
        res = evaluate(model, windows, make, protocol, Progress()).as_json(("ppl", "kld", "bytes"))
        assert math.isclose(res["ppl"]["ratio"], 1.0, rel_tol=1e-4)
        assert abs(res["kld"]["mean"]) < 1e-6
        assert res["kld"]["top1_agreement"] == 1.0
        expected_tokens = 2 * 19 if protocol == "prefill" else 2 * 9
        assert res["ppl"]["scored_tokens"] == expected_tokens


def test_quantized_cache_moves_the_numbers_and_saves_bytes():
    model, windows, make = _setup("int2")
    res = evaluate(model, windows, make, "prefill", Progress()).as_json(("ppl", "kld", "bytes"))
    assert res["kld"]["mean"] > 1e-4
    assert res["ppl"]["ratio"] != 1.0
    assert res["bytes"]["ratio"] < 0.5
    assert res["bytes"]["kv_bytes_per_token"] < res["bytes"]["fp16_bytes_per_token"]


def test_decode_batches_windows_like_one_at_a_time(monkeypatch):
    """Teacher-forcing windows together scores what one window at a time scores."""
    from kvq.eval import quality

    model, windows, make = _setup("int4")
    batched = evaluate(model, windows, make, "decode", Progress()).totals
    monkeypatch.setattr(quality, "DECODE_LOGITS_BUDGET", 1)  # one window per batch
    single = evaluate(model, windows, make, "decode", Progress()).totals
    assert batched.tokens == single.tokens == 2 * 9
    assert math.isclose(batched.nll_quant, single.nll_quant, rel_tol=1e-4)
    assert math.isclose(batched.kl, single.kl, rel_tol=1e-3, abs_tol=1e-6)
    assert batched.kl > 1e-5  # the quantized cache is really in the loop


def test_evaluate_many_shares_the_baseline_and_scores_each_cache_as_evaluate_does():
    from kvq.eval.quality import evaluate_many

    model = make_tiny_model("gemma3")
    ad = get_adapter(model)
    windows = torch.randint(3, 200, (3, 16), generator=torch.Generator().manual_seed(1))

    def maker(name):
        policy = named_policy(name, ad.info.num_layers, ad.info.head_dim)
        return lambda: build_cache(model, policy, {}, ad)

    names = ("int4", "fp8-e4m3-dynamic")
    seen = []
    many = evaluate_many(
        model, windows, {n: maker(n) for n in names}, Progress(), lambda i, r: seen.append(i)
    )
    assert seen == [0, 1, 2]
    tasks = ("ppl", "kld", "bytes")
    for name in names:
        alone = evaluate(model, windows, maker(name), "prefill", Progress())
        assert many[name].as_json(tasks) == alone.as_json(tasks)


def test_by_position_splits_the_scored_tokens_and_sums_to_the_totals():
    model, windows, make = _setup("int2")
    for protocol in ("prefill", "decode"):
        res = evaluate(model, windows, make, protocol, Progress())
        rows = res.as_json(("ppl",))["ppl"]["by_position"]
        assert sum(r["tokens"] for r in rows) == res.totals.tokens
        assert all(r["start"] < r["end"] <= windows.shape[1] for r in rows)
        kl = sum(r["kld"] * r["tokens"] for r in rows)
        assert math.isclose(kl, res.totals.kl, rel_tol=1e-6)
        nll = sum(r["nll_delta"] * r["tokens"] for r in rows)
        # a difference of two fp32 sums: it is as exact as the sums are, not as itself
        ulps = 1e-5 * (abs(res.totals.nll_quant) + abs(res.totals.nll_base))
        assert math.isclose(nll, res.totals.nll_quant - res.totals.nll_base, abs_tol=ulps)
        if protocol == "decode":  # only the teacher-forced second half is scored
            assert rows[0]["start"] >= windows.shape[1] // 2 - windows.shape[1] // 8


def test_long_windows_are_scored_in_chunks_as_one_forward_scores_them(monkeypatch):
    """Chunked prefill (baseline through DynamicCache, the cache a chunk at a time) gives
    the figures of one whole-window forward: what makes 8K windows fit in memory."""
    from kvq.eval import quality

    for name in ("fp16", "int4", "kivi4-g4-r4"):
        model, windows, make = _setup(name)
        whole = evaluate(model, windows, make, "prefill", Progress()).totals
        monkeypatch.setattr(quality, "PREFILL_CHUNK", 6)  # 20 tokens: chunks of 6, 6, 6, 2
        chunked = evaluate(model, windows, make, "prefill", Progress()).totals
        monkeypatch.undo()
        assert chunked.tokens == whole.tokens
        assert math.isclose(chunked.nll_base, whole.nll_base, rel_tol=1e-5)
        assert math.isclose(chunked.nll_quant, whole.nll_quant, rel_tol=2e-3), name
        assert math.isclose(chunked.kl, whole.kl, rel_tol=5e-2, abs_tol=1e-5), name
