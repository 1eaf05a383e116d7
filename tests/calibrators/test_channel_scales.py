"""Static per-channel key calibration."""

import pytest
import torch

from kvq.calibrators.capture import capture
from kvq.calibrators.channel_scales import (
    ChannelScalesOptions,
    calibrate_channel_scales,
    channel_ranges,
)
from kvq.errors import KvqError
from kvq.models.adapters import get_adapter
from kvq.progress import Progress
from kvq.quant import affine
from tests.conftest import make_tiny_model


def test_channel_ranges_percentile():
    samples = torch.arange(1000, dtype=torch.float32).view(1000, 1, 1).expand(1000, 2, 3)
    lo, hi = channel_ranges(samples, 100.0)
    assert torch.all(lo == 0) and torch.all(hi == 999)
    lo, hi = channel_ranges(samples, 99.0)
    assert torch.all(lo == 10) and torch.all(hi == 989)


@pytest.mark.parametrize("stage", ["pre-rope", "post-rope"])
def test_calibrated_ranges_cover_observed_keys(stage):
    model = make_tiny_model("llama")
    ad = get_adapter(model)
    windows = torch.randint(3, 200, (3, 12), generator=torch.Generator().manual_seed(0))
    opts = ChannelScalesOptions(
        bits=8, key_stage=stage, clip_percentile=100.0, sink=0, value_group=8
    )
    policy, tensors = calibrate_channel_scales(model, ad, windows, opts, Progress())
    assert policy.layers[0].key_stage == stage
    assert policy.layers[0].key.axis == "channel" and policy.layers[0].key.lifetime == "static"
    keys = {}

    def grab(layer, part, x):
        keys.setdefault(layer, []).append(x)

    with capture(ad, grab, parts=("key",), key_stage=stage):
        for w in windows:
            model(w[None])
    for layer, xs in keys.items():
        k = torch.cat(xs, dim=2)  # [1, H, N, D]
        scale = tensors[f"layers.{layer}.key.scale"]
        offset = tensors[f"layers.{layer}.key.offset"]
        assert scale.shape == (ad.info.num_kv_heads, ad.info.head_dim)
        s, o = scale[None, :, None], offset[None, :, None]
        err = (affine.affine_decode(affine.affine_encode(k, s, o, 8), s, o) - k).abs()
        # min/max ranges: every observed key is inside its channel's grid
        assert torch.all(err <= s.float() / 2 + 1e-4)


def test_sink_positions_are_excluded_from_statistics():
    model = make_tiny_model("llama")
    ad = get_adapter(model)
    windows = torch.randint(3, 200, (2, 10), generator=torch.Generator().manual_seed(1))
    # make position 0 an extreme outlier in every layer's keys
    module, _ = ad.key_pre_rope_site(0)

    def spike(_m, _i, out):
        out = out.clone()
        out[:, 0] = 1e3
        return out

    handle = module.register_forward_hook(spike)
    try:
        opts = ChannelScalesOptions(bits=4, sink=1, clip_percentile=100.0, value_group=None)
        _, with_sink = calibrate_channel_scales(model, ad, windows, opts, Progress())
        opts0 = ChannelScalesOptions(bits=4, sink=0, clip_percentile=100.0, value_group=None)
        _, no_sink = calibrate_channel_scales(model, ad, windows, opts0, Progress())
    finally:
        handle.remove()
    assert with_sink["layers.0.key.scale"].float().max() < 10
    assert no_sink["layers.0.key.scale"].float().max() > 50


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(bits=5),
        dict(clip_percentile=40.0),
        dict(sink=-1),
        dict(key_stage="x"),
        dict(value_group=-4),
        dict(value_group=100_000),
    ],
)
def test_options_are_validated(kwargs):
    with pytest.raises(KvqError):
        ChannelScalesOptions(**kwargs)


def test_a_value_group_wider_than_the_head_is_refused_not_shrunk():
    model = make_tiny_model("llama")  # head_dim 16
    windows = torch.randint(3, 200, (1, 8), generator=torch.Generator().manual_seed(0))
    opts = ChannelScalesOptions(value_group=32)
    with pytest.raises(KvqError, match="--v-group 32 exceeds head_dim 16"):
        calibrate_channel_scales(model, get_adapter(model), windows, opts, Progress())
    opts = ChannelScalesOptions(value_group=16)  # the whole head: one group per head
    policy, _ = calibrate_channel_scales(model, get_adapter(model), windows, opts, Progress())
    assert policy.layers[0].value.group_size is None
