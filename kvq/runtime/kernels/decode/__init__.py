"""Decode attention over packed rows: one query block against every cached row.

attention.py          the entry point (`decode_attention`), the chunked torch reference
                      and the general Triton launcher
_attention_triton.py  the general kernel's body
planned.py            the planned kernels for the common layouts (host-side plan)
_splits_triton.py     their bodies: split-K programs, code planes, RoPE and exceptions
"""
