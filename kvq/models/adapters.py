"""Architecture adapters: the ONLY place in kvq that knows model families.

An adapter answers, for one loaded HF causal LM: where are q/k/v produced (hook sites and how
to reshape their outputs to heads), which RoPE does each layer use (computed by the model's own
rotary module, so rope scaling is honoured exactly), what softmax scale and sliding window each
layer has, and how to rotate / un-rotate a pre-RoPE key. Everything else in kvq is
family-agnostic and goes through this interface.

Shapes: B batch, T tokens, H_q / H_kv query / key-value heads, D head_dim, R rotary_dim.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor, nn

from kvq.errors import KvqError
from kvq.manifests.identity import ArchitectureInfo, LayerType, RopeInfo

HeadFn = Callable[[Tensor], Tensor]


def _split_heads(num_heads: int, head_dim: int) -> HeadFn:
    """[B, T, H*D] projection output -> [B, H, T, D] (a view, no copy)."""

    def split(x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, num_heads, head_dim).transpose(1, 2)

    return split


def _already_heads(x: Tensor) -> Tensor:
    """Gemma 3 normalises q/k after the head split, so its norm output is already [B, H, T, D]."""
    return x


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


class ArchitectureAdapter:
    """Base adapter: Llama-style attention (q/k/v_proj, rotate-half RoPE, one rotary module)."""

    model_types: ClassVar[tuple[str, ...]] = ()
    qk_norm: ClassVar[bool] = False
    qk_norm_offset_one: ClassVar[bool] = False
    norm_offset_one: ClassVar[bool] = False  # decoder RMSNorms scale by (1 + w)

    def __init__(self, model: nn.Module):
        self.model = model
        self.model_type: str = model.config.model_type
        # Multimodal wrappers keep the decoder config under text_config.
        self.config = getattr(model.config, "text_config", None) or model.config
        self.text_model = self._find_text_model(model)
        self._layers = list(self.text_model.layers)
        self._info: ArchitectureInfo | None = None

    @staticmethod
    def _find_text_model(model: nn.Module) -> nn.Module:
        # CausalLM wrappers put the decoder at .model, multimodal ones at .model.language_model.
        inner = getattr(model, "model", model)
        for cand in (getattr(inner, "language_model", None), inner, model):
            if cand is not None and hasattr(cand, "layers") and hasattr(cand, "rotary_emb"):
                return cand
        raise KvqError(f"cannot find the decoder layers of {type(model).__name__}")

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
        return types[layer_idx] if types else "full_attention"

    def sliding_window(self, layer_idx: int) -> int | None:
        """Tokens a sliding layer attends to (incl. itself); None for full attention."""
        if self.layer_type(layer_idx) == "sliding_attention":
            return int(self.config.sliding_window)
        return None

    def attention_scaling(self, layer_idx: int) -> float:
        """Softmax scale applied to q·k."""
        return self.head_dim**-0.5

    def rope_parameters(self, layer_idx: int) -> dict:
        return dict(self.config.rope_parameters)

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
        """The RMSNorms whose output is the whole input of some decoder linears: (norm, eps,
        weight offset (1 for a (1 + w) norm), the linears' `decoder_linears` names) — where a
        fused RMSNorm + INT8 producer can replace the norm and the linears' quantizer."""
        offset = 1.0 if self.norm_offset_one else 0.0
        feeds = []
        for i, layer in enumerate(self._layers):
            attn = tuple(f"layers.{i}.self_attn.{p}_proj" for p in ("q", "k", "v"))
            mlp = tuple(f"layers.{i}.mlp.{p}_proj" for p in ("gate", "up"))
            for norm, names in ((layer.input_layernorm, attn), (self._pre_mlp_norm(layer), mlp)):
                eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
                feeds.append((norm, float(eps), offset, names))
        return feeds

    def _pre_mlp_norm(self, layer: nn.Module) -> nn.Module:
        return layer.post_attention_layernorm  # Llama, Qwen2: the norm before the MLP

    def attention(self, layer_idx: int) -> nn.Module:
        return self._layers[layer_idx].self_attn

    def key_pre_rope_site(self, layer_idx: int) -> tuple[nn.Module, HeadFn]:
        """(module, fn): fn(module output) is the pre-RoPE key [B, H_kv, T, D]."""
        return self.attention(layer_idx).k_proj, _split_heads(self.num_kv_heads, self.head_dim)

    def value_site(self, layer_idx: int) -> tuple[nn.Module, HeadFn]:
        """(module, fn): fn(module output) is the value [B, H_kv, T, D] as cached."""
        return self.attention(layer_idx).v_proj, _split_heads(self.num_kv_heads, self.head_dim)

    def query_pre_rope_site(self, layer_idx: int) -> tuple[nn.Module, HeadFn]:
        """(module, fn): fn(module output) is the pre-RoPE query [B, H_q, T, D]."""
        return self.attention(layer_idx).q_proj, _split_heads(self.num_q_heads, self.head_dim)

    def mlp_down_site(self, layer_idx: int) -> nn.Module:
        """The MLP's down projection: its input [B, T, I] is where token-wise activation
        outliers are largest (PrefixQuant's statistic)."""
        return self._layers[layer_idx].mlp.down_proj

    # ---- RoPE ---------------------------------------------------------------------------
    def _rotary_call(self, layer_idx: int, x: Tensor, position_ids: Tensor):
        return self.text_model.rotary_emb(x, position_ids)

    def _inv_freq(self, layer_idx: int) -> Tensor:
        return self.text_model.rotary_emb.inv_freq

    @torch.no_grad()
    def rope_cos_sin(self, layer_idx: int, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin for `positions` [T] (long), each [T, R] float32, from the model's own module."""
        inv_freq = self._inv_freq(layer_idx)
        probe = torch.empty(
            0, dtype=torch.float32, device=inv_freq.device
        )  # only dtype/device used
        pos = positions.to(device=inv_freq.device, dtype=torch.long).reshape(1, -1)
        cos, sin = self._rotary_call(layer_idx, probe, pos)
        return cos[0].float(), sin[0].float()

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
        self._require_linear(("q_proj", "k_proj"), "q/k scales")

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

        Here: the q/k projection rows and their biases ([H*D, hidden] rows, head-major)."""
        attn = self.attention(layer_idx)
        group = self.num_q_heads // self.num_kv_heads  # query head j reads KV head j // group
        for proj, factor in (
            (attn.q_proj, lam.repeat_interleave(group, 0)),
            (attn.k_proj, 1 / lam),
        ):
            f = factor.reshape(-1).to(proj.weight)  # [H*D], head-major like the rows
            proj.weight.mul_(f[:, None])
            if proj.bias is not None:
                proj.bias.mul_(f)

    # ---- per-head value rotation (`rotate`) ---------------------------------------------
    def check_values_rotatable(self) -> None:
        """Raise KvqError when a rotation of each KV head's values cannot be folded exactly
        into this model's weights (values must be a linear map of the layer input, and the
        output projection must read the heads' attention outputs side by side)."""
        self._require_linear(("v_proj", "o_proj"), "a rotation")
        for i in range(self.num_layers):
            if getattr(self.attention(i), "v_norm", None) is not None:  # it would undo it
                raise KvqError(f"{self.model_type}: layer {i} normalises its values")

    @torch.no_grad()
    def rotate_values(self, layer_idx: int, rot: Tensor) -> None:
        """Fold rot [H_kv, D, D] (orthogonal) into layer `layer_idx`: each KV head's values
        v -> R v (v_proj rows and bias, head-major), each query head's attention output
        o -> R^T o before o_proj (its columns times R^T), so the layer output is unchanged."""
        attn = self.attention(layer_idx)
        h_kv, d = self.num_kv_heads, self.head_dim
        group = self.num_q_heads // h_kv  # query head j reads KV head j // group
        v = attn.v_proj
        r = rot.to(v.weight)
        v.weight.copy_(torch.einsum("hij,hjk->hik", r, v.weight.view(h_kv, d, -1)).flatten(0, 1))
        if v.bias is not None:
            v.bias.copy_(torch.einsum("hij,hj->hi", r, v.bias.view(h_kv, d)).flatten())
        o = attn.o_proj
        r = rot.to(o.weight).repeat_interleave(group, 0)  # [H_q, D, D]
        cols = o.weight.view(o.weight.shape[0], self.num_q_heads, d)  # [out, H_q, D]
        o.weight.copy_(torch.einsum("ohj,hij->ohi", cols, r).flatten(1))


class LlamaAdapter(ArchitectureAdapter):
    """Llama and Mistral: no biases, no q/k norm, one RoPE for all layers."""

    model_types = ("llama", "mistral")

    def layer_type(self, layer_idx: int) -> LayerType:
        if self.model_type == "mistral":
            # Mistral has no layer_types: every layer slides when sliding_window is set.
            return "sliding_attention" if self.config.sliding_window else "full_attention"
        return super().layer_type(layer_idx)


class Qwen2Adapter(ArchitectureAdapter):
    """Qwen2: like Llama plus q/k/v biases (inside the projections, so the sites are the same);
    sliding layers per config.layer_types only when use_sliding_window is on."""

    model_types = ("qwen2",)


class Gemma3Adapter(ArchitectureAdapter):
    """Gemma 3: per-head q/k RMSNorm with (1 + w) weight before RoPE, sliding/full layers with
    separate RoPE parameters per layer type, softmax scale query_pre_attn_scalar**-0.5."""

    model_types = ("gemma3_text", "gemma3")
    qk_norm = True
    qk_norm_offset_one = True
    norm_offset_one = True

    def attention_scaling(self, layer_idx: int) -> float:
        return float(self.config.query_pre_attn_scalar) ** -0.5

    def _pre_mlp_norm(self, layer: nn.Module) -> nn.Module:
        # post_attention_layernorm normalises the attention output before the residual add
        return layer.pre_feedforward_layernorm

    def rope_parameters(self, layer_idx: int) -> dict:
        # 5.x keeps one rope dict per layer type (rope_local_base_freq became
        # rope_parameters["sliding_attention"]["rope_theta"]).
        return dict(self.config.rope_parameters[self.layer_type(layer_idx)])

    def key_pre_rope_site(self, layer_idx: int) -> tuple[nn.Module, HeadFn]:
        return self.attention(layer_idx).k_norm, _already_heads

    def query_pre_rope_site(self, layer_idx: int) -> tuple[nn.Module, HeadFn]:
        return self.attention(layer_idx).q_norm, _already_heads

    def _rotary_call(self, layer_idx: int, x: Tensor, position_ids: Tensor):
        return self.text_model.rotary_emb(x, position_ids, self.layer_type(layer_idx))

    def check_qk_scalable(self) -> None:
        # q/k are RMS-normalised after the projection, so a scale there would be normalised
        # away; it goes into the norm weights, which one [D] vector per layer shares across
        # all heads: per-head scales fit only a model with one KV head (270M, 1B)
        if self.num_kv_heads != 1:
            raise KvqError(
                f"{self.model_type} with {self.num_kv_heads} KV heads: its q/k RMSNorm weights "
                "are shared by all heads, so per-head q/k scales cannot be folded"
            )

    @torch.no_grad()
    def scale_qk(self, layer_idx: int, lam: Tensor) -> None:
        """Here: into the q/k RMSNorm weights, in Gemma's (1 + w) parametrisation."""
        attn = self.attention(layer_idx)
        (row,) = lam  # one KV head (check_qk_scalable)
        for norm, factor in ((attn.q_norm, row), (attn.k_norm, 1 / row)):
            w = norm.weight
            w.copy_((1.0 + w.float()) * factor.float().to(w.device) - 1.0)

    def _inv_freq(self, layer_idx: int) -> Tensor:
        return getattr(self.text_model.rotary_emb, f"{self.layer_type(layer_idx)}_inv_freq")


_ADAPTERS: tuple[type[ArchitectureAdapter], ...] = (LlamaAdapter, Qwen2Adapter, Gemma3Adapter)
SUPPORTED = ("gemma3", "gemma3_text", "llama", "mistral", "qwen2")


def get_adapter(model: nn.Module) -> ArchitectureAdapter:
    """The adapter for `model`, chosen by config.model_type; KvqError if unsupported."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for cls in _ADAPTERS:
        if model_type in cls.model_types:
            return cls(model)
    raise KvqError(f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED)}")
