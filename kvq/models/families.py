"""What kvq knows about model families by name: which it is tested on, and which it refuses.

Everything else (head counts, fused or separate q/k/v, q/k norms and their layout, RoPE
tables, sliding layers, softmax scale, soft-capping, learned sinks) the adapter reads from
the config and the modules, and checks on one short forward
(`kvq.models.adapters.verify_adapter`). A new family needs no entry here unless kvq must
refuse it by name.
"""

from __future__ import annotations

from kvq.errors import KvqError

# The families kvq is tested on (tests/models/test_families.py builds a tiny one of each);
# any other family is derived and verified the same way, and refused where that fails.
TESTED = (
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3",
    "gemma3_text", "phi3", "olmo2", "granite", "gpt_oss",
)  # fmt: skip

_MLA = "multi-head latent attention: it caches a compressed latent, not per-head keys and values"
_HYBRID = (
    "its recurrent (state-space or linear-attention) layers keep a state, not keys and values; "
    "kvq quantizes attention K/V only"
)
REFUSED: dict[str, str] = {
    "deepseek_v2": _MLA,
    "deepseek_v3": _MLA,
    "kimi_k2": _MLA,
    "longcat_flash": _MLA,
    "jamba": _HYBRID,
    "bamba": _HYBRID,
    "falcon_h1": _HYBRID,
    "falcon_mamba": _HYBRID,
    "mamba": _HYBRID,
    "mamba2": _HYBRID,
    "zamba": _HYBRID,
    "zamba2": _HYBRID,
    "granitemoehybrid": _HYBRID,
    "nemotron_h": _HYBRID,
    "qwen3_next": _HYBRID,
    "lfm2": _HYBRID,
    "minimax": _HYBRID,
    "recurrent_gemma": _HYBRID,
    "rwkv": _HYBRID,
}
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_architecture(config) -> None:
    """Refuse, in one line, a model kvq cannot take, from its config alone (before any
    weight is read): encoder-decoders, latent attention, recurrent hybrids."""
    text = getattr(config, "text_config", None) or config
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise KvqError(
            f"{model_type}: an encoder-decoder model; kvq calibrates decoder-only models"
        )
    why = REFUSED.get(model_type) or REFUSED.get(getattr(text, "model_type", None))
    if why is None and getattr(text, "kv_lora_rank", None):
        why = _MLA
    types = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None)
    if why is None and types:
        other = sorted({str(t) for t in types} - set(ATTENTION_LAYER_TYPES))
        if other:
            why = (
                f"layers of type {', '.join(other)}; kvq's cache implements full and "
                "sliding-window attention"
            )
    if why is not None:
        raise KvqError(f"kvq cannot take {model_type}: {why}")
