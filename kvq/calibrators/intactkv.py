"""IntactKV: keep a prefix's K/V exact, then calibrate those rows against layer outputs.

Extraction: the prefix (BOS, PrefixQuant's tokens, or BOS + a text) runs through the
unquantized model; its pre-RoPE keys and values per layer become declared prefix state.

Calibration: those rows are the only trainable parameters. Each calibration window is
served after the prefix; every other K/V row goes through the base artifact's own codecs
in the forward pass (encode, then decode: what the cache would give attention), with a
straight-through estimator across the rounding. The objective is the sum over layers of
the MSE between each decoder layer's output with the quantized cache and with the
unquantized model (served over the same prefix + window). AdamW, gradient clipping.

The calibrated rows replace the exact ones; the manifest's report records the steps, the
loss before and after (over all calibration windows) and the loss curve.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from kvq.calibrators.base import FitContext, PassResult, tensor_kind
from kvq.calibrators.options import IntactKVOptions, PrefixQuantOptions
from kvq.calibrators.prefix_state import bos_id, extract_prefix
from kvq.errors import KvqError
from kvq.models.placement import input_device
from kvq.quant.schemes import PrefixSpec
from kvq.runtime.cache import build_cache
from kvq.runtime.prefix import Prefix, PrefixKV, check_tokenizer, user_tokens

ATTENTION = "kvq-intactkv"  # the training forward's attention function (see `_attention`)


def prefix_ids(ctx: FitContext, options: IntactKVOptions) -> tuple[int, ...]:
    """The prefix's token ids for --prefix (checked before any forward)."""
    loaded = ctx.loaded
    bos = bos_id(loaded.tokenizer)
    kind = options.prefix_kind
    if kind == "bos":
        return (bos,)
    if kind == "text":
        ids = loaded.tokenizer(options.prefix, add_special_tokens=False)["input_ids"]
        if not ids:
            raise KvqError(f"--prefix {options.prefix!r} tokenizes to nothing")
        return (bos, *ids)
    spec = ctx.base.policy.prefix if ctx.base is not None else None
    if spec is not None:  # the base artifact's PrefixQuant tokens
        check_tokenizer(spec, loaded.identity.tokenizer_sha256)
        return spec.token_ids
    from kvq.calibrators.prefixquant import choose_tokens, outlier_stats

    found = PrefixQuantOptions()
    stats = outlier_stats(loaded.adapter, ctx.windows.ids, ctx.progress)
    return choose_tokens(stats, found.eta, found.max_tokens, bos)[0]


class _Trainer:
    """The quantized-cache forward with trainable prefix rows, and the layer-output loss."""

    def __init__(self, loaded, base_policy, base_tensors, prefix: Prefix):
        self.loaded, self.model, self.adapter = loaded, loaded.model, loaded.adapter
        info = self.adapter.info
        static = {n: t for n, t in base_tensors.items() if tensor_kind(n) == "policy"}
        # the base's codecs, built as the runtime builds them: one implementation per format
        cache = build_cache(self.model, base_policy.with_prefix(None), static, self.adapter)
        self.layers = cache.layers
        for layer in self.layers:
            if layer.windowed:
                raise KvqError(
                    f"intactkv: layer {layer.layer_idx}'s layout keeps a residual window or "
                    "token groups; only per-row layouts (kvquant, channel-scales...) are supported"
                )
        self.prefix = prefix
        self.length = prefix.length
        self.keys = [nn.Parameter(kv.key.clone().float()) for kv in prefix.layers]
        self.values = [nn.Parameter(kv.value.clone().float()) for kv in prefix.layers]
        self.device = input_device(self.model)
        self.body = self.model.get_decoder()
        self.sites = self.adapter.decoder_layers()
        self.num_layers = info.num_layers

    # --- the forward -------------------------------------------------------------------

    def _fake_quant(self, layer, part: str, x: Tensor, positions: Tensor) -> Tensor:
        """x [B, H, T, D] (keys post-RoPE) as the cache would give it back, with a
        straight-through gradient; the first `sink_tokens` rows stay exact."""
        codec = layer.key_codec if part == "key" else layer.value_codec
        with torch.no_grad():
            y = x.detach().float()
            pre = part == "key" and layer.policy.key_stage == "pre-rope"
            if pre:
                y = layer.unrotate(y, positions)
            rows, flat = codec.encode(y)
            y = codec.decode(rows, flat).float()
            if pre:
                y = layer.rotate(y, positions)
            sink = layer.policy.sink_tokens
            if sink:
                y[:, :, :sink] = x[:, :, :sink].detach().to(y.dtype).to(layer.sink_dtype).float()
        return x + (y.to(x.dtype) - x).detach()

    def _attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        """query [B, H_q, T, D], key/value [B, H_kv, T, D] post-RoPE at positions 0..T-1:
        attention over the trainable prefix rows (at -P .. -1) and the fake-quantized rows."""
        i = module.layer_idx
        layer = self.layers[i]
        b, _, t, _ = key.shape
        p = self.length
        positions = torch.arange(t, device=key.device)[None].expand(b, t)
        kq = self._fake_quant(layer, "key", key, positions)
        vq = self._fake_quant(layer, "value", value, positions)
        ppos = torch.arange(-p, 0, device=key.device)[None].expand(b, p)
        # as the cache serves them: rotated, then held in the prefix rows' dtype (fp16 for an
        # fp32 model), with a straight-through gradient across that rounding
        pk = _held(layer.rotate(self.keys[i][None].expand(b, -1, -1, -1), ppos), layer)
        pv = _held(self.values[i][None].expand(b, -1, -1, -1), layer)
        pk, pv = pk.to(key.dtype), pv.to(value.dtype)
        k, v = torch.cat([pk, kq], dim=2), torch.cat([pv, vq], dim=2)
        # causal over prefix + window, and the layer's sliding window, in served positions
        q_pos = torch.arange(t, device=key.device)[:, None] + p
        k_pos = torch.arange(p + t, device=key.device)[None]
        mask = k_pos <= q_pos
        if layer.sliding_window is not None:
            mask &= q_pos - k_pos < layer.sliding_window
        group = query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale)
        return out.transpose(1, 2).contiguous(), None

    def _layer_outputs(self, ids: Tensor, quantized: bool) -> list[Tensor]:
        """Each decoder layer's output [1, T, hidden] at the window's positions, for the
        window `ids` [1, T] served after the prefix: unquantized (the exact prefix runs as
        tokens) or through the quantized cache with the trainable rows."""
        outputs: list[Tensor] = []

        def keep(_module, _inputs, output):
            outputs.append(output[0] if isinstance(output, tuple) else output)

        handles = [site.register_forward_hook(keep) for site in self.sites]
        try:
            if quantized:
                previous = self.model.config._attn_implementation
                self.model.set_attn_implementation(ATTENTION)
                try:
                    self.body(input_ids=ids, use_cache=False)
                finally:
                    self.model.set_attn_implementation(previous)
            else:
                prefix = torch.tensor([self.prefix.token_ids], device=ids.device)
                self.body(input_ids=torch.cat([prefix, ids], dim=1), use_cache=False)
                outputs[:] = [o[:, self.length :] for o in outputs]
        finally:
            for h in handles:
                h.remove()
        return outputs

    def loss(self, ids: Tensor, targets: list[Tensor], relative: bool = False) -> Tensor:
        """Sum over layers of the MSE between quantized-cache and unquantized outputs;
        `relative` divides each layer's MSE by its unquantized output's mean square. The
        residual stream grows with depth (Gemma 3 270M: mean square 150 at layer 0, 2e6 at
        layer 17), so the plain sum is decided by the last few layers."""
        outputs = self._layer_outputs(ids, quantized=True)
        total = outputs[0].new_zeros((), dtype=torch.float32)
        for o, t in zip(outputs, targets, strict=True):
            mse = F.mse_loss(o.float(), t.float())
            total = total + (mse / t.float().pow(2).mean() if relative else mse)
        return total

    def calibrated(self, source: str) -> Prefix:
        layers = tuple(
            PrefixKV(k.detach().clone(), v.detach().clone())
            for k, v in zip(self.keys, self.values, strict=True)
        )
        spec = PrefixSpec(self.prefix.token_ids, self.prefix.spec.tokenizer_sha256, source)
        return Prefix(spec, layers)


def _held(x: Tensor, layer) -> Tensor:
    """x rounded to the dtype the cache keeps prefix rows in (`sink_dtype`), identity grad."""
    return x + (x.detach().to(layer.sink_dtype).float() - x.detach()).to(x.dtype)


def _register(trainer: _Trainer) -> None:
    AttentionInterface.register(ATTENTION, trainer._attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)


def fit(ctx: FitContext) -> PassResult:
    """The registered `intactkv` pass: the base's layout and state, with the prefix rows
    declared (calibrated when --lr > 0)."""
    options: IntactKVOptions = ctx.options  # its base: checked by the registry's rules
    loaded = ctx.loaded
    ids_prefix = prefix_ids(ctx, options)
    progress = ctx.progress
    with progress.stage("extract prefix K/V"):
        exact = extract_prefix(loaded, ids_prefix, "intactkv-exact")
    trainer = _Trainer(loaded, ctx.base.policy, ctx.base.tensors, exact)
    _register(trainer)
    relative = options.loss == "relative"
    bos = getattr(loaded.tokenizer, "bos_token_id", None)
    windows = user_tokens(ctx.windows.ids, exact.spec, bos).to(trainer.device)
    n = windows.shape[0]
    model = loaded.model
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        with torch.no_grad(), progress.stage("unquantized layer outputs", total=n) as bar:
            targets = []
            for w in range(n):
                targets.append(
                    [o.detach() for o in trainer._layer_outputs(windows[w : w + 1], False)]
                )
                bar.advance()

        def mean_loss(stage: str) -> float:
            total = 0.0
            with torch.no_grad(), progress.stage(stage, total=n) as bar:
                for w in range(n):
                    total += float(trainer.loss(windows[w : w + 1], targets[w], relative))
                    bar.advance()
            return total / n

        before = mean_loss("loss, exact prefix")
        params = trainer.keys + trainer.values
        opt = torch.optim.AdamW(params, lr=options.lr, weight_decay=0.0)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(options.seed))
        curve = []
        with progress.stage("calibrate prefix", total=options.steps) as bar:
            for step in range(options.steps):
                w = int(order[step % n])
                opt.zero_grad(set_to_none=True)
                loss = trainer.loss(windows[w : w + 1], targets[w], relative)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, options.clip)
                opt.step()
                curve.append(float(loss.detach()))
                bar.advance()
        after = mean_loss("loss, calibrated prefix")
    finally:
        for p in frozen:
            p.requires_grad_(True)
    source = "intactkv-calibrated" if options.lr > 0 else "intactkv-exact"
    prefix = trainer.calibrated(source)
    if not all(math.isfinite(x) for x in (before, after)):
        raise KvqError(f"intactkv: the loss is not finite (before {before}, after {after})")
    tensors = ctx.base.policy_tensors()
    tokenizer = loaded.tokenizer
    report = {
        "prefix_ids": tuple(str(t) for t in prefix.token_ids),
        "prefix_text": tuple(repr(tokenizer.decode([t])) for t in prefix.token_ids),
        "objective": "sum over layers of MSE(layer output: quantized cache, unquantized)"
        + (" / mean square(unquantized layer output)" if relative else ""),
        "optimizer": f"AdamW lr {options.lr:g}, weight decay 0, grad-norm clip {options.clip:g}",
        "steps": options.steps,
        "loss_before": before,
        "loss_after": after,
        "loss_curve": tuple(round(x, 6) for x in curve[:: max(1, len(curve) // 256)]),
        "equals_exact": bool(
            all(
                torch.equal(a.key, b.key) and torch.equal(a.value, b.value)
                for a, b in zip(prefix.layers, exact.layers, strict=True)
            )
        ),
    }
    policy = ctx.base.policy.with_prefix(prefix.spec)
    return PassResult(policy, tensors | prefix.tensors(), report)
