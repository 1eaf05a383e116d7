"""Shared fixtures: a tiny tokenizer, tiny random models per family, the shared data folder,
the calibration text and one `calibrate_job` call on it.

Everything here is built offline in well under a second per object, so tests never need the
hub. Other test modules import `make_tiny_model` and `tiny_tokenizer` directly.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

# Triton kernels are tested through its CPU interpreter unless a GPU is present; the
# variable must be set before triton is first imported anywhere in the session.
if not os.environ.get("KVQ_TEST_CUDA"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread (children inherit it): the tiny models' ops are far too small to
# split, and a second OpenMP thread only spins at every barrier. On the 2-core CI machine
# that spinning cost 2-3x the suite's CPU time (tests/calibrators/test_intactkv.py: 39 s
# of CPU with 2 threads, 12 s with 1). OMP_NUM_THREADS=2 in the environment overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The command line's tables are as wide as the terminal says (kvq/cli/render.py); pytest-xdist
# workers are told COLUMNS=80, a plain run gets the 120-column fallback: one width for all.
os.environ["COLUMNS"] = "120"

import pytest
import torch

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # if torch came in first

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
CALIBRATION_TXT = SHARED_DATA / "calibration" / "groups_merged.txt"

# A few KB of real text is enough for a ~512-token byte-level BPE; a fixed fallback keeps
# the fixtures usable (and deterministic) on a checkout without the shared folder.
_TRAIN_BYTES = 24_000
_FALLBACK_TEXT = (
    "The quick brown fox jumps over the lazy dog. Keys and values are cached per layer; "
    "queries attend to them. Rotary embeddings rotate pairs of channels by a position angle. "
) * 200
TINY_VOCAB = 512
SPECIALS = ["<pad>", "<eos>", "<bos>"]  # ids 0, 1, 2 as in Gemma


@functools.cache
def tiny_tokenizer():
    """A byte-level BPE PreTrainedTokenizerFast, vocab 512, ids <pad>=0 <eos>=1 <bos>=2.

    BOS handling is explicit: `add_bos_token=True` installs a post-processor that prepends
    `<bos>` when `add_special_tokens=True` (the default) and nothing otherwise.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if CALIBRATION_TXT.is_file():
        text = CALIBRATION_TXT.read_bytes()[:_TRAIN_BYTES].decode("utf-8", errors="ignore")
    else:
        text = _FALLBACK_TEXT
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = text.splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        add_bos_token=True,
        add_eos_token=False,
    )


def _tiny_config(family: str, vocab: int, **overrides):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=False,
    )
    if family == "llama":
        return LlamaConfig(**{**common, **overrides})
    if family == "mistral":
        return MistralConfig(**{**common, "sliding_window": 8, **overrides})
    if family == "qwen2":
        # Qwen2 always has q/k/v biases; random init leaves them zero, so randomise them
        # in make_tiny_model to make sure the adapter does not silently drop them.
        return Qwen2Config(**{**common, **overrides})
    if family == "gemma3":
        gemma = dict(
            common,
            num_hidden_layers=4,
            num_key_value_heads=1,
            head_dim=32,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            sliding_window=8,
            query_pre_attn_scalar=24,  # deliberately != head_dim so the scale is tested
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            },
            tie_word_embeddings=True,
        )
        return Gemma3TextConfig(**{**gemma, **overrides})
    if family in FAMILY_CONFIGS:
        from transformers import AutoConfig

        model_type, extra = FAMILY_CONFIGS[family]
        return AutoConfig.for_model(model_type, **{**common, **extra, **overrides})
    raise ValueError(f"unknown tiny family {family!r}")


_ALTERNATING = ["sliding_attention", "full_attention"] * 2
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
# family -> (model_type, config facts beyond the common tiny shape): each exercises what
# sets its family apart (the adapter must derive it, `verify_adapter` checks it)
FAMILY_CONFIGS = {
    "llama3": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen3": ("qwen3", {}),  # per-head q/k RMSNorm on the [B, T, H, D] view
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, decoder_sparse_step=1)),
    "gemma2": ("gemma2", dict(num_hidden_layers=4, layer_types=_ALTERNATING, sliding_window=8,
                              query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                              final_logit_softcapping=30.0, tie_word_embeddings=True)),
    "phi3": ("phi3", dict(rope_parameters={  # fused qkv_proj, partial RoPE
        "rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5})),
    "olmo2": ("olmo2", {}),  # q/k RMSNorm over the whole projection, post-norm layers
    "granite": ("granite", dict(attention_multiplier=0.2, embedding_multiplier=2.0,
                                residual_multiplier=0.5, logits_scaling=2.0)),
    "mixtral": ("mixtral", dict(**_MOE, sliding_window=8)),
    "gpt_oss": ("gpt_oss", dict(num_hidden_layers=4, layer_types=_ALTERNATING,
                                sliding_window=8, attention_bias=True, num_local_experts=4,
                                num_experts_per_tok=2, rope_parameters={
        "rope_type": "yarn", "rope_theta": 150_000.0, "factor": 4.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})),
}  # fmt: skip


def make_tiny_model(family: str, **overrides):
    """A randomly initialised fp32 eval-mode model: "llama", "mistral", "qwen2" or "gemma3".

    llama/qwen2/mistral: hidden 64, 2 layers, 4 q heads, 2 kv heads, head_dim 16.
    gemma3: 4 layers (sliding x3, full), window 8, 4 q heads, 1 kv head, head_dim 32,
    query_pre_attn_scalar 24, rope theta 1e4 local / 1e6 global.
    `overrides` go into the config.
    """
    from transformers import AutoModelForCausalLM

    config = _tiny_config(family, len(tiny_tokenizer()), **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # save_pretrained records the class in config.architectures; set it now so an in-memory
    # model and its saved copy (tiny_model_dir) have the same config fingerprint.
    model.config.architectures = [type(model).__name__]
    with torch.no_grad():
        # Random init leaves biases and Gemma's (1 + w) norm weights at zero, which would hide
        # a dropped bias or a wrong norm parametrisation; make them non-trivial.
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.normal_(0.0, 0.1)
    return model.eval()


@pytest.fixture(scope="session", autouse=True)
def tokenize_each_text_once():
    """Every calibration and evaluation tokenizes its whole text to draw a few windows from
    it: 0.4 s of CPU for the calibration text with the tiny tokenizer, about half of a
    typical calibration test, repeated a few hundred times on the same two texts. The
    first call for a (tokenizer fingerprint, text) pair tokenizes; later ones get its ids."""
    from kvq.data import windows
    from kvq.models.fingerprint import tokenizer_sha256

    tokenize, known = windows.text_token_ids, {}

    def once(tokenizer, text: str) -> tuple[int, ...]:
        key = (tokenizer_sha256(tokenizer), hashlib.sha256(text.encode()).digest())
        if key not in known:
            known[key] = tuple(tokenize(tokenizer, text))
        return known[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(windows, "text_token_ids", once)
        yield


@pytest.fixture(scope="session")
def tokenizer():
    """The tiny tokenizer (see `tiny_tokenizer`)."""
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """family -> directory with a saved tiny model + tokenizer (a local-dir MODEL spec)."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            make_tiny_model(family).save_pretrained(out)
            tiny_tokenizer().save_pretrained(out)
            built[family] = out
        return built[family]

    return get


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared data folder (`../shared/data` from the repo root)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder {SHARED_DATA} is missing")
    return SHARED_DATA


@pytest.fixture(scope="session")
def data(shared_data) -> str:
    """The calibration text, as a path string (what --dataset takes)."""
    return str(shared_data / "calibration" / "groups_merged.txt")


CALIBRATE_SAMPLES, CALIBRATE_SEQLEN = 2, 24  # tiny windows: a pass runs in seconds


def calibrate(model_dir, data, out, options, base=None, *, samples=None, seqlen=None):
    """`calibrate_job` of one pass (`options`) on samples x seqlen windows of `data`
    (default CALIBRATE_SAMPLES x CALIBRATE_SEQLEN), written to `out`; its Artifact."""
    from kvq.pipeline import CalibrationRequest, calibrate_job
    from kvq.progress import Progress

    request = CalibrationRequest(
        passes=(options,), model_spec=str(model_dir), dataset=data, out=out,
        samples=samples or CALIBRATE_SAMPLES, seqlen=seqlen or CALIBRATE_SEQLEN, base=base,
    )  # fmt: skip
    return calibrate_job(request, Progress())


def calibration_windows(loaded, data):
    """[CALIBRATE_SAMPLES, CALIBRATE_SEQLEN] token ids: the windows `calibrate` runs by
    default."""
    from kvq.pipeline import load_windows

    return load_windows(loaded, data, CALIBRATE_SAMPLES, CALIBRATE_SEQLEN, 0, None).ids


def nuq_key_state(bits: int, heads: int, d: int, fraction: float, seed: int = 0) -> dict:
    """Static NUQ key state (codebook, normaliser, thresholds) from synthetic samples
    whose channels have growing scales: what a calibrated artifact would hold."""
    from kvq.quant import nuq, sparse

    g = torch.Generator().manual_seed(seed)
    samples = torch.randn(400, heads, d, generator=g) * torch.linspace(0.5, 3, d)
    lower, upper = sparse.channel_thresholds(samples, fraction)
    scale, center = nuq.normalizer(lower, upper)
    state = {"codebook": nuq.uniform_codebook(bits), "scale": scale, "center": center}
    if fraction:
        state |= {"lower": lower, "upper": upper}
    return state
