"""Every family kvq takes, tiny and random, through what a user runs (the CLI's calibrate and
run-eval, `model.generate` with a kvq cache, folded transforms), families kvq has no entry
for, and the one-line refusals of what it cannot take."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

import kvq
from kvq.cli.app import app
from kvq.errors import KvqError
from kvq.models import load_model
from kvq.models.adapters import get_adapter
from kvq.models.families import TESTED, check_architecture
from tests.conftest import FAMILY_CONFIGS, make_tiny_model, tiny_tokenizer

# a CLI calibration and evaluation of each of 12 families: `make test-quick` skips them
pytestmark = pytest.mark.slow

FAMILIES = ["llama", "mistral", "qwen2", "gemma3", *FAMILY_CONFIGS]
runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def _ids(b=2, n=20, seed=0):
    return torch.randint(3, 300, (b, n), generator=torch.Generator().manual_seed(seed))


def test_every_tested_model_type_has_a_tiny_model():
    tested = {FAMILY_CONFIGS.get(f, (f, None))[0] for f in FAMILIES}
    assert set(TESTED) - {"gemma3_text"} <= tested | {"gemma3"}


# What sets each family apart, as the adapter must derive it.
EXPECTED = {
    "gemma3": dict(qk_norm_kind="head", qk_norm_heads_first=True, norm_offset_one=True),
    "qwen3": dict(qk_norm_kind="head", qk_norm_heads_first=False),
    "qwen3_moe": dict(qk_norm_kind="head", qk_norm_heads_first=False),
    "olmo2": dict(qk_norm_kind="projection"),
    "phi3": dict(fused_qkv=True),
    "gemma2": dict(norm_offset_one=True),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_adapter_derives_each_family(family):
    model = make_tiny_model(family)
    adapter = get_adapter(model)  # verify_adapter: the cached K/V reproduced from the sites
    defaults = dict(qk_norm_kind=None, fused_qkv=False, norm_offset_one=False)
    for name, value in {**defaults, **EXPECTED.get(family, {})}.items():
        assert getattr(adapter, name) == value, name
    attn, config = adapter.attention(0), model.config
    assert adapter.attention_scaling(0) == attn.scaling
    assert adapter.softcap(0) == (5.0 if family == "gemma2" else None)
    assert (adapter.sinks(0) is not None) == (family == "gpt_oss")
    sliding = [i for i, t in enumerate(adapter.info.layer_types) if t == "sliding_attention"]
    assert (adapter.info.sliding_window is not None) == bool(sliding)
    if family == "phi3":  # partial_rotary_factor 0.5
        assert adapter.info.rope[0].rotary_dim == adapter.head_dim // 2
    if family == "llama3":
        assert '"rope_type":"llama3"' in adapter.info.rope[0].scaling
    if family == "granite":
        assert adapter.attention_scaling(0) == pytest.approx(config.attention_multiplier)


@pytest.fixture(scope="module")
def family_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.mark.parametrize("family", FAMILIES)
def test_calibrate_and_run_eval_through_the_cli(family, family_dir, data, shared_data, tmp_path):
    """kvquant (NUQ4, 1 % outliers, no Fisher pass) then run-eval against the family's own
    unquantized run: finite figures a user can read, bytes below fp16's."""
    model_dir = family_dir(family)
    art = tmp_path / "ART"
    result = _run(
        "calibrate", "kvquant", "--model", model_dir, "--dataset", data, "--samples", 2,
        "--seqlen", 24, "--bits", 4, "--no-fisher", "--out", art,
    )  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    report = tmp_path / "eval.json"
    result = _run(
        "run-eval", "--model", model_dir, "--artifact", art, "--data-dir", shared_data,
        "--windows", 2, "--seqlen", 32, "--json", report,
    )  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    tasks = json.loads(report.read_text())["tasks"]
    ratio, kld = tasks["ppl"]["ratio"], tasks["kld"]["mean"]
    assert math.isfinite(ratio) and 0.5 < ratio < 2.0
    assert math.isfinite(kld) and kld > -1e-6  # a sum of fp32 roundings may dip below 0
    if family not in ("mistral", "mixtral"):  # every layer slides over 8 tokens: too few
        assert tasks["bytes"]["ratio"] < 1.0  # rows leave the full-precision residual


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_fp16_cache_generates_what_dynamic_cache_generates(family, family_dir):
    """Greedy tokens of a batch with left padding equal DynamicCache's: the kvq attention
    keeps each family's semantics (soft-capping, learned sinks, sliding layers, scales)."""
    model, _ = kvq.load_model(str(family_dir(family)))
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, attention_mask=mask)
    expected = model.generate(ids, **kw)
    got = model.generate(ids, cache=kvq.make_cache(model, policy="fp16"), **kw)
    assert torch.equal(got, expected)
    # with the kvq attention installed, plain K/V (no kvq cache) still give the same logits
    torch.testing.assert_close(model(ids, attention_mask=mask).logits,
                               _native_logits(family, ids, mask), atol=1e-5, rtol=1e-4)  # fmt: skip


def _native_logits(family, ids, mask):
    return make_tiny_model(family)(ids, attention_mask=mask).logits


SMOOTH_REFUSED = {"qwen3", "qwen3_moe"}  # per-head q/k norm weights shared by 2 KV heads


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_folded_transforms_keep_the_logits_or_refuse(family, family_dir, data, tmp_path):
    """SmoothAttention's q/k scales and the per-head value rotation fold exactly (fused
    q/k/v, biases, whole-projection q/k norms), or the pass refuses in one line."""
    from kvq.calibrators.options import RotateOptions, SmoothAttentionOptions
    from kvq.pipeline import apply_transforms
    from tests.conftest import calibrate

    model_dir = family_dir(family)
    loaded = load_model(str(model_dir))
    ids = _ids(n=40, seed=1)
    before = loaded.model(ids).logits
    for name, options in (("smooth", SmoothAttentionOptions()), ("rotate", RotateOptions())):
        if name == "smooth" and family in SMOOTH_REFUSED:
            with pytest.raises(KvqError, match="shared by all heads"):
                calibrate(model_dir, data, tmp_path / name, options)
            continue
        artifact = calibrate(model_dir, data, tmp_path / name, options)
        fresh = load_model(str(model_dir))
        apply_transforms(fresh, artifact.tensors)
        changed = [n for n, p in fresh.model.named_parameters()
                   if not torch.equal(p, loaded.model.get_parameter(n))]  # fmt: skip
        assert changed, name
        torch.testing.assert_close(fresh.model(ids).logits, before, atol=5e-5, rtol=1e-4)


# --- families without an entry ---------------------------------------------------------

COMMON = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False,
)  # fmt: skip
# derived and verified: LayerNorm + biases (starcoder2), partial RoPE (stablelm, phi),
# per-head q/k norm after the transpose with sliding layers (exaone4), biases (seed_oss)
DERIVED_WORK = ["starcoder2", "stablelm", "phi", "exaone4", "seed_oss"]
# interleaved RoPE (cohere, glm), a fused per-head-interleaved query_key_value (persimmon)
DERIVED_REFUSED = {"cohere": "rotate-half RoPE", "glm": "rotate-half RoPE", "persimmon": "k_proj"}


def _unlisted(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **COMMON)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type", DERIVED_WORK)
@torch.no_grad()
def test_a_family_without_an_entry_works_through_the_derived_adapter(model_type, tmp_path):
    assert model_type not in TESTED
    _unlisted(model_type).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model, _ = kvq.load_model(str(tmp_path))
    ids, kw = _ids(), dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **kw)
    got = model.generate(ids, cache=kvq.make_cache(model, policy="fp16"), **kw)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("model_type", DERIVED_REFUSED)
def test_a_family_kvq_reads_wrongly_is_refused_in_one_line(model_type):
    with pytest.raises(KvqError, match=f"kvq cannot take {model_type}: .*") as e:
        get_adapter(_unlisted(model_type))
    assert DERIVED_REFUSED[model_type] in str(e.value) and "\n" not in str(e.value)


# --- refused from the config, before any weight is read ------------------------------------

REFUSED = {
    "deepseek_v3": "multi-head latent attention",
    "qwen3_next": "recurrent",
    "jamba": "recurrent",
    "falcon_h1": "recurrent",
    "t5": "encoder-decoder",
    "llama4_text": "chunked_attention",
}


@pytest.mark.parametrize("model_type", REFUSED)
def test_what_kvq_cannot_take_is_refused_at_load(model_type, tmp_path, data):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    with pytest.raises(KvqError, match=REFUSED[model_type]):
        check_architecture(config)
    config.save_pretrained(tmp_path)  # no weights at all: the refusal comes first
    result = _run("calibrate", "channel-scales", "--model", tmp_path, "--dataset", data,
                  "--out", tmp_path / "ART")  # fmt: skip
    assert result.exit_code == 2, result.output
    err = result.stderr.strip().splitlines()[-1]
    assert err.startswith("kvq: error: kvq cannot take") or "encoder-decoder" in err, err
    assert REFUSED[model_type] in err and "Traceback" not in result.output
