"""ONE hook engine for calibration: stream K (pre- or post-RoPE), V and Q per layer.

Forward hooks sit on the modules the adapter names (k_norm or k_proj, v_proj,
q_norm or q_proj, and every decoder linear for its input) of the unmodified
transformers model, so no modeling file is forked. Each window's tensors are handed
to a consumer and dropped, which keeps memory bounded by one window whatever the
number of samples.

Windows served after a declared prefix run after a cache holding its rows
(`kvq.calibrators.prefix_state.run_served`): the hooks never see a prefix position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch
from torch import Tensor

from kvq.models.placement import input_device

Consumer = Callable[[int, str, Tensor], None]  # (layer, "key"|"value"|"query", [B, H, T, D])
InputConsumer = Callable[[str, Tensor], None]  # ("layers.{i}.<linear>", input [B, T, K])


@contextmanager
def capture(
    adapter,
    consumer: Consumer,
    parts: Iterable[str] = ("key", "value"),
    key_stage: str = "pre-rope",
    positions: Tensor | None = None,
):
    """Install hooks feeding `consumer`; removed on exit even after an error.

    With key_stage "post-rope" keys and queries are rotated at `positions` ([T], set
    per window through the yielded state; default 0 .. T-1) with the model's own RoPE
    before delivery.
    """
    handles = []
    state = {"positions": positions}
    sites = {
        "key": adapter.key_pre_rope_site,
        "value": adapter.value_site,
        "query": adapter.query_pre_rope_site,
    }

    def make_hook(layer: int, part: str, to_heads):
        def hook(_module, _inputs, output):
            x = to_heads(output).detach()
            if part in ("key", "query") and key_stage == "post-rope":
                pos = state["positions"]
                if pos is None:
                    pos = torch.arange(x.shape[2], device=x.device)
                cos, sin = adapter.rope_cos_sin(layer, pos)
                x = adapter.apply_rope(x.float(), cos.to(x.device), sin.to(x.device))
            consumer(layer, part, x)

        return hook

    try:
        for layer in range(adapter.info.num_layers):
            for part in parts:
                module, to_heads = sites[part](layer)
                handles.append(module.register_forward_hook(make_hook(layer, part, to_heads)))
        yield state
    finally:
        for h in handles:
            h.remove()


@contextmanager
def capture_linear_inputs(adapter, consumer: InputConsumer):
    """Hooks feeding `consumer` the input of every decoder linear (`decoder_linears`),
    [B, T, K]; removed on exit."""
    handles = []

    def make_hook(name: str):
        def hook(_module, args):
            consumer(name, args[0].detach())

        return hook

    try:
        for name, module in adapter.decoder_linears().items():
            handles.append(module.register_forward_pre_hook(make_hook(name)))
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def run_windows(
    model,
    windows: Tensor,
    on_window: Callable[[int], None] | None = None,
) -> None:
    """Forward each calibration window ([N, L] token ids) through `model`, one at a time.

    Only the decoder body runs: the hooks see every K/V, and skipping the LM head
    (a 262k-wide projection for Gemma 3) saves most of the time.
    """
    body = model.get_decoder() if hasattr(model, "get_decoder") else model
    for i in range(windows.shape[0]):
        body(input_ids=windows[i : i + 1].to(input_device(model)), use_cache=False)
        if on_window is not None:
            on_window(i)
