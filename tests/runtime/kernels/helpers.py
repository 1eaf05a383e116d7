"""Shared by the decode-kernel and runtime tests: what a call costs the host (the aten ops
it issues under a torch dispatch mode, the kernel launches), the planned kernel's compiled
(CUDA) launch stood in by the interpreter, offline sm_90 compiles in a child process, and
greedy generate on one backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvq.runtime.kernels.decode import planned as planned_decode

ALLOCATING = ("empty", "empty_like", "empty_strided", "zeros", "zeros_like", "new_empty")
SYNCING = ("_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero")
VIEWS = ("view", "reshape", "_unsafe_view", "as_strided", "expand", "slice", "select")
REPO_ROOT = Path(__file__).resolve().parents[3]


# --- host ops and launches ------------------------------------------------------------------


def meta(x):
    """What a launch or an op takes from `x`: a tensor's shape, strides and dtype (its
    contents may change), anything else by value."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.stride(), x.dtype)
    if isinstance(x, list | tuple):
        return tuple(meta(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, meta(v)) for k, v in x.items())
    return x


def _in_triton() -> bool:
    """Whether the Triton interpreter issued the current op (its numpy round trips stand
    in for the kernel running on the device)."""
    frame = sys._getframe(2)
    while frame is not None:
        if "/triton/" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class OpRecorder(TorchDispatchMode):
    """Every aten op the host code issues (views included; not the Triton interpreter's),
    in order: (name, the arguments' `meta`, the keyword arguments' `meta`)."""

    def __init__(self, ops: list | None = None):
        super().__init__()
        self.ops = [] if ops is None else ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _in_triton():
            self.ops.append((func.overloadpacket.__name__, meta(args), meta(kwargs or {})))
        return func(*args, **(kwargs or {}))

    def counts(self) -> Counter:
        """The ops by name."""
        return Counter(name for name, *_ in self.ops)


def record_launches(monkeypatch, stub: bool = False) -> list[str]:
    """The names of the kernels the planned path launches, appended as it launches them;
    with `stub`, the launches themselves are skipped (what a count of the host's own ops
    wants: the interpreter copies arguments with torch ops of its own, a CUDA launch does
    not)."""
    names, launch = [], planned_decode._Launcher.launch

    def recorded(self, fn, *rest):
        names.append(fn.__name__)
        return None if stub else launch(self, fn, *rest)

    monkeypatch.setattr(planned_decode._Launcher, "launch", recorded)
    return names


def assert_two_launches_no_sync(call: Callable[[], object], allocations: int = 3) -> Counter:
    """Runs `call` (a warm decode call) with the kernels stubbed and checks what it costs
    the host: the decode kernel and the reduction launched and nothing else, at most
    `allocations` tensors allocated (partial states, output), no other op but views, and
    never a wait on the device. Returns the ops by name."""
    with pytest.MonkeyPatch.context() as mp, OpRecorder() as mode:
        names = record_launches(mp, stub=True)
        call()
    ops = mode.counts()
    compute = {n: c for n, c in ops.items() if n not in ALLOCATING and n not in VIEWS}
    assert names == ["decode_splits_kernel", "combine_splits_kernel"], names
    assert sum(ops[n] for n in SYNCING) == 0 and not compute, ops
    assert sum(ops[n] for n in ALLOCATING) <= allocations, ops
    return ops


# --- the compiled launch path on this CPU machine -------------------------------------------


class Interpreted:
    """Stands in for a compiled kernel on this CPU machine: runs `fn` through the
    interpreter with the values a compiled kernel's launch takes (every parameter, in
    signature order); resources that fit 2 programs per SM. `on_launch(name, grid,
    values)` sees each launch."""

    def __init__(self, fn, options, on_launch=None):
        self.fn, self.options, self.on_launch = fn, options, on_launch
        self.metadata = SimpleNamespace(num_warps=options.get("num_warps", 4), shared=0)
        self.n_regs = 255

    def __getitem__(self, grid):
        def launch(*values):
            if self.on_launch is not None:
                self.on_launch(self.fn.__name__, grid, values)
            return self.fn[grid[:2]](*values, **self.options)

        return launch


def interpret_compiled_launches(monkeypatch, on_compile=None, on_launch=None):
    """The planned launcher's CUDA path (a compiled kernel per site and specialisation,
    launched with its values in signature order) on this CPU machine: a launcher that
    takes itself for a 2-SM GPU, whose kernels' compiles (`warmup`) return `Interpreted`
    stand-ins. `on_compile(fn, kwargs)` sees each compile's arguments by name."""
    from kvq.runtime.kernels.decode import _splits_triton as kern

    def warmup(fn):
        def compile_(*, grid, **kwargs):
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
            if on_compile is not None:
                on_compile(fn, kwargs)
            return Interpreted(fn, options, on_launch)

        return compile_

    for fn in (kern.decode_splits_kernel, kern.combine_splits_kernel):
        monkeypatch.setattr(fn, "warmup", warmup(fn), raising=False)
    launcher = planned_decode._Launcher(torch.device("cpu"))
    launcher.device, launcher.interpreted, launcher.sms = torch.device("cuda"), False, 2
    monkeypatch.setattr(planned_decode, "_launcher", lambda device: launcher)
    return launcher


# --- offline compiles -----------------------------------------------------------------------


def compile_in_child(script: str, jobs) -> list:
    """Runs the test file `script` as a script (its `__main__` compiles `jobs`, handed over
    as JSON, and prints one JSON list) in a child process: compiling needs a triton
    imported without TRITON_INTERPRET, which this session sets. The child imports `tests.`
    from the repository root."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    run = subprocess.run(
        [sys.executable, script, json.dumps(jobs)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def resources(row: dict):
    """A child's row (`KernelResources.as_dict()` plus its "sass" and "loop" counts) back
    as `KernelResources`."""
    from kvq.runtime.kernels.offline.cubin import KernelResources

    return KernelResources(
        row["num_warps"], row["registers"], row["stack_bytes"], row["shared_bytes"],
        Counter(row["sass"]), Counter(row.get("loop", {})),
    )  # fmt: skip


# --- the public path ------------------------------------------------------------------------


def greedy(monkeypatch, model, policy, tensors, adapter, ids, backend):
    """Tokens of greedy generate (5 new) with a fresh kvq cache on `backend`; token 0 is
    padding, masked out as transformers masks a left-padded batch."""
    from kvq.runtime.cache import build_cache

    monkeypatch.setenv("KVQ_BACKEND", backend)
    cache = build_cache(model, policy, tensors, adapter)
    return model.generate(ids, attention_mask=(ids != 0).long(), cache=cache, max_new_tokens=5,
                          do_sample=False, pad_token_id=0)  # fmt: skip


def calibrated_vq(options, device="cpu", **config):
    """A tiny Gemma 3 (`config`: its overrides) and a mixed-precision vq (or, for trellis
    options, trellis) policy calibrated on it (random windows; a Fisher stand-in with one
    sensitive key side, so the allocator moves bits to it): model, adapter, policy,
    tensors (model and tensors on `device`), and the generator drawn from."""
    from kvq.calibrators.trellis import calibrate_trellis
    from kvq.calibrators.vq import calibrate_vq
    from kvq.models.adapters import get_adapter
    from kvq.progress import Progress
    from tests.conftest import make_tiny_model

    model = make_tiny_model("gemma3", **config)
    ad = get_adapter(model)
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(3, 200, (4, 40), generator=g)
    shape = (ad.info.num_layers, ad.info.num_kv_heads, ad.info.head_dim)
    fk, fv = torch.rand(shape, generator=g) ** 4, torch.rand(shape, generator=g) ** 4
    fk[1] *= 1e4
    calibrate = calibrate_trellis if options.NAME == "trellis" else calibrate_vq
    policy, tensors = calibrate(model, ad, windows, options, Progress(), (fk, fv))
    tensors = {n: t.to(device) for n, t in tensors.items()}
    return model.to(device), ad, policy, tensors, g
