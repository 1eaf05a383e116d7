"""Decode attention over packed rows: one query block against every cached row.

segments.py           what attention reads: `Segment`s of packed rows, RoPE tables, checks
reference.py          the pure-torch reference (chunked online softmax, or one dense SDPA)
attention.py          the entry point (`decode_attention`) and the general Triton launcher
_attention_triton.py  the general kernel's body
planned.py            the planned kernels for the common layouts (host-side plan)
_splits_triton.py     their bodies: split-K programs, code planes, RoPE and exceptions
"""
