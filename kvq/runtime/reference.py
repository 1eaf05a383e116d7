"""The attention oracle: chunked online-softmax attention in pure torch.

Keys and values arrive as a stream of chunks (decoded from packed codes one
chunk at a time by the caller), so the whole cache is never materialised in
fp32. All chunks — exact sink rows, quantized rows and the rows of the current
forward — share ONE softmax: the running max and denominator are carried
across chunks and rescaled, which is exactly equivalent to softmax over the
concatenation (article 0x06C).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def online_softmax_attention(
    query: Tensor,
    chunks: Iterable[tuple[Tensor, Tensor, Tensor | None]],
    scaling: float,
    softcap: float | None = None,
) -> Tensor:
    """Attention of `query` over a stream of (key, value, mask) chunks.

    query:  [B, H_q, Q, D] post-RoPE queries.
    chunks: key [B, H_kv, C, D] (post-RoPE), value [B, H_kv, C, D_v],
            mask broadcastable to [B, 1, Q, C], True = attend (None = all).
    returns [B, H_q, Q, D_v] in float32.
    """
    b, hq, q_len, d = query.shape
    q = query.float()
    m = denom = acc = None
    for key, value, mask in chunks:
        hkv = key.shape[1]
        group = hq // hkv
        qg = q.view(b, hkv, group, q_len, d)  # [B, H_kv, G, Q, D]
        s = torch.einsum("bhgqd,bhcd->bhgqc", qg, key.float()) * scaling
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if mask is not None:
            # [B|1, 1|H_q, Q, C] -> [B|1, 1|H_kv, 1|G, Q, C], broadcast against s
            heads = (hkv, group) if mask.shape[1] == hq else (1, 1)
            s = s.masked_fill(~mask.view(mask.shape[0], *heads, q_len, -1), float("-inf"))
        if m is None:
            m = torch.full(
                s.shape[:-1], float("-inf"), device=s.device
            )  # [B, H_kv, G, Q] running max
            denom = torch.zeros(s.shape[:-1], device=s.device)  # running denominator
            acc = torch.zeros(
                (*s.shape[:-1], value.shape[-1]), device=s.device
            )  # running numerator
        m_new = torch.maximum(m, s.amax(dim=-1))
        # a row that has seen only masked keys keeps a finite reference point
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(s - safe.unsqueeze(-1))
        alpha = torch.exp(m - safe)  # rescales what earlier chunks accumulated
        denom = denom * alpha + p.sum(-1)
        acc = acc * alpha.unsqueeze(-1) + torch.einsum("bhgqc,bhcd->bhgqd", p, value.float())
        m = m_new
    if acc is None:
        raise ValueError("attention over an empty key set")
    out = acc / denom.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    return out.reshape(b, hq, q_len, -1)


def dense_attention(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float
) -> Tensor:
    """Plain softmax attention over whole tensors: the test oracle for the chunked path.

    query [B, H_q, Q, D], key/value [B, H_kv, K, D], mask [B, 1, Q, K] bool or None.
    returns [B, H_q, Q, D] float32.
    """
    group = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    s = query.float() @ k.transpose(-1, -2) * scaling
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v
