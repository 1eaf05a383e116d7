"""Bit packing: exact round trip, layout, validation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.errors import KvqError
from kvq.quant.packing import pack_bits, packed_len, unpack_bits, unpack_float, unpack_lookup

BITS = (1, 2, 3, 4, 5, 6, 8)


@pytest.mark.parametrize("bits", BITS)
@settings(max_examples=40, deadline=None)
@given(
    lead=st.lists(st.integers(0, 3), min_size=0, max_size=3),
    n=st.integers(0, 37),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip(bits, lead, n, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (*lead, n), generator=gen, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*lead, packed_len(n, bits))
    assert torch.equal(unpack_bits(packed, bits, n), codes)


@pytest.mark.parametrize("bits", BITS)
@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 37), rows=st.integers(0, 3), seed=st.integers(0, 2**31 - 1))
def test_unpack_lookup_is_table_of_codes(bits, n, rows, seed):
    """The per-byte gather returns exactly table[codes], for whole and partial bytes."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, 2, n), generator=gen, dtype=torch.uint8)
    table = torch.randn(2**bits, generator=gen)
    out = unpack_lookup(pack_bits(codes, bits), table, bits, n)
    assert torch.equal(out, table[codes.long()])


def test_unpack_lookup_rejects_a_wrong_table():
    with pytest.raises(KvqError, match="table of 16"):
        unpack_lookup(torch.zeros(2, dtype=torch.uint8), torch.zeros(8), 4, 4)


def test_packed_len():
    assert [packed_len(9, b) for b in BITS] == [2, 3, 6, 5, 10, 9, 9]
    assert packed_len(0, 3) == 0
    with pytest.raises(KvqError):
        packed_len(4, 7)


def test_layout_little_endian():
    assert pack_bits(torch.tensor([1, 2], dtype=torch.uint8), 4).tolist() == [0x21]
    assert pack_bits(torch.tensor([1, 2, 3], dtype=torch.uint8), 2).tolist() == [0b111001]
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=torch.uint8)
    word = sum(c << (3 * i) for i, c in enumerate(codes.tolist()))
    expected = [word & 0xFF, (word >> 8) & 0xFF, word >> 16]
    assert pack_bits(codes, 3).tolist() == expected


@pytest.mark.parametrize("bits", (2, 3, 4))
def test_out_of_range_code_rejected(bits):
    with pytest.raises(KvqError, match="does not fit"):
        pack_bits(torch.tensor([0, 2**bits], dtype=torch.uint8), bits)


def test_bad_inputs_rejected():
    with pytest.raises(KvqError):
        pack_bits(torch.tensor([1, 2], dtype=torch.int8), 4)
    with pytest.raises(KvqError):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 7)
    with pytest.raises(KvqError):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 4, 8)  # needs 4 bytes


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", (0, 5, 16))
def test_unpack_float_equals_codes_as_floats(bits, n):
    """Into a fresh buffer or a strided view of a wider one, the same values."""
    gen = torch.Generator().manual_seed(bits * 100 + n)
    codes = torch.randint(0, 2**bits, (2, 3, n), generator=gen, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert torch.equal(unpack_float(packed, bits, n), codes.float())
    wide = torch.full((2, 5, n), -1.0)
    unpack_float(packed, bits, n, out=wide[:, 1:4])
    assert torch.equal(wide[:, 1:4], codes.float()) and (wide[:, 0] == -1).all()
