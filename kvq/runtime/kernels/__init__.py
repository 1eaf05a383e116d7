"""Triton kernels and their pure-torch references (article 0x02D, 0x03, 0x09C-0x09E).

Each kernel module exposes `<op>_reference(...)` and `<op>_triton(...)` with the
same signature, plus `<op>(..., backend=None)` which dispatches through
`resolve_backend`. Triton is imported lazily, only when a Triton path runs, so
`TRITON_INTERPRET=1` can be set by tests before the first import.

    backend.py     which implementation runs (`resolve_backend`: Triton on CUDA, else torch)
    append/        new rows quantized into the cache's buffers
    decode/        attention over packed rows (general, planned, split-K bodies)
    activations/   A8: INT8 inputs of the decoder's linears
    offline/       compile for sm_90 on a CPU and read registers, spills, instructions
    planning/      how a decode launch is split across programs
"""
