"""Pre-RoPE keys rotate through cos/sin tables shared by the layers with the same RoPE."""

import torch

from kvq.models.adapters import get_adapter
from kvq.quant.schemes import CachePolicy, LayerPolicy, named_policy
from kvq.runtime.cache import build_cache
from tests.conftest import make_tiny_model


@torch.no_grad()
def test_layers_with_one_rope_share_one_table_far_into_the_sequence():
    # 3 sliding layers (theta 1e4) + 1 global (1e6); a context that reaches position 20,000
    model = make_tiny_model("gemma3", max_position_embeddings=32_768)
    ad = get_adapter(model)
    base = named_policy("fp16", ad.info.num_layers).layers[0]
    layer = LayerPolicy(key=base.key, value=base.value, key_stage="pre-rope")
    cache = build_cache(model, CachePolicy("pre", (layer,) * ad.info.num_layers), {}, ad)
    ids = torch.randint(3, 200, (1, 3), generator=torch.Generator().manual_seed(0))
    far = torch.arange(20_000, 20_003)[None]
    got = model(ids, cache=cache, position_ids=far).logits
    tables = [layer._rope for layer in cache.layers]
    assert len({id(t[0]) for t in tables}) == 2  # one per distinct RoPE, not one per layer
    assert all(t[0].shape[0] >= 20_003 for t in tables)
    want = model(ids, position_ids=far).logits  # no cache: plain post-RoPE attention
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
