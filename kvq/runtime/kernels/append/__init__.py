"""Appends: new K/V rows quantized into the cache's row buffers.

codes.py            int / NUQ / fp8 rows straight into the buffers (Triton + reference)
trellis.py          the Viterbi search of trellis rows (dispatch, torch reference)
_trellis_triton.py  its Triton body
"""
