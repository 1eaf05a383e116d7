"""Appends: new K/V rows quantized into the cache's row buffers.

codes.py            int / NUQ / fp8 rows straight into the buffers (reference, checks,
                    launchers)
_codes_triton.py    their Triton bodies
trellis.py          the Viterbi search of trellis rows (dispatch, torch reference)
_trellis_triton.py  its Triton body
"""
