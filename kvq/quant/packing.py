"""Bit packing of unsigned codes along the last dimension, exact round trip.

Bit order is little-endian within a byte: the first code of a unit sits in the
lowest bits. Units: 8 bits -> 1 code per byte, 4 bits -> 2 codes per byte,
2 bits -> 4 codes per byte, 1 bit -> 8 codes per byte, 3 bits -> 8 codes per 3
bytes, 5 bits -> 8 codes per 5 bytes and 6 bits -> 4 codes per 3 bytes (one 24- or
40-bit little-endian word). The last dimension is zero-padded to whole units.
Signed codes must be offset to unsigned by the caller before packing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.tensor_memo import Memo, memoised

# bits -> (codes per unit, bytes per unit)
_UNITS = {8: (1, 1), 4: (2, 1), 2: (4, 1), 1: (8, 1), 3: (8, 3), 5: (8, 5), 6: (4, 3)}


def _unit(bits: int) -> tuple[int, int]:
    if bits not in _UNITS:
        raise KvqError(f"cannot pack {bits}-bit codes; supported: {sorted(_UNITS)}")
    return _UNITS[bits]


def packed_len(n: int, bits: int) -> int:
    """Bytes that `n` codes of `bits` bits occupy after padding to whole units."""
    codes, nbytes = _unit(bits)
    if n < 0:
        raise KvqError(f"code count must be >= 0, got {n}")
    return -(-n // codes) * nbytes


def _word(nbytes: int) -> torch.dtype:
    return torch.int32 if nbytes <= 3 else torch.int64


def _shifts(bits: int, count: int, device: torch.device) -> Tensor:
    return torch.arange(count, device=device, dtype=torch.int32) * bits


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes [..., N] (each < 2^bits) -> packed uint8 [..., packed_len(N, bits)]."""
    per, nbytes = _unit(bits)
    if codes.dtype != torch.uint8:
        raise KvqError(f"packed codes must be uint8, got {codes.dtype}")
    if codes.dim() == 0:
        raise KvqError("cannot pack a scalar; codes need a last dimension")
    # 8-bit codes always fit (and 2**8 does not fit a uint8 comparison).
    if bits < 8 and codes.numel() and int(codes.max()) >= 2**bits:
        raise KvqError(f"a code does not fit in {bits} bits (max {2**bits - 1})")
    if bits == 8:
        return codes.clone()
    lead, n = codes.shape[:-1], codes.shape[-1]
    units = -(-n // per)
    padded = codes if units * per == n else torch.nn.functional.pad(codes, (0, units * per - n))
    if nbytes == 1:
        # 1, 2 and 4 bits: OR the code slots of each byte as uint8, no wider word; ~8x
        # faster than the word path on CPU (a decode step packs every appended row)
        slots = padded.reshape(*lead, units, per)
        out = slots[..., 0] | (slots[..., 1] << bits)  # [..., U], a fresh tensor
        for i in range(2, per):
            out |= slots[..., i] << (bits * i)
        return out
    # the word holds a whole unit (24 bits in int32, 5-bit codes' 40 in int64)
    grouped = padded.reshape(*lead, units, per).to(_word(nbytes))  # [..., U, per]
    word = (grouped << _shifts(bits, per, codes.device)).sum(-1)  # [..., U]
    byte_shifts = _shifts(8, nbytes, codes.device)
    out = (word.unsqueeze(-1) >> byte_shifts) & 0xFF  # [..., U, nbytes]
    return out.to(torch.uint8).reshape(*lead, units * nbytes)


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """packed uint8 [..., packed_len(n, bits)] -> uint8 codes [..., n]."""
    per, nbytes = _unit(bits)
    if packed.dtype != torch.uint8:
        raise KvqError(f"packed codes must be uint8, got {packed.dtype}")
    if packed.dim() == 0 or packed.shape[-1] != packed_len(n, bits):
        found = "a scalar" if packed.dim() == 0 else packed.shape[-1]
        raise KvqError(f"{n} {bits}-bit codes pack into {packed_len(n, bits)} bytes, got {found}")
    if bits == 8:
        return packed.clone()
    if nbytes == 1:
        # 2 and 4 bits: shift whole uint8 bytes, one plane per code slot, then interleave;
        # several times faster than widening every byte to int32
        mask = 2**bits - 1
        planes = [(packed >> (bits * i)) & mask for i in range(per)]
        codes = torch.stack(planes, dim=-1).flatten(-2)  # [..., bytes * per]
        return codes[..., :n] if codes.shape[-1] != n else codes
    lead, units = packed.shape[:-1], packed.shape[-1] // nbytes
    grouped = packed.reshape(*lead, units, nbytes).to(_word(nbytes))  # [..., U, nbytes]
    word = (grouped << _shifts(8, nbytes, packed.device)).sum(-1)  # [..., U]
    codes = (word.unsqueeze(-1) >> _shifts(bits, per, packed.device)) & (2**bits - 1)
    return codes.to(torch.uint8).reshape(*lead, units * per)[..., :n].contiguous()


def unpack_float(packed: Tensor, bits: int, n: int, out: Tensor | None = None) -> Tensor:
    """unpack_bits(packed, bits, n) as float32 [..., n], into `out` when given.

    4 bits write each code slot's plane straight into the float buffer (interleaved by
    stride): no uint8 code tensor to convert, 1.5-1.8x faster on CPU at 512-2048 rows;
    other widths measured no faster that way and unpack, then convert."""
    per, nbytes = _unit(bits)
    if bits != 4 or packed.shape[-1] * per != n:
        codes = unpack_bits(packed, bits, n)
        return codes.float() if out is None else out.copy_(codes)
    if packed.dtype != torch.uint8:
        raise KvqError(f"packed codes must be uint8, got {packed.dtype}")
    if out is None:
        out = torch.empty(*packed.shape[:-1], n, dtype=torch.float32, device=packed.device)
    slots = out.unflatten(-1, (-1, 2))  # [..., bytes, 2]: low nibble, high nibble
    slots[..., 0] = packed & 0xF
    slots[..., 1] = packed >> 4
    return out


def unpack_lookup(packed: Tensor, table: Tensor, bits: int, n: int) -> Tensor:
    """table[unpack_bits(packed, bits, n)], exactly: packed uint8 [..., packed_len(n, bits)]
    and a table of 2^bits values -> [..., n] in the table's dtype.

    For 2, 4 and 8 bits (n a whole number of bytes) one gather per BYTE through a
    [256, codes per byte] table of every byte's decoded codes: half (4 bits) or a quarter
    (2 bits) of the gathers, and no unpacked uint8 or int64 index tensor in between.
    """
    if table.dim() != 1 or table.numel() != 2**bits:
        raise KvqError(f"a {bits}-bit lookup needs a table of {2**bits} values")
    per, nbytes = _unit(bits)
    # 3 bits, a part-filled last byte, or a table being tuned (`kvq calibrate tune`: the
    # byte table's word gather carries no gradient): one gather per code, the same values
    if nbytes != 1 or n % per or table.requires_grad:
        codes = unpack_bits(packed, bits, n)
        return torch.index_select(table, 0, codes.reshape(-1).int()).view(codes.shape)
    if packed.dtype != torch.uint8 or packed.shape[-1] != n // per:
        raise KvqError(f"{n} {bits}-bit codes pack into {n // per} uint8 bytes")
    index = packed.reshape(-1).int()  # int32 indices: index_select's fastest
    # built once per table: a layer's codebook is read by every decode step
    per_byte = memoised(_BYTE_TABLES, table, lambda: byte_table(table, bits))
    return gather_rows(per_byte, index).view(*packed.shape[:-1], n)


_BYTE_TABLES: Memo = {}  # table -> its `byte_table`


def gather_rows(rows: Tensor, index: Tensor) -> Tensor:
    """rows[index]: [R, K] float32 rows, [N] int32 indices -> [N, K]. A row of two floats
    is gathered as one int64 word: a 1-D index_select is several times faster on CPU than
    a 2-D one, and copying the bits keeps every value exact."""
    if rows.dtype == torch.float32 and rows.shape[1] == 2:
        words = rows.contiguous().view(torch.int64).view(-1)  # [R]
        return torch.index_select(words, 0, index).view(torch.float32).view(-1, 2)
    if rows.shape[1] == 1:
        return torch.index_select(rows.reshape(-1), 0, index)[:, None]
    return torch.index_select(rows, 0, index)


def byte_table(table: Tensor, bits: int) -> Tensor:
    """[256, codes per byte]: row v holds table[code] of each code packed in byte v, lowest
    bits first (2, 4 or 8 bits)."""
    per, nbytes = _unit(bits)
    if nbytes != 1:
        raise KvqError(f"{bits}-bit codes do not sit whole in a byte")
    byte = torch.arange(256, device=table.device)[:, None]  # [256, 1]
    return table[(byte >> _shifts(bits, per, table.device)) & (2**bits - 1)]
