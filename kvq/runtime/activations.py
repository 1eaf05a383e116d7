"""A8 at run time: the input of every decoder linear quantized to INT8, per token
(`a8-dynamic`) or with the artifact's static per-tensor scales (`a8-static`).

Two paths, chosen by the attention backend (`resolve_backend`):
  reference  fake-quant: the input is encoded and decoded by `kvq.quant.activations`
             (the shared symmetric INT8) and the linear runs in the model's dtype with
             its own weights, so the figures show what the activation codes cost alone;
  triton     the W8A8 GEMM of `kvq.runtime.kernels.activations.a8` (`int8_linear`) on the same
             activation codes and per-output-channel INT8 weight codes: what an INT8
             engine runs. The weights are quantized too, so its figures are W8A8's. With
             a8-dynamic, the RMSNorms that feed q/k/v and gate/up (`norm_feeds`) run as
             the fused RMSNorm + per-token INT8 producer (`rmsnorm_quant`), whose codes
             and scales go straight to those linears' GEMMs.

A declared prefix (IntactKV, PrefixQuant) is K/V rows in the cache, never a forward through
the linears: its activations are never computed here, so never quantized. Hooks are
installed on entry and removed on exit, so the baseline forward of an evaluation runs the
model untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from kvq.errors import IncompatibleArtifact, KvqError
from kvq.quant import activations as a8
from kvq.runtime.kernels.backend import resolve_backend


def static_scales(tensors: dict[str, Tensor], adapter) -> dict[str, Tensor]:
    """The artifact's static input scales by linear name ([1] float32 each); every decoder
    linear must have one, and none may name a linear the model lacks."""
    linears = adapter.decoder_linears()
    scales = {a8.linear_of(n): t for n, t in tensors.items() if n.startswith(a8.PREFIX)}
    if not scales:
        raise KvqError(
            "--activations a8-static needs an artifact with static input scales "
            "(kvq calibrate act-scales)"
        )
    unknown = sorted(scales.keys() - linears.keys())
    if unknown:
        raise IncompatibleArtifact(
            f"tensors[{a8.input_scale_name(unknown[0])}]", "a linear of the model", "none"
        )
    missing = sorted(linears.keys() - scales.keys())
    if missing:
        raise IncompatibleArtifact(
            f"tensors[{a8.input_scale_name(missing[0])}]", "present", "absent"
        )
    return scales


@contextmanager
def quantized_linear_inputs(
    adapter,
    mode: str,
    scales: dict[str, Tensor] | None = None,
    backend: str | None = None,
) -> Iterator[None]:
    """Quantize every decoder linear's input while inside (see the module docstring).

    mode: "a8-dynamic" or "a8-static" (then `scales`, from `static_scales`); "none" does
    nothing.
    """
    if mode not in a8.ACTIVATION_MODES:
        raise KvqError(f"--activations must be one of {', '.join(a8.ACTIVATION_MODES)}")
    if mode == "none":
        yield
        return
    if mode == "a8-static" and scales is None:
        raise KvqError("a8-static needs the artifact's static input scales")
    linears = adapter.decoder_linears()
    undo = []
    done = False
    try:
        fused: dict[str, dict] = {}  # linear name -> its norm's stash of codes
        if mode == "a8-dynamic":
            for norm, eps, offset, names in adapter.norm_feeds():
                if resolve_backend(backend, norm.weight.device) == "triton":
                    stash: dict = {}
                    undo.append(_fused_norm_hook(norm, eps, offset, stash).remove)
                    fused.update(dict.fromkeys(names, stash))
        for name, module in linears.items():
            scale = scales[name] if mode == "a8-static" else None
            if resolve_backend(backend, module.weight.device) == "triton":
                stash = fused.get(name)
                undo.append(_swap_forward(module, scale, backend, stash))
            else:
                undo.append(_fake_quant_hook(module, scale).remove)
        done = True
    finally:
        if not done:  # failed half-way: leave the model as it was
            for u in undo:
                u()
    try:
        yield
    finally:
        for u in undo:
            u()


def _fake_quant_hook(module: nn.Linear, scale: Tensor | None):
    scale = None if scale is None else scale.to(module.weight.device)

    def hook(_module, args):
        return (a8.round_trip(args[0], scale), *args[1:])  # input [B, T, K]

    return module.register_forward_pre_hook(hook)


def _fused_norm_hook(norm: nn.Module, eps: float, offset: float, stash: dict):
    """Replace the norm's output by the fused RMSNorm + INT8 producer's decoded codes, and
    leave (output, codes [M, K], scales [M]) in `stash` for the linears it feeds."""
    from kvq.runtime.kernels.activations.a8 import rmsnorm_quant

    def hook(_module, args, output):
        stash.clear()
        x = args[0]  # [B, T, K]
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        codes, scale = rmsnorm_quant(
            rows, norm.weight, eps, weight_offset=offset, scale_dtype=a8.SCALE_DTYPE,
            backend="triton",
        )  # fmt: skip
        out = a8.decode(codes, scale[:, None], output.dtype).view(x.shape)
        stash.update(output=out, codes=codes, scale=scale)
        return out

    return norm.register_forward_hook(hook)


def _swap_forward(
    module: nn.Linear,
    scale: Tensor | None,
    backend: str | None,
    stash: dict | None = None,
):
    """Replace module.forward by the W8A8 GEMM; returns the function that restores it.
    stash: the feeding norm's fused codes, used when this linear's input is its output."""
    from kvq.runtime.kernels.activations.a8 import int8_linear, quantize_weight_per_channel

    w_codes, w_scale = quantize_weight_per_channel(module.weight.detach())  # [N, K], [N]
    scale = None if scale is None else scale.to(module.weight.device)

    def forward(x: Tensor) -> Tensor:  # [B, T, K] -> [B, T, N]
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        if stash and stash.get("output") is x:  # produced by the fused RMSNorm + INT8
            codes, x_scale = stash["codes"], stash["scale"]
        elif scale is None:
            codes, x_scale = a8.encode_dynamic(rows)  # [M, K], [M, 1]
            x_scale = x_scale[:, 0]
        else:
            codes, x_scale = a8.encode_static(rows, scale), scale.expand(rows.shape[0])
        y = int8_linear(
            codes, x_scale, w_codes, w_scale, module.bias, x.dtype, backend=backend
        )  # [M, N]
        return y.view(*x.shape[:-1], y.shape[-1])

    module.forward = forward

    def restore() -> None:
        del module.forward  # the class's forward again

    return restore
