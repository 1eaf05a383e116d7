"""End-to-end tuning of a quantized artifact's float state on the model's own output
(`kvq calibrate tune --base ART`).

The per-layer fits of `kvquant` and `vq` minimise each layer-side's Fisher-weighted error
on its own, but the model's loss is not a sum of per-side losses: errors compound
(README "Low-bit caches": the joint KLD is not the sum of single-side KLDs). Like the
codebook fine-tuning of AQLM, QuIP# and PV-tuning after their layer-wise fits, this pass
tunes every layer-side's continuous state jointly on KL(exact model || quantized model)
over the calibration windows:

    vq sides      layers.{i}.{key,value}.vq_codebook        [2^(bits m), m]
    NUQ sides     layers.{i}.{key,value}.qnorm_levels (the decode table; the codebook
                  when the base has no Q-Norm)               [2^bits]
    static keys   layers.{i}.key.scale, .center (vq / NUQ)   [H, D]

Codes are not trained: every forward encodes K/V with the runtime's own codec built from
the current state (nearest assignment, no gradient) and decodes the stored rows with the
shared decoder (`kvq.runtime.packed.decode_packed`), which is differentiable in the table,
the scale and the offset it reads; the tuned tensors enter it rounded to their stored
dtypes (straight through), so the forward computes what the runtime will. Sink rows stay
exact as the runtime keeps them, and the K/V themselves pass a straight-through gradient
(IntactKV's estimator), so a later layer's error reaches an earlier layer's state.

Parametrisation: tables in normalised units (as fitted), the key normaliser as
scale = scale0 * exp(r), center = center0 + scale0 * u, so one learning rate fits every
channel whatever its range. After each step NUQ tables are re-sorted (strictly
increasing, as the codec requires).

The last calibration window is held out: its KL through the real runtime cache (packed
codes, reference attention) is measured before tuning and at `checkpoints` points along
it, and the best state is written: the base's own, unchanged, when no checkpoint beats
it (the progress line and the report's `chosen_step` 0 say so).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicCache

from kvq.calibrators.base import FitContext, PassResult, tensor_kind
from kvq.calibrators.options import TuneOptions
from kvq.calibrators.registry import TUNED_FORMATS
from kvq.errors import KvqError
from kvq.models.placement import input_device
from kvq.quant.schemes import CachePolicy, QuantScheme
from kvq.runtime.cache import build_cache
from kvq.runtime.codecs import make_codec
from kvq.runtime.packed import decode_packed

REFERENCE_BYTES = 2 << 30  # the exact log-probabilities kept for the training windows


def _straight(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x rounded to `dtype` (as stored) in the forward, the identity in the backward."""
    return x + (x.detach().to(dtype).float() - x.detach())


def _increasing(levels: Tensor) -> Tensor:
    """Sorted levels, each at least one float32 ulp above the one before (the codec
    refuses repeated levels)."""
    out = levels.sort().values
    for i in range(1, out.numel()):
        if out[i] <= out[i - 1]:
            out[i] = torch.nextafter(out[i - 1], torch.tensor(math.inf))
    return out


class _Side:
    """One layer-side's base state and its tuned tensors (float32 parameters)."""

    def __init__(self, layer: int, part: str, scheme: QuantScheme, state: dict[str, Tensor],
                 head_dim: int, scales: bool):  # fmt: skip
        self.layer, self.part, self.scheme, self.head_dim = layer, part, scheme, head_dim
        self.where = f"layers.{layer}.{part}"
        self.state = state  # the base's tensors, stored dtypes
        self.tunable = scheme.format in TUNED_FORMATS
        self.table_name = None
        self.params: dict[str, nn.Parameter] = {}
        if not self.tunable:
            return
        if scheme.format == "vq":
            self.table_name = "vq_codebook"
        else:
            self.table_name = "qnorm_levels" if "qnorm_levels" in state else "codebook"
        self.params["table"] = nn.Parameter(state[self.table_name].detach().float().clone())
        self.static_key = scheme.axis == "channel" and scheme.lifetime == "static"
        if scales and self.static_key:
            hd = state["scale"].shape
            self.params["log_scale"] = nn.Parameter(torch.zeros(hd))
            self.params["shift"] = nn.Parameter(torch.zeros(hd))

    # --- the tuned tensors ----------------------------------------------------------------

    def _values(self) -> dict[str, Tensor]:
        """The tuned tensors by stored name, float32, rounded to their stored dtypes in the
        forward (differentiable)."""
        if not self.tunable:
            return {}
        st, p = self.state, self.params
        out = {self.table_name: _straight(p["table"], st[self.table_name].dtype)}
        if "log_scale" in p:
            scale0 = st["scale"].float()
            # a static scale is never stored below its dtype's smallest normal (the runtime
            # refuses it; stored-scale policy): a key scale at that floor cannot shrink
            tiny = torch.finfo(st["scale"].dtype).tiny
            scale = (scale0 * p["log_scale"].exp()).clamp_min(tiny)
            out["scale"] = _straight(scale, st["scale"].dtype)
            out["center"] = _straight(
                st["center"].float() + scale0 * p["shift"], st["center"].dtype
            )
        return out

    def stored(self) -> dict[str, Tensor]:
        """The tuned tensors as the artifact stores them (names within the side)."""
        with torch.no_grad():
            return {n: t.detach().to(self.state[n].dtype) for n, t in self._values().items()}

    def project(self) -> None:
        """Keep the parameters where the format allows them after an optimizer step."""
        if self.scheme.format == "nuq":
            with torch.no_grad():
                self.params["table"].copy_(_increasing(self.params["table"]))

    # --- the forward ----------------------------------------------------------------------

    def dequantized(self, x: Tensor) -> Tensor:
        """x [B, H, T, D] (keys pre-RoPE) -> what the cache gives back for these rows,
        float32, differentiable in the tuned tensors; codes from the runtime's codec."""
        if not self.scheme.stored:
            return x.float()
        values = self._values()
        with torch.no_grad():
            state = self.state | {n: t.detach().to(self.state[n].dtype) for n, t in values.items()}
            codec = make_codec(self.scheme, self.head_dim, x.dtype, state, self.where)
            rows, flat = codec.encode(x.detach())
            packed = codec.packed(rows, flat)
        if self.tunable:
            # the table the codec decodes through (Q-Norm levels, or the codebook itself)
            packed = replace(packed, table=values[self.table_name])
            if "scale" in values:
                packed = replace(packed, scale=values["scale"], offset=values["center"])
        return decode_packed(packed)


class _Tuner:
    """The differentiable quantized forward over the base's policy and tuned state."""

    def __init__(self, loaded, policy: CachePolicy, tensors: dict[str, Tensor], scales: bool):
        self.model, self.adapter = loaded.model, loaded.adapter
        info = self.adapter.info
        self.policy = policy
        self.static = {n: t for n, t in tensors.items() if tensor_kind(n) == "policy"}
        # the runtime's layers, for their RoPE functions, sink dtype and windows
        self.layers = build_cache(self.model, policy, self.static, self.adapter).layers
        self.sides: list[_Side] = []
        for i, lp in enumerate(policy.layers):
            for part, scheme in (("key", lp.key), ("value", lp.value)):
                prefix = f"layers.{i}.{part}."
                state = {
                    n[len(prefix) :]: t for n, t in self.static.items() if n.startswith(prefix)
                }
                self.sides.append(_Side(i, part, scheme, state, info.head_dim, scales))

    def parameters(self) -> list[nn.Parameter]:
        return [p for s in self.sides for p in s.params.values()]

    def dequantized(self, layer_idx: int, key: Tensor, value: Tensor, start: int):
        """key (post-RoPE), value [B, H, T, D] at positions start.. -> as the cache serves
        them (key post-RoPE), with straight-through gradients to the inputs."""
        layer = self.layers[layer_idx]
        ks, vs = self.sides[2 * layer_idx], self.sides[2 * layer_idx + 1]
        b, _, t, _ = key.shape
        positions = torch.arange(start, start + t, device=key.device)[None].expand(b, t)
        pre = layer.policy.key_stage == "pre-rope"
        k = layer.unrotate(key.float(), positions) if pre else key.float()
        sink = max(0, min(t, layer.policy.sink_tokens - start))
        exact = slice(0, sink)
        kq = torch.cat(
            [k[:, :, exact].to(layer.sink_dtype).float(), ks.dequantized(k[:, :, sink:])], 2
        )
        vq = torch.cat(
            [value[:, :, exact].to(layer.sink_dtype).float(), vs.dequantized(value[:, :, sink:])], 2
        )
        if pre:
            kq = layer.rotate(kq, positions)
        kq = kq + (key.float() - key.float().detach())  # straight through to the input
        vq = vq + (value.float() - value.float().detach())
        return kq.to(key.dtype), vq.to(value.dtype)

    def cache(self) -> DynamicCache:
        return _DequantizingCache(self)

    def runtime_cache(self, tensors: dict[str, Tensor]):
        """A real kvq cache (packed codes, reference attention) over `tensors`."""
        return build_cache(self.model, self.policy, tensors, self.adapter, backend="reference")

    def stored(self) -> dict[str, Tensor]:
        """Every tuned tensor by artifact name, in its stored dtype."""
        return {f"{s.where}.{n}": t for s in self.sides for n, t in s.stored().items()}


class _DequantizingCache(DynamicCache):
    """Training only: a plain cache that hands attention the K/V as the kvq cache would
    serve them (encoded and decoded), differentiably."""

    def __init__(self, tuner: _Tuner):
        super().__init__()
        self.tuner = tuner

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        start = self.get_seq_length(layer_idx) if layer_idx < len(self.layers) else 0
        k, v = self.tuner.dequantized(layer_idx, key_states, value_states, start)
        return super().update(k, v, layer_idx, *args, **kwargs)


def _kl(reference: Tensor, logits: Tensor) -> Tensor:
    """Mean over positions of KL(reference || quantized): reference log-probabilities and
    quantized logits, both [P, V]."""
    quant = torch.log_softmax(logits.float(), -1)
    return (reference.exp() * (reference - quant)).sum(-1).mean()


@torch.no_grad()
def _exact_logp(model, ids: Tensor, keep: Tensor | None = None) -> Tensor:
    """The exact model's log-probabilities [P, V] at positions `keep` (None: all)."""
    logits = model(ids, use_cache=False, logits_to_keep=0 if keep is None else keep).logits
    return torch.log_softmax(logits[0].float(), -1)


def score_stride(windows: int, seqlen: int, vocab: int) -> int:
    """Every how many positions the training KL is scored so that the exact model's
    log-probabilities, computed once, fit REFERENCE_BYTES (a 262k vocabulary costs 1 MiB
    per position in float32)."""
    return max(1, math.ceil(windows * seqlen * vocab * 4 / REFERENCE_BYTES))


def fit(ctx: FitContext) -> PassResult:
    """The registered `tune` pass: the base's policy, with its tuned tensors (the base is
    checked by the registry's rules)."""
    opts: TuneOptions = ctx.options
    if ctx.windows.n < 2:
        raise KvqError("tune needs at least 2 calibration windows (--samples): one is held out")
    policy = ctx.base.policy
    loaded, progress = ctx.loaded, ctx.progress
    model = loaded.model
    tuner = _Tuner(loaded, policy, ctx.base.tensors, opts.scales)
    for layer in tuner.layers:
        if layer.windowed:
            raise KvqError(f"tune: layer {layer.layer_idx} groups tokens; only per-row layouts")
    device = input_device(model)
    windows = ctx.windows.ids.to(device)
    train, heldout = windows[:-1], windows[-1:]
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        return _tune(ctx, opts, tuner, train, heldout, progress)
    finally:
        for p in frozen:
            p.requires_grad_(True)


def _tune(ctx, opts: TuneOptions, tuner: _Tuner, train: Tensor, heldout: Tensor, progress):
    model = tuner.model
    n, t = train.shape
    vocab = model.get_output_embeddings().weight.shape[0]
    stride = score_stride(n, t, vocab)
    keep = torch.arange(0, t, stride, device=train.device)  # scored positions
    with progress.stage("exact model on the windows", total=n + 1) as bar:
        held_ref = _exact_logp(model, heldout)
        bar.advance()
        refs = []
        for w in range(n):
            refs.append(_exact_logp(model, train[w : w + 1], keep))
            bar.advance()

    base_tensors = dict(tuner.static)

    @torch.no_grad()
    def heldout_kl(tensors: dict[str, Tensor]) -> float:
        cache = tuner.runtime_cache(tensors)
        logits = model(heldout, cache=cache, use_cache=True).logits[0]
        return float(_kl(held_ref, logits))

    with progress.stage("held-out KL, base"):
        before = heldout_kl(base_tensors)
    best = (before, 0, {})  # (held-out KL, step, tuned tensors)
    checks = sorted(
        {max(1, round(opts.steps * (i + 1) / opts.checkpoints)) for i in range(opts.checkpoints)}
    )
    params = tuner.parameters()
    optimizer = torch.optim.Adam(params, lr=opts.lr)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(opts.seed))
    curve, measured = [], []
    with progress.stage(f"tune (held-out KL {before:.4f})", total=opts.steps) as bar:
        for step in range(1, opts.steps + 1):
            w = int(order[(step - 1) % n])
            optimizer.zero_grad(set_to_none=True)
            ids = train[w : w + 1]
            logits = model(ids, cache=tuner.cache(), use_cache=True, logits_to_keep=keep).logits
            loss = _kl(refs[w], logits[0])
            loss.backward()
            optimizer.step()
            for side in tuner.sides:
                side.project()
            curve.append(float(loss.detach()))
            bar.advance()
            if step in checks:
                tuned = tuner.stored()
                kl = heldout_kl(base_tensors | tuned)
                measured.append((step, kl))
                if kl < best[0]:
                    best = (kl, step, tuned)
    after, chosen, tuned = best
    # the best held-out state is written; when no checkpoint beat the base, that is the
    # base's own state, unchanged, and the progress and report say so
    kept = f"step {chosen}" if chosen else "no step lowered it: the base's state kept"
    with progress.stage(f"held-out KL {before:.4f} -> {after:.4f} ({kept})"):
        pass
    report = {
        "objective": "KL(exact model || quantized cache) per position, calibration windows",
        "optimizer": f"Adam lr {opts.lr:g}, one window per step",
        "tuned": "tables" + (", static key scale and center" if opts.scales else ""),
        "steps": opts.steps,
        "score_stride": stride,
        "chosen_step": chosen,  # 0: no checkpoint beat the base; its state is kept
        "heldout_kld_before": before,
        "heldout_kld_after": after,
        "heldout_kld_checkpoints": tuple(kl for _, kl in measured),
        "loss_curve": tuple(round(x, 6) for x in curve[:: max(1, len(curve) // 256)]),
    }
    tensors = ctx.base.policy_tensors() | tuned
    name = tuner.policy.name
    if chosen and not name.endswith("-tuned"):
        name = f"{name}-tuned"
    return PassResult(replace(tuner.policy, name=name), tensors, report)
