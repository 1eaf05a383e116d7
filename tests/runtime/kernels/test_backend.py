import pytest
import triton

from kvq.errors import KvqError
from kvq.runtime.kernels.backend import next_pow2, resolve_backend


def test_auto_is_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("KVQ_BACKEND", raising=False)
    assert resolve_backend(None, "cpu") == "reference"
    assert resolve_backend("auto", "cpu") == "reference"


def test_env_selects_backend(monkeypatch):
    monkeypatch.setenv("KVQ_BACKEND", "reference")
    assert resolve_backend(None, "cpu") == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KVQ_BACKEND", "triton")
    assert resolve_backend(None, "cpu") == "triton"


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KvqError, match="CUDA"):
        resolve_backend("triton", "cpu")


def test_unknown_backend_is_refused():
    with pytest.raises(KvqError, match="unknown backend 'cuda'"):
        resolve_backend("cuda", "cpu")


def test_next_pow2_matches_triton():
    for n in (1, 2, 3, 15, 16, 17, 100, 128, 129, 4097):
        assert next_pow2(n) == triton.next_power_of_2(n)
    assert next_pow2(3, 16) == 16 and next_pow2(0) == 1
