"""Load-time checks of an artifact's stored values against what the runtime can use.

Hashes prove the bytes are the ones the manifest lists, not that they make sense: a
zeroed, negative or NaN scale re-hashed by hand would load and quietly ruin the output.
Here every stored qparam, codebook and threshold is checked against its rule (finite,
positive and a normal number of its storage dtype where a scale, strictly increasing
where a codebook), its shape against the manifest's geometry, and every layer's codecs
are built exactly as the cache builds them, so an artifact that reads is one that loads.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from kvq.calibrators.registry import TRANSFORMS
from kvq.errors import IncompatibleArtifact, KvqError
from kvq.manifests.schema import Manifest
from kvq.models.adapters import rope_partners
from kvq.quant.qparams import dtype_name, storage_dtype
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs import make_codec

# static tensor name -> (shape kind, value rule); shape "channel" is [H_kv, D],
# "levels" is [2^bits]
_RULES = {
    "scale": ("channel", "scale"),
    "offset": ("channel", "finite"),
    "center": ("channel", "finite"),
    "lower": ("channel", "finite"),
    "upper": ("channel", "finite"),
    "codebook": ("levels", "increasing"),
    "qnorm_levels": ("levels", "finite"),
    # vector codebooks: shapes and values checked by their codec (kvq.runtime.codecs.vq)
    "vq_codebook": ("codec", "finite"),
    "vq_groups": ("codec", "index"),
    "vq_weight": ("channel", "nonnegative"),
    # trellis tables: shape and values checked by their codec (kvq.runtime.codecs.trellis)
    "trellis_table": ("codec", "finite"),
    "trellis_weight": ("channel", "nonnegative"),
    # NVFP4's per-tensor global scale: checked by its codec (kvq.runtime.codecs.nvfp4)
    "global_scale": ("codec", "finite"),
}
# a static scale of a whole KV head or tensor (FP8/INT8 as serving engines store them)
_STATIC_AXIS_SHAPES = {"head": lambda heads: (heads,), "tensor": lambda heads: (1,)}
_QPARAMS = ("scale", "offset", "center")  # stored in the scheme's scale dtype
# layers.{i}.KIND.* other than the policy's key/value state: model transforms
_TRANSFORM = re.compile(r"^layers\.\d+\.(?!key\.|value\.|prefix\.)[^.]+\.")


def check_artifact_state(manifest: Manifest, tensors: dict[str, Tensor]) -> None:
    """Refuse (IncompatibleArtifact naming the tensor) any stored value the runtime would
    misuse; build every layer's codecs as `build_cache` does."""
    arch = manifest.architecture
    for i, layer in enumerate(manifest.policy.layers):
        if layer.key_stage == "pre-rope" and arch.rope[i].rotary_dim != arch.head_dim:
            raise IncompatibleArtifact(
                f"architecture.rope[{i}].rotary_dim",
                f"{arch.head_dim} (pre-RoPE keys need RoPE over the whole head)",
                arch.rope[i].rotary_dim,
            )
        for part, scheme in (("key", layer.key), ("value", layer.value)):
            prefix = f"layers.{i}.{part}."
            state = {n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)}
            for name, t in state.items():
                _check_tensor(prefix + name, name, t, scheme, arch.num_kv_heads, arch.head_dim)
            if "lower" in state and "upper" in state and not _all(state["lower"] <= state["upper"]):
                raise IncompatibleArtifact(f"tensors[{prefix}lower]", "<= upper", "above it")
            try:
                codec = make_codec(scheme, arch.head_dim, torch.float32, state, prefix[:-1])
            except KvqError as e:
                where = f"policy.layers[{i}].{part}"
                raise IncompatibleArtifact(where, "a usable scheme", str(e)) from None
            unused = sorted(state.keys() - codec.static.keys())
            if unused:
                raise IncompatibleArtifact(
                    f"tensors[{prefix}{unused[0]}]", f"absent ({scheme.describe()})", "present"
                )
    _check_prefix(manifest, tensors)
    for name in tensors:
        # a model transform this kvq cannot apply would be silently skipped: refuse it
        kind = name.split(".")[2] if _TRANSFORM.match(name) else None
        if kind is not None and kind not in TRANSFORMS:
            raise IncompatibleArtifact(
                f"tensors[{name}]", f"a transform of {list(TRANSFORMS)}", kind
            )
        if kind == "smooth":
            _check_smooth(name, tensors[name], arch)
        if kind == "rotate":
            _check_rotation(name, tensors[name], arch)
        if name.startswith("act."):
            _check_input_scale(name, tensors[name], arch.num_layers)
    for name in ("fisher.key", "fisher.value"):
        if name in tensors:
            shape = (arch.num_layers, arch.num_kv_heads, arch.head_dim)
            _check_shape(name, tensors[name], shape)
            if not _all(torch.isfinite(tensors[name]) & (tensors[name] >= 0)):
                raise IncompatibleArtifact(f"tensors[{name}]", "finite, >= 0", "other values")


def _check_prefix(manifest: Manifest, tensors: dict[str, Tensor]) -> None:
    """Prefix rows: exactly `layers.{i}.prefix.key|value` [H_kv, P, D] for every layer when
    the policy declares a prefix of P tokens, none otherwise; float, finite."""
    arch, spec = manifest.architecture, manifest.policy.prefix
    names = {n for n in tensors if re.match(r"^layers\.\d+\.prefix\.", n)}
    want = set()
    if spec is not None:
        want = {f"layers.{i}.prefix.{p}" for i in range(arch.num_layers) for p in ("key", "value")}
    for name in sorted(names ^ want):
        found = "present" if name in names else "missing"
        raise IncompatibleArtifact(f"tensors[{name}]", "the policy's prefix rows", found)
    for name in sorted(names):
        t = tensors[name]
        _check_shape(name, t, (arch.num_kv_heads, spec.length, arch.head_dim))
        if not t.dtype.is_floating_point or not _all(torch.isfinite(t.float())):
            raise IncompatibleArtifact(f"tensors[{name}]", "finite floats", "other values")


def _check_tensor(
    full: str, name: str, t: Tensor, scheme: QuantScheme, heads: int, head_dim: int
) -> None:
    if name not in _RULES:
        raise IncompatibleArtifact(f"tensors[{full}]", "a known static tensor", "unknown name")
    shape_kind, rule = _RULES[name]
    shape = (heads, head_dim) if shape_kind == "channel" else (2**scheme.bits,)
    if name == "scale" and scheme.axis in _STATIC_AXIS_SHAPES:
        shape = _STATIC_AXIS_SHAPES[scheme.axis](heads)
    if shape_kind != "codec":
        _check_shape(full, t, shape)
    if rule == "index":
        if t.dtype != torch.int16:
            raise IncompatibleArtifact(f"tensors[{full}].dtype", "int16", dtype_name(t.dtype))
        return
    if not t.dtype.is_floating_point:
        raise IncompatibleArtifact(f"tensors[{full}].dtype", "a float dtype", dtype_name(t.dtype))
    if name in _QPARAMS:
        want = storage_dtype(scheme.scale_dtype)
        if t.dtype != want:
            raise IncompatibleArtifact(
                f"tensors[{full}].dtype", dtype_name(want), dtype_name(t.dtype)
            )
    x = t.float()
    if not _all(torch.isfinite(x)):
        raise IncompatibleArtifact(f"tensors[{full}]", "finite values", "NaN or Inf")
    tiny = torch.finfo(t.dtype).tiny
    if rule == "scale" and not _all(x >= tiny):
        # zero, negative or subnormal (unsafe under flush-to-zero): the stored-scale policy
        want = f"positive normal {dtype_name(t.dtype)} scales (>= {tiny:.3g})"
        raise IncompatibleArtifact(f"tensors[{full}]", want, f"min {float(x.min()):.3g}")
    if rule == "nonnegative" and not _all(x >= 0):
        raise IncompatibleArtifact(f"tensors[{full}]", "non-negative weights", "a negative one")
    if rule == "increasing" and not _all(x[1:] > x[:-1]):
        raise IncompatibleArtifact(f"tensors[{full}]", "strictly increasing levels", "not")


_SMOOTH = re.compile(r"^layers\.(\d+)\.smooth\.lambda$")


def _check_smooth(name: str, t: Tensor, arch) -> None:
    """SmoothAttention's lambda: [H_kv, D] float32, positive normal, equal within each RoPE
    pair of its layer (else folding it would change the attention it claims to keep)."""
    m = _SMOOTH.match(name)
    if m is None or int(m.group(1)) >= arch.num_layers:
        raise IncompatibleArtifact(f"tensors[{name}]", "layers.{i}.smooth.lambda", "other name")
    _check_shape(name, t, (arch.num_kv_heads, arch.head_dim))
    if t.dtype != torch.float32:
        raise IncompatibleArtifact(f"tensors[{name}].dtype", "float32", dtype_name(t.dtype))
    if not _all(torch.isfinite(t) & (t >= torch.finfo(torch.float32).tiny)):
        raise IncompatibleArtifact(f"tensors[{name}]", "finite positive normal values", "other")
    rope = arch.rope[int(m.group(1))]
    partners = rope_partners(arch.head_dim, rope.rotary_dim, rope.pairing)
    if not torch.equal(t, t[:, partners]):
        raise IncompatibleArtifact(f"tensors[{name}]", "equal within each RoPE pair", "not")


_ROTATE = re.compile(r"^layers\.(\d+)\.rotate\.value$")


def _check_rotation(name: str, t: Tensor, arch) -> None:
    """A value rotation: [H_kv, D, D] float32 and orthogonal (R R^T = I within 1e-4), else
    folding it into v_proj/o_proj would change the model it claims to keep."""
    m = _ROTATE.match(name)
    if m is None or int(m.group(1)) >= arch.num_layers:
        raise IncompatibleArtifact(f"tensors[{name}]", "layers.{i}.rotate.value", "other name")
    _check_shape(name, t, (arch.num_kv_heads, arch.head_dim, arch.head_dim))
    if t.dtype != torch.float32:
        raise IncompatibleArtifact(f"tensors[{name}].dtype", "float32", dtype_name(t.dtype))
    if not _all(torch.isfinite(t)):
        raise IncompatibleArtifact(f"tensors[{name}]", "finite values", "NaN or Inf")
    gram = t.double() @ t.double().transpose(-1, -2)  # [H_kv, D, D]
    off = float((gram - torch.eye(arch.head_dim, dtype=torch.float64)).abs().max())
    if off > 1e-4:
        raise IncompatibleArtifact(
            f"tensors[{name}]", "an orthogonal matrix", f"|RR^T-I| {off:.3g}"
        )


_INPUT_SCALE = re.compile(r"^act\.layers\.(\d+)\.[A-Za-z0-9_.]+\.input_scale$")


def _check_input_scale(name: str, t: Tensor, num_layers: int) -> None:
    """A static activation scale (`act-scales`): [1] float32, positive normal, of a layer
    the model has (whether the model has that linear is checked when it is used)."""
    m = _INPUT_SCALE.match(name)
    if m is None or int(m.group(1)) >= num_layers:
        want = "act.layers.{i}.<linear>.input_scale"
        raise IncompatibleArtifact(f"tensors[{name}]", want, "other name")
    _check_shape(name, t, (1,))
    if t.dtype != torch.float32:
        raise IncompatibleArtifact(f"tensors[{name}].dtype", "float32", dtype_name(t.dtype))
    if not _all(torch.isfinite(t) & (t >= torch.finfo(torch.float32).tiny)):
        raise IncompatibleArtifact(f"tensors[{name}]", "a finite positive normal scale", "other")


def _check_shape(name: str, t: Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise IncompatibleArtifact(f"tensors[{name}].shape", shape, tuple(t.shape))


def _all(mask: Tensor) -> bool:
    return bool(mask.all())
