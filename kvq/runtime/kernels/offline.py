"""Compile a Triton kernel for an NVIDIA GPU on a machine without one, and read its cost.

A decode kernel is latency-bound when few warps are resident on a streaming
multiprocessor: each warp waits on its own loads, and nothing else runs in the
meantime. How many fit is fixed at compile time by the registers per thread
(65,536 per SM), the shared memory per program, and the warps per program; a
kernel that needs more than 255 registers spills to local memory. None of that
needs the GPU: Triton lowers the kernel to a cubin with the `ptxas` it ships,
and the `cuobjdump` beside it reads the registers, the spill stack and the
instructions back. So this module lets a CPU-only machine (CI included) check
what a change does to the kernel that the lent GPU will run: resident warps per
SM, spills, and whether the dots became tensor-core instructions.

The launch is bound exactly as `JITFunction.run` binds it (same specialisation
of pointer alignment and integer divisibility, same options), through the
Triton runtime's binder, minus the driver.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass

from kvq.errors import KvqError

# Hopper (sm_90) limits per streaming multiprocessor
SM_REGISTERS = 65536
SM_SHARED_BYTES = 228 * 1024  # of which 1 KB per resident program is reserved
SM_WARPS = 64
SM_PROGRAMS = 32
REGISTER_UNIT = 256  # registers are allocated per warp in units of 256
TENSOR_CORE_OPS = ("HMMA", "HGMMA", "IMMA", "IGMMA", "QGMMA")


@dataclass(frozen=True)
class KernelResources:
    """What one compiled launch configuration costs on an SM."""

    num_warps: int
    registers: int  # per thread
    stack_bytes: int  # local memory per thread: register spills
    shared_bytes: int  # dynamic shared memory per program
    sass: Counter  # opcode -> number of instructions in the cubin

    @property
    def programs_per_sm(self) -> int:
        """Resident programs per SM, the least of the register, shared-memory and warp
        limits."""
        per_warp = -(-self.registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
        by_registers = SM_REGISTERS // (per_warp * self.num_warps)
        by_shared = SM_SHARED_BYTES // (self.shared_bytes + 1024)
        return min(by_registers, by_shared, SM_WARPS // self.num_warps, SM_PROGRAMS)

    @property
    def warps_per_sm(self) -> int:
        return self.programs_per_sm * self.num_warps

    @property
    def tensor_core_ops(self) -> int:
        return sum(self.sass[op] for op in TENSOR_CORE_OPS)

    def as_dict(self) -> dict:
        return {
            "num_warps": self.num_warps,
            "registers": self.registers,
            "stack_bytes": self.stack_bytes,
            "shared_bytes": self.shared_bytes,
            "programs_per_sm": self.programs_per_sm,
            "warps_per_sm": self.warps_per_sm,
            "instructions": sum(self.sass.values()),
            "tensor_core_ops": self.tensor_core_ops,
        }


def compile_offline(
    fn, args: tuple, constexprs: dict, *, options: dict, arch: int = 90
) -> KernelResources:
    """Compile `fn[grid](*args, **constexprs, **options)` for sm_`arch` and read its cost.

    fn: a `triton.jit` function (not an autotuner); options: launch options such as
    num_warps, num_stages, maxnreg. The arguments may live on the CPU: only their dtypes,
    alignment and values are read, as the runtime's binder reads them. Needs a process
    that imported triton without TRITON_INTERPRET=1: under the interpreter even
    triton.language's own functions (tl.sum, tl.max, ...) are interpreter objects.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if not isinstance(fn, JITFunction):
        raise KvqError(
            "compile_offline needs compiled kernels: run it in a process without "
            "TRITON_INTERPRET=1 (triton.jit made interpreter objects here)"
        )
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {**constexprs, **options}
    bound, specialization, opts = binder(*args, **kwargs)
    opts, signature, consts, attrs = fn._pack_args(backend, kwargs, bound, specialization, opts)
    source = triton.compiler.ASTSource(fn, signature, consts, attrs)
    compiled = triton.compile(source, target=target, options=opts.__dict__)
    usage, sass = _inspect_cubin(compiled.asm["cubin"])
    return KernelResources(
        num_warps=compiled.metadata.num_warps,
        registers=usage["REG"],
        stack_bytes=usage["STACK"],
        shared_bytes=compiled.metadata.shared,
        sass=_opcodes(sass),
    )


def _tool(name: str) -> str:
    """A CUDA binary tool that the triton wheel ships (no CUDA toolkit needed)."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.access(path, os.X_OK):
        raise KvqError(f"{name} not found beside triton ({path})")
    return path


def _inspect_cubin(cubin: bytes) -> tuple[dict[str, int], str]:
    """({"REG": ..., "STACK": ...} of the kernel, its SASS listing)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        dump = _tool("cuobjdump")
        usage = subprocess.run(
            [dump, "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [dump, "-sass", path], capture_output=True, text=True, check=True
        ).stdout
    fields = dict(re.findall(r"\b(REG|STACK):(\d+)", usage.split("Function", 1)[-1]))
    if set(fields) != {"REG", "STACK"}:
        raise KvqError(f"cannot read the kernel's resource usage from cuobjdump: {usage!r}")
    return {k: int(v) for k, v in fields.items()}, sass


_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def _opcodes(sass: str) -> Counter:
    """Opcode (without modifiers) -> count, over every instruction of the listing."""
    return Counter(m.group(1) for line in sass.splitlines() if (m := _INSTRUCTION.match(line)))
