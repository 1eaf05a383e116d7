"""Architecture adapters: with `families`, the ONLY place in kvq that knows model families.

One adapter class serves every family kvq takes. For one loaded HF causal LM it answers:
where q/k/v are produced (hook sites, and how to reshape their outputs to heads), which RoPE
each layer uses (computed by the model's own rotary module, so rope scaling is honoured
exactly), each layer's softmax scale and sliding window, and how to rotate / un-rotate a
pre-RoPE key. It derives all of it from the config and the attention modules (separate or
fused q/k/v, per-head or whole-projection q/k norms, (1 + w) norms, per-layer-type RoPE,
half cos/sin tables, the module's own scale, soft-capping, learned sinks) and checks what
it derived on one short forward (`verify_adapter`). Everything else in kvq is
family-agnostic and goes through this interface.

Shapes: B batch, T tokens, H_q / H_kv query / key-value heads, D head_dim, R rotary_dim.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable

import torch
from torch import Tensor, nn

from kvq.errors import KvqError
from kvq.manifests.identity import ArchitectureInfo, LayerType, RopeInfo
from kvq.models.families import check_architecture

HeadFn = Callable[[Tensor], Tensor]


def _split_heads(num_heads: int, head_dim: int) -> HeadFn:
    """[B, T, H*D] projection output -> [B, H, T, D] (a view, no copy)."""

    def split(x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, num_heads, head_dim).transpose(1, 2)

    return split


def _rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the last dim: the HF rotate-half pairing (i, i + R/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_partners(head_dim: int, rotary_dim: int, pairing: str) -> Tensor:
    """[D] long: the channel each channel rotates with; channels past `rotary_dim` are
    not rotated and partner themselves. rotate-half pairs (i, i + R/2), interleaved
    pairs (2i, 2i + 1)."""
    c = torch.arange(head_dim)
    r = torch.arange(rotary_dim)
    if pairing == "rotate-half":
        c[:rotary_dim] = (r + rotary_dim // 2) % rotary_dim
    elif pairing == "interleaved":
        c[:rotary_dim] = r ^ 1
    else:
        raise KvqError(f"unknown RoPE pairing {pairing!r}")
    return c


def _canonical_scaling(params: dict) -> str | None:
    """Rope parameters other than theta as canonical JSON; None for plain default RoPE."""
    rest = {k: v for k, v in params.items() if k != "rope_theta"}
    if rest in ({}, {"rope_type": "default"}):
        return None
    return json.dumps(rest, sort_keys=True, separators=(",", ":"))


def _norm_offset(norm: nn.Module | None) -> float | None:
    """1.0 for an RMSNorm that scales by (1 + w) (Gemma), 0.0 for one that scales by w,
    None when `norm` is no weighted RMSNorm (LayerNorm, none): measured on one probe row
    with the weight temporarily set to 0.5 (its forward called without hooks), not read
    from the class name."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 1 or weight.device.type == "meta":
        return None
    x = torch.linspace(-1.0, 2.0, weight.numel(), device=weight.device)[None]  # [1, N]
    unit = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))  # RMS-normalised, no weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.fill_(0.5)
            out = type(norm).forward(norm, x.to(weight.dtype)).float()  # no hooks fire
    except Exception:  # a norm this probe cannot call: no fused producer for it
        return None
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    for offset in (0.0, 1.0):
        if torch.allclose(out, unit * (0.5 + offset), rtol=1e-2, atol=1e-3):
            return offset
    return None


class ArchitectureAdapter:
    """The adapter of any decoder whose attention kvq can read: everything derived from
    the config and the modules (Llama style by default)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.model_type: str = model.config.model_type
        # Multimodal wrappers keep the decoder config under text_config.
        self.config = getattr(model.config, "text_config", None) or model.config
        self.text_model = self._find_text_model(model)
        self._layers = list(self.text_model.layers)
        self._info: ArchitectureInfo | None = None
        attn = self.attention(0)
        # Phi-3 computes q, k and v in one projection, [q | k | v] along its output rows
        self.fused_qkv = isinstance(getattr(attn, "qkv_proj", None), nn.Linear)
        self.qk_norm_kind = self._qk_norm_kind(attn)  # None, "head" or "projection"
        # a per-head norm runs on [B, T, H, D] (Qwen3) or after the transpose on [B, H, T, D]
        # (Gemma 3): `verify_adapter` measures which
        self.qk_norm_heads_first = False
        self._offsets: dict[tuple[type, int], float | None] = {}  # `_offset`'s probes
        self.qk_norm_offset_one = bool(self.qk_norm_kind and self._offset(attn.k_norm) == 1.0)
        first = self._layers[0]
        self.norm_offset_one = self._offset(getattr(first, "input_layernorm", None)) == 1.0

    @property
    def qk_norm(self) -> bool:
        return self.qk_norm_kind is not None

    def _qk_norm_kind(self, attn: nn.Module) -> str | None:
        """ "head": one [D] norm over each head (Qwen3, Gemma 3); "projection": one norm over
        the whole [H*D] projection (OLMo 2); None: no q/k norm."""
        norm = getattr(attn, "k_norm", None)
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, Tensor):
            return None
        if weight.numel() == self.head_dim:
            return "head"
        if weight.numel() == self.num_kv_heads * self.head_dim:
            return "projection"
        raise KvqError(f"{self.model_type}: a k_norm of {weight.numel()} weights kvq cannot place")

    @staticmethod
    def _find_text_model(model: nn.Module) -> nn.Module:
        # CausalLM wrappers put the decoder at .model, multimodal ones at .model.language_model.
        inner = getattr(model, "model", model)
        for cand in (getattr(inner, "language_model", None), inner, model):
            if cand is not None and hasattr(cand, "layers") and hasattr(cand, "rotary_emb"):
                return cand
        raise KvqError(
            f"kvq cannot take {type(model).__name__}: no decoder layers with a rotary "
            "embedding (absolute or ALiBi positions are not supported)"
        )

    # ---- layout -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def num_q_heads(self) -> int:
        return int(self.config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return int(getattr(self.config, "num_key_value_heads", None) or self.num_q_heads)

    @property
    def head_dim(self) -> int:
        # The attention module resolves head_dim=None configs (Mistral) to hidden // heads.
        return int(self.attention(0).head_dim)

    @property
    def max_positions(self) -> int | None:
        """The context length the model was trained for (None if its config has none)."""
        n = getattr(self.config, "max_position_embeddings", None)
        return int(n) if n else None

    def layer_type(self, layer_idx: int) -> LayerType:
        types = getattr(self.config, "layer_types", None)
        if types:
            return types[layer_idx]
        # Mistral, Mixtral, Phi-3 have no layer_types: every layer slides when a window is set
        return (
            "sliding_attention"
            if getattr(self.config, "sliding_window", None)
            else ("full_attention")
        )

    def sliding_window(self, layer_idx: int) -> int | None:
        """Tokens a sliding layer attends to (incl. itself); None for full attention."""
        if self.layer_type(layer_idx) == "sliding_attention":
            return int(self.config.sliding_window)
        return None

    def attention_scaling(self, layer_idx: int) -> float:
        """Softmax scale applied to q·k: the attention module's own (Gemma's
        query_pre_attn_scalar, Granite's attention_multiplier)."""
        scaling = getattr(self.attention(layer_idx), "scaling", None)
        return float(scaling) if scaling is not None else self.head_dim**-0.5

    def softcap(self, layer_idx: int) -> float | None:
        """Gemma 2's attention-logit soft-cap (None: none)."""
        cap = getattr(self.attention(layer_idx), "attn_logit_softcapping", None)
        return float(cap) if cap else None

    def sinks(self, layer_idx: int) -> Tensor | None:
        """GPT-OSS's learned sink logits [H_q] (None: none)."""
        sinks = getattr(self.attention(layer_idx), "sinks", None)
        return sinks if isinstance(sinks, Tensor) else None

    def rope_parameters(self, layer_idx: int) -> dict:
        params = dict(self.config.rope_parameters)
        # Gemma 3 keeps one rope dict per layer type
        return dict(params.get(self.layer_type(layer_idx), params))

    @property
    def info(self) -> ArchitectureInfo:
        if self._info is None:
            n = self.num_layers
            windows = {self.sliding_window(i) for i in range(n)} - {None}
            if len(windows) > 1:  # ArchitectureInfo has room for one window size
                raise KvqError(f"layers use different sliding windows {sorted(windows)}")
            rope = tuple(self._rope_info(i) for i in range(n))
            self._info = ArchitectureInfo(
                model_type=self.model_type,
                num_layers=n,
                num_q_heads=self.num_q_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                layer_types=tuple(self.layer_type(i) for i in range(n)),
                sliding_window=windows.pop() if windows else None,
                rope=rope,
                qk_norm=self.qk_norm,
                qk_norm_offset_one=self.qk_norm_offset_one,
            )
        return self._info

    def _rope_info(self, layer_idx: int) -> RopeInfo:
        params = self.rope_parameters(layer_idx)
        inv_freq = self._inv_freq(layer_idx)
        return RopeInfo(
            theta=float(params["rope_theta"]),
            rotary_dim=2 * inv_freq.numel(),
            pairing="rotate-half",
            scaling=_canonical_scaling(params),
        )

    # ---- modules and hook sites -----------------------------------------------------------
    def decoder_layers(self) -> list[nn.Module]:
        return list(self._layers)

    def decoder_linears(self) -> dict[str, nn.Linear]:
        """Every linear layer inside the decoder layers, by "layers.{i}.<path in the layer>"
        (e.g. "layers.3.mlp.down_proj"), in execution-independent module order."""
        found = {}
        for i, layer in enumerate(self._layers):
            for name, module in layer.named_modules():
                if isinstance(module, nn.Linear):
                    found[f"layers.{i}.{name}"] = module
        return found

    def norm_feeds(self) -> list[tuple[nn.Module, float, float, tuple[str, ...]]]:
        """The RMSNorms whose output is the whole input of some decoder linears and of
        nothing else: (norm, eps, weight offset (1 for a (1 + w) norm), the linears'
        `decoder_linears` names) — where a fused RMSNorm + INT8 producer can replace the
        norm and the linears' quantizer. Post-norm layers (OLMo 2), LayerNorms and MoE
        blocks (their experts are no linears) have none."""
        feeds = []
        for i, layer in enumerate(self._layers):
            attn = ("qkv",) if self.fused_qkv else ("q", "k", "v")
            pairs = [(getattr(layer, "input_layernorm", None),
                      tuple(f"layers.{i}.self_attn.{p}_proj" for p in attn))]  # fmt: skip
            mlp = self._dense_mlp_inputs(layer)
            if mlp:
                pairs.append((self._pre_mlp_norm(layer), tuple(f"layers.{i}.mlp.{n}" for n in mlp)))
            for norm, names in pairs:
                offset = self._offset(norm)
                if offset is None:
                    continue
                eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
                feeds.append((norm, float(eps), offset, names))
        return feeds

    def _offset(self, norm: nn.Module | None) -> float | None:
        """`_norm_offset`, probed once per norm class and width: the offset is the class's
        arithmetic, and each probe writes the weight (which re-hashes the model's weights)."""
        weight = getattr(norm, "weight", None)
        key = (type(norm), weight.numel() if isinstance(weight, Tensor) else 0)
        if key not in self._offsets:
            self._offsets[key] = _norm_offset(norm)
        return self._offsets[key]

    def _dense_mlp_inputs(self, layer: nn.Module) -> tuple[str, ...]:
        """The linears reading a dense MLP's input (gate/up, or Phi-3's gate_up); () for an
        MoE block, whose experts also read it."""
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            return ()
        linears = {n: m for n, m in mlp.named_children() if isinstance(m, nn.Linear)}
        owned = sum(p.numel() for m in linears.values() for p in m.parameters())
        if owned != sum(p.numel() for p in mlp.parameters()):  # experts, routers' extras
            return ()
        hidden = int(self.config.hidden_size)
        return tuple(n for n, m in linears.items() if m.in_features == hidden)

    def _pre_mlp_norm(self, layer: nn.Module) -> nn.Module | None:
        if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma: post_attention_... is a post-norm
            return layer.pre_feedforward_layernorm
        if hasattr(layer, "post_feedforward_layernorm"):  # OLMo 2: post-norms only
            return None
        return getattr(layer, "post_attention_layernorm", None)  # Llama, Qwen, ...

    def attention(self, layer_idx: int) -> nn.Module:
        return self._layers[layer_idx].self_attn

    def _projection_rows(self, layer_idx: int, which: str) -> tuple[nn.Linear, slice]:
        """The linear producing `which` ("q", "k" or "v") and its rows in it: all rows of
        q/k/v_proj, or one block of a fused qkv_proj ([q | k | v])."""
        attn = self.attention(layer_idx)
        if not self.fused_qkv:
            return getattr(attn, f"{which}_proj"), slice(None)
        q, kv = self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim
        start = {"q": 0, "k": q, "v": q + kv}[which]
        return attn.qkv_proj, slice(start, start + (q if which == "q" else kv))

    def _projection_site(self, layer_idx: int, which: str, heads: int) -> tuple[nn.Module, HeadFn]:
        proj, rows = self._projection_rows(layer_idx, which)
        split = _split_heads(heads, self.head_dim)
        if rows == slice(None):
            return proj, split
        return proj, lambda x: split(x[..., rows])

    def _pre_rope_site(self, layer_idx: int, which: str, heads: int) -> tuple[nn.Module, HeadFn]:
        if self.qk_norm_kind is None:
            return self._projection_site(layer_idx, which, heads)
        norm = getattr(self.attention(layer_idx), f"{which}_norm")
        if self.qk_norm_kind == "projection":  # OLMo 2: norm over [B, T, H*D]
            return norm, _split_heads(heads, self.head_dim)
        return norm, self._heads_from_norm

    def _heads_from_norm(self, x: Tensor) -> Tensor:
        """A per-head q/k norm's output -> [B, H, T, D]."""
        return x if self.qk_norm_heads_first else x.transpose(1, 2)

    def key_pre_rope_site(self, layer_idx: int) -> tuple[nn.Module, HeadFn]:
        """(module, fn): fn(module output) is the pre-RoPE key [B, H_kv, T, D]."""
        return self._pre_rope_site(layer_idx, "k", self.num_kv_heads)

    def value_site(self, layer_idx: int) -> tuple[nn.Module, HeadFn]:
        """(module, fn): fn(module output) is the value [B, H_kv, T, D] as cached."""
        return self._projection_site(layer_idx, "v", self.num_kv_heads)

    def query_pre_rope_site(self, layer_idx: int) -> tuple[nn.Module, HeadFn]:
        """(module, fn): fn(module output) is the pre-RoPE query [B, H_q, T, D]."""
        return self._pre_rope_site(layer_idx, "q", self.num_q_heads)

    def mlp_down_site(self, layer_idx: int) -> nn.Module:
        """Where token-wise activation outliers are largest (PrefixQuant's statistic): the
        input [B, T, I] of the MLP's down projection; for MoE blocks, whose experts hold no
        linears, the decoder layer's input [B, T, hidden] (the residual stream, where the
        same tokens carry massive activations)."""
        layer = self._layers[layer_idx]
        down = getattr(getattr(layer, "mlp", None), "down_proj", None)
        return down if isinstance(down, nn.Linear) else layer

    # ---- RoPE ---------------------------------------------------------------------------
    def _rotary_call(self, layer_idx: int, x: Tensor, position_ids: Tensor):
        rotary = self.text_model.rotary_emb
        if "layer_type" in inspect.signature(rotary.forward).parameters:  # Gemma 3
            return rotary(x, position_ids, self.layer_type(layer_idx))
        return rotary(x, position_ids)

    def _inv_freq(self, layer_idx: int) -> Tensor:
        rotary = self.text_model.rotary_emb
        per_type = getattr(rotary, f"{self.layer_type(layer_idx)}_inv_freq", None)
        return per_type if per_type is not None else rotary.inv_freq

    @torch.no_grad()
    def rope_cos_sin(self, layer_idx: int, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin for `positions` [T] (long), each [T, R] float32, from the model's own module."""
        inv_freq = self._inv_freq(layer_idx)
        probe = torch.empty(0, dtype=torch.float32, device=inv_freq.device)  # dtype/device only
        pos = positions.to(device=inv_freq.device, dtype=torch.long).reshape(1, -1)
        cos, sin = self._rotary_call(layer_idx, probe, pos)
        cos, sin = cos[0].float(), sin[0].float()
        if cos.shape[-1] == inv_freq.numel():  # GPT-OSS: one half, applied to both halves
            cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        return cos, sin

    @staticmethod
    def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate x [B, H, T, D] by cos/sin [T, R] (R <= D leading channels; the rest pass)."""
        r = cos.shape[-1]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if r == x.shape[-1]:
            return x * cos + _rotate_half(x) * sin
        xr, xp = x[..., :r], x[..., r:]
        return torch.cat((xr * cos + _rotate_half(xr) * sin, xp), dim=-1)

    @classmethod
    def invert_rope(cls, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Undo apply_rope. x [B, H, T, D], cos/sin [T, R].

        The model's rotary module may scale cos and sin by an attention factor m (YaRN's
        0.1·ln(factor) + 1, LongRoPE's): apply_rope is then m times a rotation, and its
        inverse is the rotation by -angle divided by m² = cos² + sin² (1 for plain RoPE).
        Rotating back without the division would leave pre-RoPE keys m² too large."""
        r = cos.shape[-1]
        gain = (cos.float() ** 2 + sin.float() ** 2).to(x.dtype)  # [T, R]: m² per channel
        back = cls.apply_rope(x, cos, -sin)
        if r == x.shape[-1]:
            return back / gain
        return torch.cat((back[..., :r] / gain, back[..., r:]), dim=-1)

    # ---- per-channel q/k scaling (SmoothAttention) -------------------------------------
    def check_qk_scalable(self) -> None:
        """Raise KvqError when per-(KV head, channel) q/k scales cannot be folded exactly
        into this model's weights."""
        if self.qk_norm_kind == "head" and self.num_kv_heads != 1:
            # q/k are RMS-normalised after the projection, so a scale there would be
            # normalised away; it goes into the norm weights, which one [D] vector per layer
            # shares across all heads: per-head scales fit only a model with one KV head
            raise KvqError(
                f"{self.model_type} with {self.num_kv_heads} KV heads: its q/k RMSNorm weights "
                "are shared by all heads, so per-head q/k scales cannot be folded"
            )
        if self.qk_norm_kind is None:
            self._require_linear(("qkv_proj",) if self.fused_qkv else ("q_proj", "k_proj"),
                                 "q/k scales")  # fmt: skip

    def _require_linear(self, names: tuple[str, ...], what: str) -> None:
        """Raise KvqError unless every layer's attention has each of `names` as a Linear
        (what a folded transform rewrites)."""
        for i in range(self.num_layers):
            attn = self.attention(i)
            for name in names:
                if not isinstance(getattr(attn, name, None), nn.Linear):
                    raise KvqError(
                        f"{self.model_type}: layer {i} has no linear {name} to fold {what} into"
                    )

    @torch.no_grad()
    def scale_qk(self, layer_idx: int, lam: Tensor) -> None:
        """Fold lam [H_kv, D] into layer `layer_idx`: its queries multiplied by lam (each
        query head by its KV head's row), its keys divided, pre-RoPE. With lam equal within
        each RoPE pair the scaling commutes with the rotation, so q.k is unchanged.

        Where: the q/k projection rows and biases ([H*D, hidden] rows, head-major); with a
        q/k norm, its weights (normalisation comes first, so a weight scale is an output
        scale): the whole-projection norm's [H*D] weights, or the per-head norm's shared
        [D] weights (one KV head only, `check_qk_scalable`)."""
        group = self.num_q_heads // self.num_kv_heads  # query head j reads KV head j // group
        factors = {"q": lam.repeat_interleave(group, 0), "k": 1 / lam}
        attn = self.attention(layer_idx)
        for which, factor in factors.items():
            if self.qk_norm_kind is not None:
                f = factor[0] if self.qk_norm_kind == "head" else factor.reshape(-1)
                w = getattr(attn, f"{which}_norm").weight
                off = 1.0 if self.qk_norm_offset_one else 0.0
                w.copy_((off + w.float()) * f.float().to(w.device) - off)
                continue
            proj, rows = self._projection_rows(layer_idx, which)
            f = factor.reshape(-1).to(proj.weight)  # [H*D], head-major like the rows
            proj.weight[rows].mul_(f[:, None])
            if proj.bias is not None:
                proj.bias[rows].mul_(f)

    # ---- per-head value rotation (`rotate`) ---------------------------------------------
    def check_values_rotatable(self) -> None:
        """Raise KvqError when a rotation of each KV head's values cannot be folded exactly
        into this model's weights (values must be a linear map of the layer input, and the
        output projection must read the heads' attention outputs side by side)."""
        v = ("qkv_proj",) if self.fused_qkv else ("v_proj",)
        self._require_linear((*v, "o_proj"), "a rotation")
        for i in range(self.num_layers):
            if getattr(self.attention(i), "v_norm", None) is not None:  # it would undo it
                raise KvqError(f"{self.model_type}: layer {i} normalises its values")

    @torch.no_grad()
    def rotate_values(self, layer_idx: int, rot: Tensor) -> None:
        """Fold rot [H_kv, D, D] (orthogonal) into layer `layer_idx`: each KV head's values
        v -> R v (v rows and bias, head-major), each query head's attention output
        o -> R^T o before o_proj (its columns times R^T), so the layer output is unchanged."""
        attn = self.attention(layer_idx)
        h_kv, d = self.num_kv_heads, self.head_dim
        group = self.num_q_heads // h_kv  # query head j reads KV head j // group
        v, rows = self._projection_rows(layer_idx, "v")
        r = rot.to(v.weight)
        w = v.weight[rows]
        v.weight[rows] = torch.einsum("hij,hjk->hik", r, w.reshape(h_kv, d, -1)).flatten(0, 1)
        if v.bias is not None:
            b = v.bias[rows]
            v.bias[rows] = torch.einsum("hij,hj->hi", r, b.reshape(h_kv, d)).flatten()
        o = attn.o_proj
        r = rot.to(o.weight).repeat_interleave(group, 0)  # [H_q, D, D]
        cols = o.weight.view(o.weight.shape[0], self.num_q_heads, d)  # [out, H_q, D]
        o.weight.copy_(torch.einsum("ohj,hij->ohi", cols, r).flatten(1))


@torch.no_grad()
def verify_adapter(adapter: ArchitectureAdapter) -> None:
    """Check, on one forward of a few tokens, that what the adapter reads is what the model
    caches: RoPE(pre-RoPE key site) equals every layer's cached key and the value site its
    cached value. A family kvq reads wrongly (interleaved RoPE, layers without RoPE, an
    unusual fused projection) is refused here instead of calibrating the wrong tensors."""
    from transformers import DynamicCache

    model = adapter.model
    n = next(t for t in range(5, 64) if t not in (adapter.num_q_heads, adapter.num_kv_heads))
    from kvq.models.placement import input_device  # a dispatched model's weights may be meta

    device = input_device(model)
    vocab = int(getattr(adapter.config, "vocab_size", 0) or 0) or 32
    ids = (torch.arange(n, device=device) * 7 + 3).remainder(vocab)[None]  # [1, n]
    raw: dict[tuple[str, int], Tensor] = {}  # site outputs, before the adapter's reshape
    sites = {"key": adapter.key_pre_rope_site, "value": adapter.value_site}
    hooks = []
    for i in range(adapter.num_layers):
        for name, site in sites.items():

            def hook(_m, _args, out, name=name, i=i):
                raw[name, i] = out.detach()

            hooks.append(site(i)[0].register_forward_hook(hook))
    cache = DynamicCache(config=adapter.model.config)
    try:
        model(input_ids=ids, cache=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    if adapter.qk_norm_kind == "head":  # [B, n, H, D] or [B, H, n, D]: n differs from H
        adapter.qk_norm_heads_first = raw["key", 0].shape[2] == n
    seen = {(name, i): sites[name](i)[1](out).float() for (name, i), out in raw.items()}
    # the model rotates in its own dtype, kvq in fp32: a few roundings of that dtype apart
    # (a wrong RoPE pairing or projection slice is wrong by the size of the tensor itself)
    tolerance = max(1e-4, 8 * torch.finfo(cache.layers[0].keys.dtype).eps)
    for i in range(adapter.num_layers):
        cos, sin = adapter.rope_cos_sin(i, torch.arange(n))
        key = seen["key", i]
        expected = {"key": adapter.apply_rope(key, cos.to(key.device), sin.to(key.device)),
                    "value": seen["value", i]}  # fmt: skip
        cached = {"key": cache.layers[i].keys.float(), "value": cache.layers[i].values.float()}
        for name in ("key", "value"):
            got = cached[name]
            want = expected[name][..., -got.shape[-2] :, :].to(got.device)
            if got.shape != want.shape or _relative_error(got, want) > tolerance:
                how = "its projections and rotate-half RoPE" if name == "key" else "v_proj"
                raise KvqError(
                    f"kvq cannot take {adapter.model_type}: layer {i} caches {name}s that "
                    f"differ from {how} (an interleaved RoPE, layers without RoPE or another "
                    "projection layout)"
                )


def _relative_error(got: Tensor, want: Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def get_adapter(model: nn.Module, *, verify: bool = True) -> ArchitectureAdapter:
    """The adapter for `model`, checked on one short forward (`verify_adapter`); KvqError
    (one line) for a model kvq cannot take."""
    config = getattr(model, "config", None)
    check_architecture(config)
    try:
        adapter = ArchitectureAdapter(model)
        if verify:
            verify_adapter(adapter)
    except (AttributeError, TypeError, RuntimeError, KeyError, ValueError, IndexError) as e:
        first = (str(e).splitlines() or [""])[0][:200]
        raise KvqError(
            f"kvq cannot take {getattr(config, 'model_type', type(model).__name__)}: reading "
            f"its attention failed ({type(e).__name__}: {first})"
        ) from e
    return adapter
