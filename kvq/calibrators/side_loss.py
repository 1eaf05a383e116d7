"""The model's loss when one layer-side alone is quantized (KVTuner-style sensitivity).

For each candidate (a layer, a side, a width and the state fitted for it) the calibration
windows run through a kvq cache whose policy quantizes that side only (every other side
`format="none"`): the runtime's own codecs and attention, so what is measured is what
the cache will serve. The loss is the mean KL divergence of the next-token distributions
from the exact model's, on the first `MEASURE_WINDOWS` calibration windows.

Two savings keep this to minutes: the layers before the quantized one see exact K/V,
so their outputs are recorded once per window (from the exact forward) and replayed
instead of recomputed; and the LM head (Gemma 3's is 262k wide, about half a forward)
and the KL run on every `MEASURE_STRIDE`-th position only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from kvq.calibrators.bit_allocation import choose_widths
from kvq.models.placement import input_device
from kvq.progress import Progress
from kvq.quant.schemes import FULL_PRECISION, CachePolicy, LayerPolicy, QuantScheme
from kvq.runtime.cache import build_cache

MEASURE_WINDOWS = 2  # calibration windows each loss is measured on
MEASURE_STRIDE = 4  # score every 4th position: 128 of a 512-token window


@dataclass(frozen=True)
class Candidate:
    """One layer-side at one width: its scheme and the static state fitted for it."""

    layer: int
    part: str  # "key" | "value"
    scheme: QuantScheme
    state: dict[str, Tensor]  # tensor name within the side -> tensor (e.g. "vq_codebook")


def _policy(candidate: Candidate, template: LayerPolicy, num_layers: int) -> CachePolicy:
    """Every side exact but the candidate's; its layer keeps the template's sink and key
    stage."""
    exact = replace(template, key=FULL_PRECISION, value=FULL_PRECISION)
    layers = [exact] * num_layers
    layers[candidate.layer] = replace(exact, **{candidate.part: candidate.scheme})
    return CachePolicy(f"layer {candidate.layer} {candidate.part} only", tuple(layers))


@contextmanager
def _replayed(layers: Sequence[torch.nn.Module], outputs: Sequence, upto: int):
    """Decoder layers before `upto` return their recorded outputs instead of computing."""
    for i in range(upto):
        layers[i].forward = lambda *_a, _out=outputs[i], **_k: _out
    try:
        yield
    finally:
        for i in range(upto):
            del layers[i].forward


def _exact(model, sites, ids: Tensor, keep: Tensor) -> tuple[Tensor, list]:
    """The exact model's log-probabilities at `keep` ([P, V]) and each decoder layer's
    output, in layer order."""
    outputs: list = []
    handles = [s.register_forward_hook(lambda _m, _i, out: outputs.append(out)) for s in sites]
    try:
        logits = model(ids, use_cache=False, logits_to_keep=keep).logits[0]  # [P, V]
    finally:
        for h in handles:
            h.remove()
    return torch.log_softmax(logits.float(), -1), outputs


@torch.no_grad()
def measure_losses(
    model,
    adapter,
    windows: Tensor,
    candidates: Sequence[Candidate],
    template: LayerPolicy,
    progress: Progress,
) -> list[float]:
    """windows [N, L] ids (the first MEASURE_WINDOWS are used) -> each candidate's mean KL
    divergence (nats per scored position) from the exact model, in candidate order."""
    windows = windows[:MEASURE_WINDOWS]
    positions = torch.arange(0, windows.shape[1] - 1, MEASURE_STRIDE)  # [P] scored logits
    sites = adapter.decoder_layers()
    n_layers = adapter.info.num_layers
    policies = [_policy(c, template, n_layers) for c in candidates]
    kl = [0.0] * len(candidates)
    stage = progress.stage("measure layer-side KLD", total=windows.shape[0] * len(candidates))
    with stage as bar:
        for w in range(windows.shape[0]):
            ids = windows[w : w + 1].to(input_device(model))  # [1, L]
            keep = positions.to(ids.device)
            base, outputs = _exact(model, sites, ids, keep)  # [P, V] log-probabilities
            prob = base.exp()
            for i, (c, policy) in enumerate(zip(candidates, policies, strict=True)):
                state = {f"layers.{c.layer}.{c.part}.{n}": t for n, t in c.state.items()}
                cache = build_cache(model, policy, state, adapter)
                with _replayed(sites, outputs, c.layer):
                    logits = model(ids, cache=cache, use_cache=True, logits_to_keep=keep).logits
                quant = torch.log_softmax(logits[0].float(), -1)
                kl[i] += float((prob * (base - quant)).sum())
                bar.advance()
    scored = windows.shape[0] * positions.numel()
    return [x / scored for x in kl]


SchemeAt = Callable[[int, str, int, dict[str, Tensor]], QuantScheme]  # (layer, part, bits, state)


def allocate_by_loss(
    model,
    adapter,
    windows: Tensor,
    fitted: Sequence[dict[int, dict[str, Tensor]]],
    scheme_at: SchemeAt,
    template: LayerPolicy,
    nominal: int,
    progress: Progress,
    spare: int = 0,
) -> tuple[list[int], dict[str, Tensor]]:
    """The width of every layer-side from its measured loss at each fitted width.

    fitted: per side, layer-major (layer 0 keys, layer 0 values, layer 1 keys, ...): width
    -> the state fitted at that width (the same widths for every side). The widths of least
    summed KL whose code bits do not exceed the uniform `nominal` policy's plus `spare`
    bits per token (bits other overheads freed; an exact knapsack; sides weighted by their elements per token), and the measured table as
    provenance: `mixed.kld` [L, 2, W] (nats per position) over `mixed.widths` [W].
    """
    n_layers = adapter.info.num_layers
    widths = sorted(fitted[0])
    sides = [(layer, part) for layer in range(n_layers) for part in ("key", "value")]
    candidates = [
        Candidate(layer, part, scheme_at(layer, part, w, states[w]), states[w])
        for (layer, part), states in zip(sides, fitted, strict=True)
        for w in widths
    ]
    kld = measure_losses(model, adapter, windows, candidates, template, progress)
    table = torch.tensor(kld, dtype=torch.float32).view(len(sides), len(widths))
    elements = adapter.info.num_kv_heads * adapter.info.head_dim  # per token, either side
    chosen = choose_widths(
        table.tolist(), [widths] * len(sides), [elements] * len(sides),
        nominal * elements * len(sides) + spare,
    )  # fmt: skip
    provenance = {
        "mixed.kld": table.view(n_layers, 2, len(widths)).contiguous(),  # [L, K|V, W]
        "mixed.widths": torch.tensor(widths, dtype=torch.int32),  # [W]
    }
    return chosen, provenance
