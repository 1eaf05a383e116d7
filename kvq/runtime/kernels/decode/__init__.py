"""Decode attention over packed rows: one query block against every cached row.

segments.py           what attention reads: `Segment`s of packed rows, RoPE tables, checks
reference.py          the pure-torch reference (chunked online softmax, or one dense SDPA)
attention.py          the entry point (`decode_attention`) and the general Triton launcher
_attention_triton.py  the general kernel's body
planned.py            the planned kernels for the common layouts (host-side plan)
_splits_triton.py     their bodies: the split-K programs and the segment loop, built from
_planes_triton.py       code bytes -> fp16 planes (integer, fp8)
_nuq_triton.py          codebook (NUQ) tables, exact entries, the key / value tile decoders
_vq_triton.py           vector-codebook and trellis codes
_rope_triton.py         keys stored before RoPE, rotated in the loop
"""
