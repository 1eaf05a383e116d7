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
from dataclasses import dataclass, field

from kvq.errors import KvqError

# Hopper (sm_90) limits per streaming multiprocessor
SM_REGISTERS = 65536
SM_SHARED_BYTES = 228 * 1024  # of which 1 KB per resident program is reserved
SM_WARPS = 64
SM_PROGRAMS = 32
REGISTER_UNIT = 256  # registers are allocated per warp in units of 256
TENSOR_CORE_OPS = ("HMMA", "HGMMA", "IMMA", "IGMMA", "QGMMA")
INT_TO_FLOAT_OPS = ("I2F", "I2FP")
ASYNC_COPY_OPS = ("LDGSTS", "UTMALDG", "UBLKCP")
PREFETCH_OP = "CCTL.PF"  # CCTL.E.PF1 / PF2: a prefetch into L1 / L2 (`loops` names it so)


@dataclass(frozen=True)
class KernelResources:
    """What one compiled launch configuration costs on an SM."""

    num_warps: int
    registers: int  # per thread
    stack_bytes: int  # local memory per thread: register spills
    shared_bytes: int  # dynamic shared memory per program
    sass: Counter  # opcode -> number of instructions in the cubin
    # opcode -> count in the main loop's body (`main_loop`): what one iteration issues per
    # warp; empty when the kernel has no loop
    loop: Counter = field(default_factory=Counter)
    # every loop's body (`loops`), in address order: a kernel with one loop per segment
    loops: tuple = ()
    # the largest loop inside the main loop's range (`inner_loop`): a data-dependent pass
    # that one iteration of the main loop runs as often as its data says; empty if none
    inner: Counter = field(default_factory=Counter)

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

    @property
    def loop_instructions(self) -> int:
        """Instructions one warp issues per iteration of the main loop (static count)."""
        return sum(self.loop.values())

    @property
    def loop_int_to_float(self) -> int:
        """Integer-to-float conversions in the loop (I2F, I2FP): a quarter-rate pipe on
        sm_90, the cost the exponent-bias decode avoids (article 0x09D)."""
        return sum(n for op, n in self.loop.items() if op in INT_TO_FLOAT_OPS)

    @property
    def loop_tensor_core_ops(self) -> int:
        return sum(self.loop[op] for op in TENSOR_CORE_OPS)

    @property
    def loop_async_copies(self) -> int:
        """Global-to-shared copies issued in the loop (cp.async, TMA): the pipeliner staged
        the loads."""
        return sum(self.loop[op] for op in ASYNC_COPY_OPS)

    @property
    def loop_prefetches(self) -> int:
        """Prefetches into the caches issued in the loop (prefetch.global.L2): the loop asks
        for a later tile's rows while it decodes this one."""
        return self.loop[PREFETCH_OP]

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
            "loop_instructions": self.loop_instructions,
            "loop_int_to_float": self.loop_int_to_float,
            "loop_tensor_core_ops": self.loop_tensor_core_ops,
            "loop_async_copies": self.loop_async_copies,
            "loop_prefetches": self.loop_prefetches,
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
        loop=main_loop(sass),
        loops=tuple(loops(sass)),
        inner=inner_loop(sass),
    )


def runtime_arguments(fn, kwargs: dict, *, arch: int = 90) -> int:
    """How many arguments a launch of `fn` with these keyword arguments (every parameter
    by name) passes to the GPU at run time: the parameters Triton's binder does not bind
    as constexprs (annotated ones, None, integers equal to 1), as `JITFunction.run`
    binds them for sm_`arch`."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    _, specialization, _ = binder(**kwargs)
    return sum(1 for kind, *_ in specialization if kind != "constexpr")


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


_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(.*)$")
_BRANCH_TARGET = re.compile(r"^\S*\s+(?:`\()?(?:0x)?([0-9a-f]+)")


def main_loop(sass: str) -> Counter:
    """Opcode -> count over the body of the kernel's main loop: of the ranges [target,
    branch] closed by a backward branch, the one holding the most tensor-core
    instructions (the attention tile loop), the longest on a tie. Each instruction of the
    range counts once, as one iteration issues it; an inner loop's body counts once too."""
    return _main(_bodies(sass))[1]


def inner_loop(sass: str) -> Counter:
    """Opcode -> count over the largest loop whose range lies inside the main loop's
    (`main_loop`), as it counts there: empty when the main loop holds none."""
    bodies = _bodies(sass)
    (lo, hi), _ = _main(bodies)
    inside = [body for (a, b), body in bodies if lo <= a and b <= hi and (a, b) != (lo, hi)]
    return max(inside, key=lambda body: sum(body.values()), default=Counter())


def loops(sass: str) -> list[Counter]:
    """Opcode -> count over each range [target, branch] closed by a backward branch, in
    address order (an inner loop's range is listed too, and counted in its outer one).
    Cache prefetches (CCTL with a .PF modifier) count as PREFETCH_OP."""
    return [body for _, body in _bodies(sass)]


def _main(bodies: list) -> tuple:
    """((lo, hi), body) of the main loop among `_bodies`: ((0, -1), empty) if none."""
    best = ((0, -1), Counter())
    best_key = (-1, -1)
    for rng, body in bodies:
        key = (sum(body[op] for op in TENSOR_CORE_OPS), sum(body.values()))
        if key > best_key:
            best, best_key = (rng, body), key
    return best


def _bodies(sass: str) -> list[tuple]:
    """((lo, hi), opcode -> count) of each loop range, in address order (`loops`)."""
    listing = []  # (address, opcode, operands)
    for line in sass.splitlines():
        m = _LINE.match(line)
        if m:
            op = m.group(2)
            if op == "CCTL" and ".PF" in m.group(3).split(None, 1)[0]:
                op = PREFETCH_OP
            listing.append((int(m.group(1), 16), op, m.group(3)))
    ranges = []
    for addr, op, rest in listing:
        if op != "BRA":
            continue
        target = _BRANCH_TARGET.match(rest)
        if target and int(target.group(1), 16) < addr:
            ranges.append((int(target.group(1), 16), addr))
    return [
        ((lo, hi), Counter(op for a, op, _ in listing if lo <= a <= hi and op != "NOP"))
        for lo, hi in sorted(ranges)
    ]
