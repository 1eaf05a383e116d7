"""Triton kernels and their pure-torch references (article 0x02D, 0x03, 0x09C-0x09E).

Each kernel module exposes `<op>_reference(...)` and `<op>_triton(...)` with the
same signature, plus `<op>(..., backend=None)` which dispatches through
`resolve_backend`. Triton is imported lazily, only when a Triton path runs, so
`TRITON_INTERPRET=1` can be set by tests before the first import.
"""
