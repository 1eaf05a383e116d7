"""Fingerprints of a model, its config and its tokenizer (sha256 hex digests).

Artifacts record these; the runtime recomputes them and refuses an artifact made for another
model. They must therefore be deterministic across processes and machines, and blind to
run-time settings (attention backend, use_cache, the path a model was loaded from).
"""

from __future__ import annotations

import hashlib
import json
import weakref
from typing import Any

import torch
from torch import nn

from kvq.manifests.identity import ModelIdentity

# Config keys that change with how a model is loaded or run, not with what it computes.
_VOLATILE_KEYS = frozenset(
    {
        "transformers_version",
        "torch_dtype",
        "dtype",
        "name_or_path",
        "use_cache",
        "attn_implementation",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "quantization_config",  # present on a GGUF-loaded model, gone once saved dense
        "id2label",  # task-head labels; irrelevant to a causal LM's numerics
        "label2id",
        "problem_type",
    }
)


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def _strip_volatile(obj: Any) -> Any:
    """Drop volatile keys and anything private ('_'-prefixed), recursively (nested text_config)."""
    if isinstance(obj, dict):
        return {
            str(k): _strip_volatile(v)
            for k, v in obj.items()
            if not str(k).startswith("_") and k not in _VOLATILE_KEYS
        }
    if isinstance(obj, (list, tuple)):
        return [_strip_volatile(v) for v in obj]
    return obj


def config_sha256(config) -> str:
    """sha256 of the canonical JSON of the architecture-defining config fields."""
    return hashlib.sha256(_canonical(_strip_volatile(config.to_dict()))).hexdigest()


# id(model) -> (weak ref, the weights' versions, digest): see `_weights_versions`
_WEIGHTS_MEMO: dict[int, tuple[weakref.ref, tuple, str]] = {}


def _weights_versions(model: nn.Module) -> tuple:
    """What identifies the weights' current values without reading them: each parameter
    and buffer's name, storage address, shape, dtype and version counter (which every
    in-place edit moves, under no_grad too, and which `detach()` views share)."""
    named = [*model.named_parameters(remove_duplicate=False)]
    named += model.named_buffers(remove_duplicate=False)
    return tuple(
        (n, t.data_ptr(), tuple(t.shape), t.dtype, _version(t), t.device.type) for n, t in named
    )


def _version(t) -> int | None:
    """The version counter; None for an inference tensor, which keeps none."""
    return None if t.is_inference() else t._version


def weights_sha256(model: nn.Module) -> str:
    """sha256 over sorted (name, shape, dtype, raw bytes) of the state dict.

    Tied tensors (e.g. lm_head = embed_tokens) share storage and are hashed once, under the
    first name in sorted order. Bytes are read through a uint8 view: no copy for contiguous
    CPU tensors, and bf16/fp8 work because no numpy dtype is needed.

    Remembered per model object while no weight changes (`_weights_versions`): a saved
    cache checks the weights at every save and load, and a 270M model takes ~1 s to hash.
    """
    versions = _weights_versions(model)
    hit = _WEIGHTS_MEMO.get(id(model))
    if hit is not None and hit[0]() is model and hit[1] == versions:
        return hit[2]
    digest = _weights_sha256(model)
    # offloaded weights and inference tensors have no versions to trust
    if "meta" not in {v[-1] for v in versions} and None not in {v[4] for v in versions}:
        ref = weakref.ref(model, lambda _, k=id(model), m=_WEIGHTS_MEMO: m.pop(k, None))
        _WEIGHTS_MEMO[id(model)] = (ref, versions, digest)
    return digest


def _weights_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    seen: set = set()
    state = model.state_dict()
    offloaded = any(t.device.type == "meta" for t in state.values())
    if offloaded:
        # a dispatched model keeps disk-offloaded weights as meta tensors: read them back
        # one module at a time, and tell tied weights apart by their Parameter objects
        # (meta tensors have no storage), so the digest equals the one-device digest
        from accelerate.utils.modeling import get_state_dict_offloaded_model

        owners = dict(model.named_parameters(remove_duplicate=False))
        owners |= dict(model.named_buffers(remove_duplicate=False))
        state = get_state_dict_offloaded_model(model)
    for name, t in sorted(state.items()):
        t = t.detach()
        if offloaded:
            key = id(owners[name]) if name in owners else name
        else:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        h.update(_canonical([name, list(t.shape), str(t.dtype)]))
        flat = t.to("cpu").contiguous().reshape(-1)
        if flat.numel():
            h.update(memoryview(flat.view(torch.uint8).numpy()))
    return h.hexdigest()


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and raw bytes (any dtype, any device)."""
    data = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + data).hexdigest()


def _backend_model_json(tokenizer) -> str | None:
    """The fast tokenizer's text -> ids definition as the library's own JSON: the model
    (vocab by id, merges in rank order, byte fallback, ...) plus normalizer and pre-tokenizer.

    Post-processor (BOS/EOS templates that transformers rewrites), padding and truncation are
    left out on purpose: they are run-time settings. Serializing a bare Tokenizer is ~3x
    faster than parsing the full JSON, which matters for 262k-token vocabularies.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    bare = Tokenizer(backend.model)
    if backend.normalizer is not None:
        bare.normalizer = backend.normalizer
    if backend.pre_tokenizer is not None:
        bare.pre_tokenizer = backend.pre_tokenizer
    return bare.to_str()


def tokenizer_sha256(tokenizer) -> str:
    """sha256 of vocabulary, merges, added and special tokens, bos/eos/pad ids and class."""
    record = {
        "class": type(tokenizer).__name__,
        "added": sorted(tokenizer.get_added_vocab().items(), key=lambda kv: kv[1]),
        "special_tokens": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
    }
    model_json = _backend_model_json(tokenizer)
    if model_json is None:  # slow tokenizer: the vocabulary is all we can see
        record["vocab"] = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    h = hashlib.sha256(_canonical(record))
    if model_json is not None:
        h.update(model_json.encode())
    return h.hexdigest()


def model_identity(model: nn.Module, tokenizer) -> ModelIdentity:
    """All fingerprints of (model, tokenizer)."""
    return ModelIdentity(
        model_type=model.config.model_type,
        config_sha256=config_sha256(model.config),
        weights_sha256=weights_sha256(model),
        tokenizer_sha256=tokenizer_sha256(tokenizer),
    )
