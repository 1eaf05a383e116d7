"""A token prefix placed before every window: for statistics that must leave it out.

PrefixQuant puts a few outlier-inducing tokens (and BOS) before every sequence and keeps
their K/V exact, so that the statistics of every other row are tame enough for static
scales. Calibrating "with the prefix in place" means forwarding prefix + window and
leaving the prefix positions out of the statistics; this module builds those sequences.

Windows start with BOS. A prefix that begins with the token every window begins with
(BOS) takes that token's place, so BOS is not repeated: the sequence is
prefix + window[1:]. Any other prefix goes before the whole window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvq.errors import KvqError


@dataclass(frozen=True)
class Prefixed:
    ids: Tensor  # [N, P + L - dropped]: prefix + windows
    prefix_len: int  # P: positions to leave out of statistics (and to keep exact)
    # window token j >= 1 sits at sequence position window_start + j (window_start is
    # P - 1 when the prefix replaced the window's BOS, else P)
    window_start: int


def check_prefix_ids(prefix_ids: Sequence[int] | None, vocab_size: int) -> tuple[int, ...]:
    """The prefix as a tuple, each id checked against the model's vocabulary."""
    ids = tuple(int(i) for i in (prefix_ids or ()))
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise KvqError(f"prefix token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return ids


def vocab_size(model) -> int:
    """The number of token ids `model` embeds."""
    return model.get_input_embeddings().num_embeddings


def with_prefix(windows: Tensor, prefix_ids: Sequence[int] | None) -> Prefixed:
    """windows: [N, L] ids. Returns prefix + windows (see the module docstring)."""
    prefix = tuple(prefix_ids or ())
    if not prefix:
        return Prefixed(windows, 0, 0)
    head = torch.tensor(prefix, dtype=windows.dtype, device=windows.device)  # [P]
    head = head[None].expand(windows.shape[0], -1)  # [N, P]
    replaces_bos = bool((windows[:, 0] == prefix[0]).all())
    body = windows[:, 1:] if replaces_bos else windows
    start = len(prefix) - 1 if replaces_bos else len(prefix)
    return Prefixed(torch.cat([head, body], dim=1), len(prefix), start)
