"""Offline inspection: compile a kernel for sm_90 without a GPU and read its cost (`cubin.py`)."""
