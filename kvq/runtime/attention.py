"""The "kvq" attention implementation registered with transformers.

`QuantizedKVCache.update` returns `LayerView`s instead of K/V tensors; this
function recognises them and computes attention straight from the packed rows
with `decode_attention` on the cache's backend (Triton kernel or the chunked
pure-torch reference). Given plain tensors (any other cache, or none) it
defers to transformers' SDPA, so a model with kvq attention installed behaves
exactly as before with ordinary caches.

The mask is transformers' own SDPA mask, built from the cache's
`get_mask_sizes`: its columns are the layer's visible rows in order, so
causality, sliding windows and padding all come from one place.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from kvq.errors import KvqError
from kvq.runtime.kernels.decode.attention import decode_attention
from kvq.runtime.sink import kernel_mask
from kvq.runtime.view import LayerView

NAME = "kvq"


def kvq_attention(
    module: torch.nn.Module,
    query: Tensor,
    key,
    value,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """query [B, H_q, Q, D] -> (output [B, Q, H_q, D], None). Gradients stop at the
    packed rows: kvq caches serve inference."""
    if not isinstance(key, LayerView):
        if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
            return _family_eager(module, query, key, value, attention_mask, dropout, scaling,
                                 **kwargs)  # fmt: skip
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    with torch.no_grad():  # an inference cache: no gradient flows through stored codes
        return _attend(module, query, key, attention_mask, scaling, **kwargs)


def _attend(module, query: Tensor, view, attention_mask, scaling, **kwargs):
    """kvq_attention over a `LayerView`'s packed rows (see the module docstring)."""
    if not view.cache.serves(module):
        view.cache.abort()
        raise KvqError(
            "this kvq cache was built for another model; build one for this model with "
            "kvq.make_cache"
        )
    q_len = query.shape[2]
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    mask = _bool_mask(attention_mask, query, view.columns)
    state = view.prepare(mask)
    counted = view.layer.counted(state)
    if counted is not None:  # a replayable step: the buffers and their device row counts
        segments, rows_mask = counted.segments, None
        lengths = (counted.lengths, counted.rows)
    else:
        segments, rows_mask = view.layer.segments(state), _rows_mask(mask, view, state, query)
        lengths = None
    out = decode_attention(
        query,
        segments,
        scaling=scaling,
        rope=view.layer.rope(state),
        mask=rows_mask,
        softcap=kwargs.get("softcap"),
        backend=view.cache.backend,
        lengths=lengths,
        sinks=kwargs.get("s_aux"),
    )
    view.cache.attended(view.layer.layer_idx)
    assert out.shape[2] == q_len
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _family_eager(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """SDPA has neither soft-capping (Gemma 2) nor learned sinks (GPT-OSS): plain K/V of
    such a model go through its family's own eager attention, with the boolean mask kvq
    registers turned into the additive mask that function adds to the logits."""
    eager = inspect.getmodule(type(module)).eager_attention_forward
    q_len, k_len = query.shape[2], key.shape[2]
    if attention_mask is None and q_len > 1:  # SDPA's mask skipped as purely causal
        cols = torch.arange(k_len, device=query.device)
        rows = torch.arange(k_len - q_len, k_len, device=query.device)
        attention_mask = (cols[None, :] <= rows[:, None])[None, None]  # [1, 1, Q, K]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        blocked = torch.finfo(query.dtype).min
        attention_mask = torch.where(attention_mask, 0.0, blocked).to(query.dtype)
    return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                 **kwargs)  # fmt: skip


def _bool_mask(mask: Tensor | None, query: Tensor, kv_len: int) -> Tensor | None:
    """A [B, 1, Q, K] boolean mask over the mask columns, True = attend; None means plain
    causal (transformers skips the mask when it is purely causal, bottom-right aligned)."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        mask = mask == 0  # additive float mask: 0 = attend
    if mask.shape[-1] != kv_len:
        raise RuntimeError(f"mask covers {mask.shape[-1]} keys, cache layer holds {kv_len}")
    return mask


def _rows_mask(mask: Tensor | None, view, state, query: Tensor) -> Tensor | None:
    """The mask over the kernel's rows (see `kvq.runtime.sink.kernel_mask`); None when every
    row is visible to the single query, the common decode step."""
    sink = view.layer.live_sink(state)  # the sink slots `segments` read, if any
    b, _, q_len, _ = query.shape
    encoded = view.layer.seen_encoded(state, q_len)
    prefix = None
    if state.prefix is not None:
        prefix = state.prefix.visible(view.query_positions, view.layer.sliding_window)
    plain = encoded is None and prefix is None and view.layer.sink_in_lead(state)
    if mask is None:
        if q_len == 1 and plain:
            return None
        cols = state.visible
        q_pos = torch.arange(cols - q_len, cols, device=query.device)
        causal = torch.arange(cols, device=query.device)[None, :] <= q_pos[:, None]
        mask = causal[None, None].expand(b, 1, q_len, cols)
    return kernel_mask(
        mask, sink, state.lead, state.main.length, state.residual.length, state.phase, encoded,
        prefix, sink_in_lead=view.layer.sink_in_lead(state),
    )  # fmt: skip


def install_attention(model) -> None:
    """Register the kvq attention (once) and switch `model` to it."""
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, kvq_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
