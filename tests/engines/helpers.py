"""What the engine-format tests share: a greedy generate through a policy's cache."""

from __future__ import annotations

import torch

import kvq


def generate_through(model_dir, policy: str):
    """(model, cache) after 6 greedy tokens from two 24-token prompts through a fresh
    cache of `policy` on the tiny model saved in `model_dir`."""
    model, _ = kvq.load_model(str(model_dir))
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    cache = kvq.make_cache(model, policy=policy)
    out = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 30)
    return model, cache
