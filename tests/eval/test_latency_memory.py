"""run-eval's latency and memory tasks on a tiny random Gemma 3 (behaviour, never speed)."""

from __future__ import annotations

import math

import pytest
import torch

import kvq
from kvq.errors import KvqError
from kvq.eval.tasks import get_task
from kvq.eval.tasks import latency as lat
from kvq.eval.tasks import memory as mem
from kvq.eval.tasks.base import EvalParams, TaskContext
from kvq.runtime import attention
from kvq.runtime.cache import QuantizedKVCache
from kvq.runtime.kernels.decode import attention as kernels
from kvq.runtime.layers import KvqLayer
from tests.conftest import SHARED_DATA

CONTEXTS = (32, 64)
BUDGET = 1 << 20
ROW_KEYS = {
    "latency": {"context", "cache", "ms_per_token", "ms_per_token_iqr", "prefill_tokens_per_s",
                "append_ms_per_token", "append_share"},
    "memory": {"context", "cache", "bytes_per_request", "bytes_per_token",
               "max_concurrent_tokens", "peak_bytes"},
}  # fmt: skip


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    model, _ = kvq.load_model(str(tiny_model_dir("gemma3")))
    return model


@pytest.fixture(scope="module")
def text():
    """Real text when the shared data folder is there; the prompts repeat it if short."""
    path = SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            return f.read(20_000)
    return "Keys and values are cached per layer; queries attend to them. " * 50


def _ctx(model, text, **params) -> TaskContext:
    return TaskContext(
        loaded=model._kvq_loaded,
        make_cache=lambda: kvq.make_cache(model, policy="int8"),
        cache_name="int8",
        text=text,
        params=EvalParams(contexts=CONTEXTS, memory_budget=BUDGET, **params),
    )


def _originals():
    """What the instruments patch, as stored on their owners."""
    return [
        vars(QuantizedKVCache)["update"],
        vars(KvqLayer)["prepare"],
        vars(attention)["decode_attention"],
        vars(attention)["sdpa_attention_forward"],
        vars(kernels)["decode_path"],
    ]


def _positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_prompt_is_exactly_the_context_and_repeats_a_short_text(model):
    tok = model._kvq_loaded.tokenizer
    ids = lat.prompt_ids(tok, "a short text. ", 50)
    assert ids.shape == (1, 50) and ids.dtype == torch.long
    assert int(ids[0, 0]) == tok.bos_token_id
    body = tok("a short text. ", add_special_tokens=False)["input_ids"]
    assert ids[0, 1 : 1 + 2 * len(body)].tolist() == body * 2
    with pytest.raises(KvqError):
        lat.prompt_ids(tok, "   ", 8)


def test_latency_rows_paths_summary_and_plot(model, text, tmp_path):
    originals = _originals()
    task = get_task("latency")
    section = task.run(_ctx(model, text))
    assert _originals() == originals  # every shim and spy is gone
    assert section["cache"] == "int8" and section["threads"] == torch.get_num_threads()
    assert section["device"] == "cpu"
    assert section["params"]["contexts"] == list(CONTEXTS)
    rows = section["rows"]
    assert {(r["context"], r["cache"]) for r in rows} == {
        (n, side) for n in CONTEXTS for side in ("baseline", "int8")
    }
    for r in rows:
        assert ROW_KEYS["latency"] <= r.keys()
        assert _positive(r["ms_per_token"]) and _positive(r["prefill_tokens_per_s"])
        assert math.isfinite(r["ms_per_token_iqr"]) and r["ms_per_token_iqr"] >= 0
        if r["cache"] == "baseline":
            assert r["append_ms_per_token"] is None and r["append_share"] is None
        else:
            assert _positive(r["append_ms_per_token"]) and 0 < r["append_share"] <= 1
    layers = model._kvq_loaded.adapter.info.num_layers
    for n in CONTEXTS:
        assert _positive(section["slowdown"][str(n)])
        paths = section["decode_paths"][str(n)]
        assert sum(paths.values()) == layers  # one path per layer
        assert all(p.startswith(("reference", "triton", "sdpa")) for p in paths)
    assert len(task.summary(section)) == 4 * len(CONTEXTS)
    [png] = task.plot(section, tmp_path / "plots")
    assert png == tmp_path / "plots" / "latency.png" and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("where", ["append pass", "path recording"])
def test_instruments_are_removed_when_a_step_raises(model, text, monkeypatch, where):
    """A failing step inside either instrument leaves every patched function as it was."""
    monkeypatch.setattr(lat, "ROUNDS", 1)
    monkeypatch.setattr(lat, "DECODE_STEPS", 2)
    originals = _originals()
    real_step = lat._step

    def instrument_in_place() -> bool:
        if where == "append pass":
            return hasattr(vars(QuantizedKVCache)["update"], "__wrapped__")
        return vars(attention)["decode_attention"] is not originals[2]

    def failing_step(model, cache, token):
        out = real_step(model, cache, token)  # the instrument really runs first
        if instrument_in_place():
            raise RuntimeError("step failed")
        return out

    monkeypatch.setattr(lat, "_step", failing_step)
    with pytest.raises(RuntimeError, match="step failed"):
        lat.run(_ctx(model, text))
    assert _originals() == originals


def test_append_timer_counts_only_inside_and_restores(model, text):
    ids = lat.prompt_ids(model._kvq_loaded.tokenizer, text, 16)
    cache = kvq.make_cache(model, policy="int8")
    timer = lat.AppendTimer(torch.device("cpu"))
    with torch.no_grad(), timer.installed():
        model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    assert timer.seconds > 0
    seconds = timer.seconds
    with torch.no_grad():
        model(ids[:, :1], cache=cache, use_cache=True)  # after the block: not counted
    assert timer.seconds == seconds
    originals = _originals()
    with pytest.raises(ValueError), timer.installed():
        raise ValueError
    assert _originals() == originals


def test_memory_rows_budget_and_plot(model, text, tmp_path):
    task = get_task("memory")
    section = task.run(_ctx(model, text))
    assert section["budget_bytes"] == BUDGET and section["cache"] == "int8"
    by = {(r["context"], r["cache"]): r for r in section["rows"]}
    assert by.keys() == {(n, side) for n in CONTEXTS for side in ("baseline", "int8")}
    for r in section["rows"]:
        assert ROW_KEYS["memory"] <= r.keys()
        assert r["bytes_per_request"] > 0
        assert r["bytes_per_token"] == pytest.approx(r["bytes_per_request"] / r["context"])
        assert r["max_concurrent_tokens"] == BUDGET // r["bytes_per_token"]
        assert r["peak_bytes"] is None or r["peak_bytes"] >= 0
    for n in CONTEXTS:
        base, quant = by[(n, "baseline")], by[(n, "int8")]
        assert quant["bytes_per_token"] < base["bytes_per_token"]
        assert quant["max_concurrent_tokens"] > base["max_concurrent_tokens"]
        # DynamicCache holds fp32 here: twice the fp16 figure, for the same retained rows
        assert base["dtype"] == "float32"
        assert base["dtype_bytes_per_request"] == 2 * base["bytes_per_request"]
    assert len(task.summary(section)) == 3 * len(CONTEXTS)
    [png] = task.plot(section, tmp_path)
    assert png.name == "memory.png" and png.read_bytes()[:4] == b"\x89PNG"


def test_memory_budget_defaults_to_a_stated_gib_and_refuses_nonsense(model, text):
    ctx = _ctx(model, text)
    ctx.params = EvalParams(contexts=(16,), memory_budget=None)
    section = mem.run(ctx)
    assert section["budget_bytes"] == mem.DEFAULT_BUDGET == 1 << 30
    assert "default" in section["budget_source"]
    ctx.params = EvalParams(contexts=(16,), memory_budget=0)
    with pytest.raises(KvqError):
        mem.run(ctx)


def test_a_declared_prefix_is_run_by_the_baseline_and_served_by_the_cache(model, text):
    from kvq.quant.schemes import PrefixSpec

    tok = model._kvq_loaded.tokenizer
    spec = PrefixSpec((tok.bos_token_id, 7), "unused", "prefixquant")
    base, quant = lat.side_prompts(_ctx(model, text), 20, spec, torch.device("cpu"))
    ids = lat.prompt_ids(tok, text, 20)
    assert quant.tolist() == ids[:, 1:].tolist()  # the prefix supplies the BOS
    assert base.tolist() == [[tok.bos_token_id, 7, *ids[0, 1:].tolist()]]
