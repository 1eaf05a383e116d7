"""Diagonal Fisher information of the LM loss at the pre-RoPE keys and the values.

KVQuant weights its codebook fit (sensitivity-weighted k-means / NUQ) by how much
each activation element matters to the loss. The diagonal Fisher approximates
that: for every layer, KV head and channel, the squared gradient of the mean
next-token cross-entropy at the K / V site outputs, summed over calibration
tokens. The sites are exactly the adapter's (k_norm output when the model has
one, else k_proj; v_proj), so the Fisher lines up element for element with the
activations the calibrators capture.

Gradients are caught by forward hooks that call `output.register_hook(...)` on
the unmodified transformers model, so no modeling file is forked. The result
depends only on the model and the calibration windows, not on the bit width, so
`fisher_cached` stores it once per (weights, windows, exclude_first).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from kvq.errors import IncompatibleArtifact, KvqError
from kvq.models.loading import cache_root
from kvq.models.placement import input_device
from kvq.progress import Progress

FORMAT = "kvq.fisher/1"
_NAMES = ("fisher.key", "fisher.value")


@dataclass(frozen=True)
class FisherInfo:
    """Fisher diagonals of one model on one set of calibration windows."""

    key: Tensor  # [L, H_kv, D] float32, sum over tokens of (dLoss/dK_pre_rope)^2
    value: Tensor  # [L, H_kv, D] float32, sum over tokens of (dLoss/dV)^2
    tokens: int  # token positions summed over (sink positions excluded)
    windows_sha256: str
    weights_sha256: str

    def to_tensors(self) -> dict[str, Tensor]:
        """{"fisher.key": [L, H_kv, D], "fisher.value": [L, H_kv, D]}, contiguous float32."""
        return {
            "fisher.key": self.key.float().contiguous(),
            "fisher.value": self.value.float().contiguous(),
        }

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, Tensor], *, tokens: int, windows_sha256: str, weights_sha256: str
    ) -> FisherInfo:
        """Inverse of `to_tensors`; IncompatibleArtifact if a tensor is missing or misshapen."""
        for name in _NAMES:
            if name not in tensors:
                raise IncompatibleArtifact("tensors", list(_NAMES), sorted(tensors))
        key, value = tensors["fisher.key"], tensors["fisher.value"]
        if key.dim() != 3 or key.shape != value.shape:
            raise IncompatibleArtifact(
                "fisher.value.shape", tuple(key.shape), tuple(value.shape), "expected [L, H_kv, D]"
            )
        return cls(key.float(), value.float(), int(tokens), windows_sha256, weights_sha256)


@contextmanager
def _frozen_for_grad(model) -> Iterator[None]:
    """Eval mode, parameters without requires_grad, grad mode on; all restored on exit.

    Freezing the parameters means backward computes activation gradients only: no
    weight .grad is written (nothing leaks into the caller's model) and the
    weight-gradient matmuls, including the vocab-wide LM head one, are skipped.
    """
    was_training = model.training
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        model.train(False)  # dropout off: the Fisher of the deterministic model
        for p, _ in flags:
            p.requires_grad_(False)
        with torch.enable_grad():  # the caller may be inside no_grad / inference code
            yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        model.train(was_training)


@contextmanager
def _grad_hooks(adapter, key_sum: Tensor, value_sum: Tensor, exclude_first: int):
    """Accumulate squared site-output gradients into key_sum / value_sum ([L, H_kv, D]).

    A forward hook on each site module registers a tensor hook on its output;
    autograd calls it once with the full gradient of that output during backward.
    """
    handles = []

    def make_hook(layer: int, acc: Tensor, to_heads):
        def on_grad(grad: Tensor) -> None:
            # contiguous(): to_heads may .view() and a gradient can have odd strides.
            g = to_heads(grad.contiguous()).float()  # [B, H_kv, T, D]
            g = g[:, :, exclude_first:]  # sinks stay full precision at runtime: not fitted
            # a dispatched model's layers may sit on other devices than the sums
            acc[layer] += g.square().sum(dim=(0, 2)).to(acc.device)

        def forward_hook(_module, _inputs, output: Tensor) -> None:
            if output.requires_grad:
                output.register_hook(on_grad)

        return forward_hook

    try:
        for layer in range(adapter.info.num_layers):
            for site, acc in (
                (adapter.key_pre_rope_site, key_sum),
                (adapter.value_site, value_sum),
            ):
                module, to_heads = site(layer)
                handles.append(module.register_forward_hook(make_hook(layer, acc, to_heads)))
        yield
    finally:
        for h in handles:
            h.remove()


def window_loss(model, ids: Tensor) -> Tensor:
    """Mean next-token cross-entropy of one window ids [B, T], differentiable in activations.

    The model's own embedding module is called (Gemma 3 scales inside it) and its output
    is made a grad-requiring leaf, so gradients flow through the activations even though
    every parameter is frozen.
    """
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)  # [B, T, hidden]
    # Logits only for the T-1 positions that predict a token: slicing [B, T, V] logits
    # afterwards would cost a vocab-wide zero fill and copy in backward (262k wide on Gemma 3).
    predicting = torch.arange(ids.shape[1] - 1, device=ids.device)
    out = model(inputs_embeds=embeds, use_cache=False, logits_to_keep=predicting)
    logits = out.logits  # [B, T-1, V]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def collect_fisher(
    model, adapter, windows: Tensor, progress: Progress | None = None, *, exclude_first: int = 0
) -> tuple[Tensor, Tensor]:
    """Fisher diagonals (key, value), each [L, H_kv, D] float32 on CPU, from windows [N, T].

    One window per forward/backward, so memory is bounded by one window. Positions
    < exclude_first (sink tokens, kept in full precision at runtime) still take part
    in the loss but add nothing to the sums.
    """
    info = adapter.info
    n, seqlen = windows.shape
    if exclude_first < 0:
        raise KvqError(f"exclude_first must be >= 0, got {exclude_first}")
    if seqlen < 2 or seqlen <= exclude_first:
        raise KvqError(
            f"windows of {seqlen} tokens leave no Fisher tokens after {exclude_first} sink tokens"
        )
    progress = progress or Progress()
    device = input_device(model)
    shape = (info.num_layers, info.num_kv_heads, info.head_dim)
    key_sum = torch.zeros(shape, dtype=torch.float32, device=device)
    value_sum = torch.zeros(shape, dtype=torch.float32, device=device)
    with (
        progress.stage("fisher", total=n) as bar,
        _frozen_for_grad(model),
        _grad_hooks(adapter, key_sum, value_sum, exclude_first),
    ):
        for i in range(n):
            window_loss(model, windows[i : i + 1].to(device)).backward()
            bar.advance()
    return key_sum.cpu(), value_sum.cpu()


def fisher_path(
    weights_sha256: str, windows_sha256: str, exclude_first: int, cache_dir: Path | None = None
) -> Path:
    """<cache>/fisher/{weights[:16]}-{windows[:16]}-x{exclude_first}.safetensors.

    <cache> is `cache_dir` when given, else $KVQ_CACHE (default ~/.cache/kvq).
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    name = f"{weights_sha256[:16]}-{windows_sha256[:16]}-x{exclude_first}.safetensors"
    return root / "fisher" / name


def _expected_metadata(
    windows_sha256: str, weights_sha256: str, exclude_first: int
) -> dict[str, str]:
    return {
        "format": FORMAT,
        "windows_sha256": windows_sha256,
        "weights_sha256": weights_sha256,
        "exclude_first": str(exclude_first),
    }


def _read_cached(path: Path, expected: dict[str, str], shape: tuple[int, ...]) -> FisherInfo | None:
    """The cached FisherInfo, or None if absent, unreadable or for other inputs."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        # The file name holds only 16-hex prefixes; the full shas decide.
        if any(meta.get(k) != v for k, v in expected.items()):
            return None
        tensors = load_file(str(path))
        info = FisherInfo.from_tensors(
            tensors,
            tokens=int(meta["tokens"]),
            windows_sha256=meta["windows_sha256"],
            weights_sha256=meta["weights_sha256"],
        )
    except (SafetensorError, OSError, KeyError, ValueError, IncompatibleArtifact):
        return None  # a torn or foreign file is recomputed, not trusted
    return info if tuple(info.key.shape) == shape else None


def _write_atomic(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """Write to a temp file next to `path`, then os.replace: readers never see a torn file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a cache file is as readable as any other
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fisher_cached(
    model,
    adapter,
    windows_ids: Tensor,
    windows_sha256: str,
    weights_sha256: str,
    progress: Progress | None = None,
    *,
    exclude_first: int = 0,
    cache_dir: Path | None = None,
) -> FisherInfo:
    """FisherInfo for windows_ids [N, T], loaded from the cache or computed and stored.

    The cache key is (weights, windows, exclude_first); a file whose metadata does not
    match all three (or whose shape does not match the model) is recomputed and replaced.
    Writing the cache is best effort: an unwritable cache only warns.
    """
    info = adapter.info
    shape = (info.num_layers, info.num_kv_heads, info.head_dim)
    expected = _expected_metadata(windows_sha256, weights_sha256, exclude_first)
    path = fisher_path(weights_sha256, windows_sha256, exclude_first, cache_dir)
    cached = _read_cached(path, expected, shape)
    if cached is not None:
        return cached
    key, value = collect_fisher(model, adapter, windows_ids, progress, exclude_first=exclude_first)
    n, seqlen = windows_ids.shape
    result = FisherInfo(key, value, n * (seqlen - exclude_first), windows_sha256, weights_sha256)
    try:
        _write_atomic(path, result.to_tensors(), {**expected, "tokens": str(result.tokens)})
    except OSError as e:
        # The result is valid; losing minutes of work over an unwritable cache would be worse.
        warnings.warn(f"cannot write the Fisher cache {path} ({e.strerror})", stacklevel=2)
    return result
