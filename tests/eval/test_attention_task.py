"""run-eval's `attention` task on tiny random models: the exact side is the model's own
attention, the quantized side's error grows as bits shrink, sliding layers are scored over
the window the cache still holds, sink rows stay exact."""

import json

import pytest
import torch

import kvq
from kvq.errors import KvqError
from kvq.eval.tasks import attention, get_task
from kvq.eval.tasks.base import EvalParams, TaskContext
from kvq.models.loading import load_model
from kvq.pipeline import cache_for
from tests.conftest import _FALLBACK_TEXT, CALIBRATION_TXT

TOKENS = 48
FAMILIES = ("llama", "qwen2", "gemma3")
POLICIES = ("fp16", "int8", "int4")
FP16_ROUNDING = 1e-3  # relative error of rows rounded to fp16 is ~5e-4 at worst


@pytest.fixture(scope="module")
def text() -> str:
    if CALIBRATION_TXT.is_file():
        return CALIBRATION_TXT.read_text(encoding="utf-8")[:20_000]
    return _FALLBACK_TEXT


def _context(loaded, text, make_cache, name) -> TaskContext:
    return TaskContext(loaded=loaded, make_cache=make_cache, cache_name=name, text=text,
                       params=EvalParams(contexts=(TOKENS, 4096)))  # fmt: skip


@pytest.fixture(scope="module")
def sections(tiny_model_dir, text):
    """(family, policy) -> the task's section; each computed once."""
    done = {}

    def get(family: str, policy: str) -> dict:
        if (family, policy) not in done:
            model, _ = kvq.load_model(str(tiny_model_dir(family)))
            ctx = _context(
                model._kvq_loaded, text, lambda: kvq.make_cache(model, policy=policy), policy
            )
            done[family, policy] = attention.TASK.run(ctx)
        return done[family, policy]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_errors_grow_as_bits_shrink(sections, family):
    fp16, int8, int4 = (sections(family, p) for p in POLICIES)
    for key in ("mean_logit_rel_error", "mean_output_rel_error"):
        assert fp16[key] < FP16_ROUNDING, key
        assert fp16[key] < int8[key] < int4[key], key
    for a, b, c in zip(fp16["layers"], int8["layers"], int4["layers"], strict=True):
        for key in ("logit_rel_error", "output_rel_error", "k_rel_mse", "v_rel_mse"):
            assert a[key] < (FP16_ROUNDING**2 if key.endswith("mse") else FP16_ROUNDING)
            assert a[key] <= b[key] < c[key], (a["layer"], key)
    assert 0 < int4["mean_output_rel_error"] < 0.5  # quantized, yet still the same attention


def test_sliding_layers_are_scored_over_the_window_the_cache_holds(sections):
    section = sections("gemma3", "int4")
    window = 8  # the tiny Gemma 3: three sliding layers, then a full one
    *sliding, full = section["layers"]
    for layer in sliding:
        assert layer["sliding_window"] == window
        # after the prompt a sliding layer keeps the rows the next query needs: window - 1
        assert layer["rows"] == layer["queries"] == window - 1
        assert layer["output_rel_error"] > 0
        held = sum(b["rows"] for b in layer["k_by_position"])
        assert held == window - 1 and layer["k_by_position"][-1]["rows"] > 0
        assert layer["k_by_position"][0]["rows"] == 0  # evicted: not scored
    assert full["sliding_window"] is None and full["rows"] == full["queries"] == TOKENS


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_exact_side_is_the_models_own_attention(tiny_model_dir, family):
    """Captured queries and cached K/V, with the task's mask, scale and window, give the
    attention output the model itself fed its o_proj."""
    model, _ = kvq.load_model(str(tiny_model_dir(family)))
    loaded = model._kvq_loaded
    ad = loaded.adapter
    ids = torch.randint(3, 500, (1, 20), generator=torch.Generator().manual_seed(0))
    seen = {}
    hooks = [
        ad.attention(i).o_proj.register_forward_pre_hook(
            lambda _m, args, i=i: seen.__setitem__(i, args[0][0].detach())  # [T, H_q * D]
        )
        for i in range(ad.num_layers)
    ]
    try:
        kv, queries = attention._reference(loaded, ids, 20)
    finally:
        for h in hooks:
            h.remove()
    pos = torch.arange(20)
    group = ad.num_q_heads // ad.num_kv_heads
    for i, ((k, v), q) in enumerate(zip(kv, queries, strict=True)):
        mask = attention._mask(pos, pos, ad.sliding_window(i))
        out = torch.cat([
            attention._attend(q[h * group : (h + 1) * group], k[0, h].float(), v[0, h].float(),
                              mask, ad.attention_scaling(i), None)[1]
            for h in range(ad.num_kv_heads)
        ])  # fmt: skip  # [H_q, T, D]
        want = seen[i].view(20, ad.num_q_heads, -1).transpose(0, 1)
        assert ((out - want).norm() / want.norm()).item() < 1e-5, i


def test_sink_rows_are_kept_exact(tiny_model_dir, text):
    """kv4-qserve keeps the first token exact: no error in a bf16 model (the sink holds the
    model's own dtype); an fp32 model's sink rows are fp16, so rounding only."""
    loaded = load_model(str(tiny_model_dir("llama")), dtype=torch.bfloat16)
    ctx = _context(loaded, text, lambda: cache_for(loaded, policy="kv4-qserve"), "kv4-qserve")
    for layer in attention.TASK.run(ctx)["layers"]:
        assert layer["sink"]["tokens"] == layer["sink"]["rows"] == 1
        assert layer["sink"]["k_rel_mse"] == layer["sink"]["v_rel_mse"] == 0.0
        assert layer["body"]["k_rel_mse"] > 1e-4 and layer["v_rel_mse"] > 1e-4
    model, _ = kvq.load_model(str(tiny_model_dir("llama")))
    fp32 = _context(model._kvq_loaded, text,
                    lambda: kvq.make_cache(model, policy="kv4-qserve"), "kv4-qserve")  # fmt: skip
    for layer in attention.TASK.run(fp32)["layers"]:
        assert layer["sink"]["k_rel_mse"] < FP16_ROUNDING**2 < layer["body"]["k_rel_mse"]


def test_section_shape_summary_and_plot(sections, tmp_path):
    section = sections("qwen2", "int4")
    assert get_task("attention") is attention.TASK
    json.dumps(section)  # plain JSON data
    assert section["tokens"] == TOKENS  # min(--contexts)
    assert section["params"]["contexts"] == [TOKENS, 4096]
    assert section["cache"]["name"] == "int4" and section["cache"]["sink_tokens"] == [0]
    layers = section["layers"]
    assert [x["layer"] for x in layers] == [0, 1]
    for layer in layers:
        assert [h["head"] for h in layer["heads"]] == [0, 1]  # KV heads (4 query heads, GQA)
        assert len(layer["k_by_position"]) == len(layer["v_by_position"]) == 8
        assert len(layer["k_worst_channels"]) == 8
        channels = [c for c, _ in layer["k_worst_channels"]]
        errors = [e for _, e in layer["k_worst_channels"]]
        assert len(set(channels)) == 8 and all(0 <= c < 16 for c in channels)
        assert errors == sorted(errors, reverse=True)
        assert layer["sink"]["rows"] == 1 and layer["recent"]["rows"] == 32
        assert layer["body"]["rows"] == TOKENS - 33
    means = {k: sum(x[f"{k}_rel_error"] for x in layers) / 2 for k in ("logit", "output")}
    assert section["mean_logit_rel_error"] == pytest.approx(means["logit"])
    assert section["mean_output_rel_error"] == pytest.approx(means["output"])
    assert section["worst_layer"] == max(range(2), key=lambda i: layers[i]["output_rel_error"])
    rows = attention.TASK.summary(section)
    assert [r[0] for r in rows] == [
        "attention logit rel. error (mean over layers)",
        "attention output rel. error (mean)",
        "worst layer",
    ]
    assert all(isinstance(x, str) for r in rows for x in r)
    (path,) = attention.TASK.plot(section, tmp_path)
    assert path == tmp_path / "attention_error.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_text_too_short_is_refused(tiny_model_dir):
    model, _ = kvq.load_model(str(tiny_model_dir("llama")))
    ctx = _context(model._kvq_loaded, "a few words", lambda: kvq.make_cache(model, policy="int8"),
                   "int8")  # fmt: skip
    with pytest.raises(KvqError, match="prompt of 48 tokens"):
        attention.TASK.run(ctx)
