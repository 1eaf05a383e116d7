"""The loss of one quantized layer-side (`--mixed loss`'s measurement) on tiny models."""

from dataclasses import replace

import pytest
import torch

from kvq.calibrators.options import VQOptions
from kvq.calibrators.side_loss import MEASURE_STRIDE, MEASURE_WINDOWS, Candidate, measure_losses
from kvq.calibrators.vq import calibrate_vq
from kvq.models.adapters import get_adapter
from kvq.progress import Progress
from kvq.quant.schemes import FULL_PRECISION, CachePolicy
from kvq.runtime.cache import build_cache
from tests.calibrators.test_vq import _windows
from tests.conftest import make_tiny_model


def _state(tensors, layer, part):
    head = f"layers.{layer}.{part}."
    return {n[len(head) :]: t for n, t in tensors.items() if n.startswith(head)}


@torch.no_grad()
def _full_forward_kl(model, ad, windows, candidate, template):
    """The same KL from whole forwards (no replayed layers) over every scored position."""
    exact = replace(template, key=FULL_PRECISION, value=FULL_PRECISION)
    layers = [exact] * ad.info.num_layers
    layers[candidate.layer] = replace(exact, **{candidate.part: candidate.scheme})
    state = {
        f"layers.{candidate.layer}.{candidate.part}.{n}": t for n, t in candidate.state.items()
    }
    total, count = 0.0, 0
    for w in windows[:MEASURE_WINDOWS]:
        ids = w[None]
        base = torch.log_softmax(model(ids).logits[0, :-1:MEASURE_STRIDE].float(), -1)
        cache = build_cache(model, CachePolicy("one", tuple(layers)), state, ad)
        logits = model(ids, cache=cache, use_cache=True).logits[0, :-1:MEASURE_STRIDE]
        quant = torch.log_softmax(logits.float(), -1)
        total += float((base.exp() * (base - quant)).sum())
        count += base.shape[0]
    return total / count


def test_the_measured_loss_is_the_kl_of_a_whole_forward_through_the_cache():
    # (tiny Gemma 3: its logits are far from uniform, so the KL is well above float noise)
    model = make_tiny_model("gemma3")
    ad = get_adapter(model)
    windows = _windows()
    policy, tensors = calibrate_vq(model, ad, windows, VQOptions(bits=1, dim=2), Progress(), None)
    last = ad.info.num_layers - 1
    candidates = [
        Candidate(layer, part, getattr(policy.layers[layer], part), _state(tensors, layer, part))
        for layer in (0, last)  # layer `last` replays every layer before it
        for part in ("key", "value")
    ]
    template = policy.layers[0]
    got = measure_losses(model, ad, windows, candidates, template, Progress())
    for c, kl in zip(candidates, got, strict=True):
        assert kl > 0
        assert kl == pytest.approx(_full_forward_kl(model, ad, windows, c, template), rel=1e-3)
    # the model's own layers are back: a plain forward matches before and after
    assert all("forward" not in vars(site) for site in ad.decoder_layers())
