"""Backend choice: `auto | triton | reference`, from an argument or `KVQ_BACKEND`.

`auto` picks Triton for CUDA tensors and the pure-torch reference elsewhere.
An explicit `triton` on CPU tensors is allowed only under Triton's interpreter
(`TRITON_INTERPRET=1`), which is how the kernels are tested on CPU machines.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

from kvq.errors import KvqError

if TYPE_CHECKING:
    import torch

Backend = Literal["triton", "reference"]
CHOICES = ("auto", "triton", "reference")
ENV = "KVQ_BACKEND"


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_choice(name: str) -> str:
    if name not in CHOICES:
        raise KvqError(f"unknown backend {name!r}; choose one of: {', '.join(CHOICES)}")
    return name


def resolve_backend(requested: str | None = None, device: torch.device | str = "cpu") -> Backend:
    """The concrete backend for tensors on `device`.

    requested: "auto", "triton", "reference" or None (read `KVQ_BACKEND`, default auto).
    """
    import torch  # here, not at the top: the CLI checks a choice before importing torch

    name = check_choice(requested or os.environ.get(ENV) or "auto")
    on_cuda = torch.device(device).type == "cuda"
    if name == "reference":
        return "reference"
    if name == "auto":
        return "triton" if on_cuda and triton_available() else "reference"
    if not triton_available():
        raise KvqError("backend 'triton' requested but triton is not installed")
    if not on_cuda and not interpreting():
        raise KvqError(
            "backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 to interpret on CPU)"
        )
    return "triton"


def next_pow2(n: int, at_least: int = 1) -> int:
    """The least power of two >= max(n, at_least), in plain Python: block sizes are picked on
    every launch, where `triton.next_power_of_2` (a constexpr function, about 5 us a call)
    would add up."""
    return max(1 << max(n - 1, 0).bit_length(), at_least)
