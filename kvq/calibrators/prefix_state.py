"""Prefix rows from the unquantized model, shared by the prefixquant and intactkv passes.

A prefix's K/V rows are what the full-precision model computes for its tokens at
positions 0 .. P-1 (the start of every served sequence): keys before RoPE (the runtime
rotates them at each sequence's own prefix positions), values as they are.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.calibrators.capture import capture
from kvq.errors import KvqError
from kvq.models.placement import input_device
from kvq.quant.schemes import PrefixSpec
from kvq.runtime.prefix import Prefix, PrefixKV


@torch.no_grad()
def extract_prefix(loaded, token_ids: tuple[int, ...], source: str) -> Prefix:
    """The exact prefix of `token_ids` for `loaded` (a `LoadedModel`): per layer pre-RoPE
    keys and values [H_kv, P, D] in float32, from one forward of the decoder body."""
    if not token_ids:
        raise KvqError("a prefix needs at least one token")
    adapter = loaded.adapter
    rows: dict[tuple[int, str], Tensor] = {}

    def consume(layer: int, part: str, x: Tensor) -> None:
        rows[(layer, part)] = x[0].float().cpu()  # [H_kv, P, D]

    ids = torch.tensor([token_ids], dtype=torch.long, device=input_device(loaded.model))
    body = loaded.model.get_decoder()
    with capture(adapter, consume, parts=("key", "value"), key_stage="pre-rope"):
        body(input_ids=ids, use_cache=False)
    spec = PrefixSpec(tuple(int(t) for t in token_ids), loaded.identity.tokenizer_sha256, source)
    layers = tuple(
        PrefixKV(rows[(i, "key")], rows[(i, "value")]) for i in range(adapter.info.num_layers)
    )
    return Prefix(spec, layers)


def bos_id(tokenizer) -> int:
    """The token a sequence starts with (BOS, or the model's equivalent)."""
    for name in ("bos_token_id", "cls_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    raise KvqError("the tokenizer has no BOS (or equivalent) token to start a prefix with")
