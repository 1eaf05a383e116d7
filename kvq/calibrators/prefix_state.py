"""Prefix rows from the unquantized model, and the prefix a calibration is served after.

A prefix's K/V rows are what the full-precision model computes for its tokens at
positions 0 .. P-1 (the start of every served sequence): keys before RoPE (the runtime
rotates them at each sequence's own prefix positions), values as they are.

Passes that fit static scales (kv-scales, act-scales) calibrate with the prefix in place:
the base artifact's declared prefix, or one they declare from `--prefix-ids`. Either way
the windows' own tokens run after a cache holding the prefix rows
(`kvq.runtime.prefix.prefix_dynamic_cache`), exactly as the runtime serves them, so the
hooks never see a prefix position and the statistics describe the rows that get quantized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from kvq.calibrators.capture import capture, run_windows
from kvq.errors import KvqError
from kvq.models.placement import input_device
from kvq.quant.schemes import PrefixSpec
from kvq.runtime.prefix import (
    Prefix,
    PrefixKV,
    check_tokenizer,
    prefix_dynamic_cache,
    prefix_from_tensors,
    user_tokens,
)


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


def vocab_size(model) -> int:
    """The number of token ids `model` embeds."""
    return model.get_input_embeddings().num_embeddings


def check_prefix_ids(prefix_ids: Sequence[int] | None, vocab: int) -> tuple[int, ...]:
    """The prefix as a tuple, each id checked against the model's vocabulary."""
    ids = tuple(int(i) for i in (prefix_ids or ()))
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise KvqError(f"prefix token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return ids


def ids_prefix(loaded, prefix_ids: Sequence[int], source: str = "prefix-ids") -> Prefix:
    """`--prefix-ids` as a declared prefix: the ids checked against the vocabulary, their
    exact rows from the model as it stands (a chain's transforms applied)."""
    ids = check_prefix_ids(prefix_ids, vocab_size(loaded.model))
    return extract_prefix(loaded, ids, source)


def calibration_prefix(ctx, prefix_ids: Sequence[int] = ()) -> Prefix | None:
    """The prefix a pass calibrates after (`ctx`: its `FitContext`): the base's declared
    prefix (refused when made with another tokenizer), or `prefix_ids` declared now
    (`ids_prefix`), or None. Both at once are refused: the base's rows (exact or
    IntactKV-calibrated) belong to its own tokens, so they cannot be re-made or extended
    without silently changing what the base was calibrated for."""
    base = ctx.base
    spec = None if base is None else base.policy.prefix
    if spec is not None:
        if prefix_ids:
            raise KvqError(
                f"--prefix-ids: the base artifact already declares a prefix "
                f"{list(spec.token_ids)} ({spec.source}); it is used, drop --prefix-ids"
            )
        check_tokenizer(spec, ctx.loaded.identity.tokenizer_sha256)
        return prefix_from_tensors(spec, base.tensors, base.policy.num_layers)
    if prefix_ids:
        return ids_prefix(ctx.loaded, prefix_ids)
    return None


def served_tokens(loaded, windows: Tensor, prefix: Prefix | None) -> Tensor:
    """windows [N, L] as served after `prefix`: [N, L'], a leading BOS gone when the
    prefix supplies it (`kvq.runtime.prefix.user_tokens`)."""
    if prefix is None:
        return windows
    return user_tokens(windows, prefix.spec, getattr(loaded.tokenizer, "bos_token_id", None))


@torch.no_grad()
def run_served(
    loaded,
    ids: Tensor,
    prefix: Prefix | None,
    on_window: Callable[[int], None] | None = None,
) -> None:
    """Forward each window's user tokens (ids [N, L'], `served_tokens`) through the decoder
    body after a cache holding `prefix`'s rows at positions 0 .. P-1, so the window runs at
    positions P .. as served and forward hooks see only its own activations. Without a
    prefix, a plain forward of each window (`capture.run_windows`)."""
    if prefix is None:
        run_windows(loaded.model, ids, on_window)
        return
    body = loaded.model.get_decoder()
    for i in range(ids.shape[0]):
        past = prefix_dynamic_cache(loaded.model, loaded.adapter, prefix)
        body(input_ids=ids[i : i + 1].to(input_device(loaded.model)), cache=past, use_cache=True)
        if on_window is not None:
            on_window(i)
