"""Binary codes: packing sign vectors into bytes, unpacking, Hamming distances, bit balance.

Bit order (the faiss convention, checked against ``faiss.real_to_binary`` in tests/test_codes.py):
bit ``i`` of a code is bit ``i % 8`` of byte ``i // 8``, least-significant bit first within each
byte ("little" bit order). So the sign vector ``[+, -, -, -, -, -, -, -,  +, +, -, ...]`` packs to
bytes ``[0b00000001, 0b00000011, ...] == [1, 3, ...]``. Hamming distances do not depend on the bit
order, but any code that reads individual bits (multi-hash substrings, ``unpack``, bit balance)
does, so everything in ushash uses this one order.

All functions take and return numpy arrays; shapes and dtypes are checked and a ValueError names the
offending argument and the expected shape.
"""

from __future__ import annotations

import numpy as np

MIN_BITS = 8
MAX_BITS = 1024

# Popcount of every byte value: fallback for numpy < 2.0, which lacks np.bitwise_count.
_POPCOUNT8 = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).sum(axis=1).astype(np.uint8)

# Bound on the number of int32 cells of the distance matrix computed per block in `hamming`.
_BLOCK_CELLS = 1 << 22


def check_bits(bits, name: str = "bits") -> int:
    """Return ``bits`` as an int after checking it is a multiple of 8 in [8, 1024]."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise ValueError(f"{name} must be an int, a multiple of 8 in [{MIN_BITS}, {MAX_BITS}]; got {bits!r}")
    bits = int(bits)
    if bits % 8 or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"{name} must be a multiple of 8 in [{MIN_BITS}, {MAX_BITS}]; got {bits}")
    return bits


def check_packed(packed, name: str, nbytes: int | None = None) -> np.ndarray:
    """Check ``packed`` is a uint8 array [N, nbytes] (nbytes = bits // 8); return it C-contiguous."""
    expect = f"uint8 [N, {nbytes if nbytes is not None else 'bits // 8'}]"
    if not isinstance(packed, np.ndarray):
        raise ValueError(f"{name} must be a numpy array {expect}; got {type(packed).__name__}")
    if packed.dtype != np.uint8:
        raise ValueError(f"{name} must be {expect}; got dtype {packed.dtype}")
    if packed.ndim != 2:
        raise ValueError(f"{name} must be {expect}; got shape {packed.shape}")
    if nbytes is not None and packed.shape[1] != nbytes:
        raise ValueError(f"{name} must be {expect}; got shape {packed.shape}")
    if nbytes is None:
        check_bits(packed.shape[1] * 8, f"{name}.shape[1] * 8")
    return np.ascontiguousarray(packed)


def pack(signs) -> np.ndarray:
    """Pack ``signs`` [N, bits] (float, bool or int; bit = value > 0) into uint8 [N, bits // 8].

    ``bits`` must be a multiple of 8 in [8, 1024]. NaN is rejected (it would silently become 0).
    The result is what faiss binary indexes take (see the module docstring for the bit order).
    """
    signs = np.asarray(signs)
    if signs.dtype == np.bool_ and signs.ndim == 2 and not signs.shape[1] % 8 and MIN_BITS <= signs.shape[1] <= MAX_BITS:
        return np.packbits(signs, axis=1, bitorder="little")  # bools of a valid width: nothing to check (a head's path)
    if signs.ndim != 2:
        raise ValueError(f"signs must be [N, bits] with bits a multiple of 8 in [8, 1024]; got shape {signs.shape}")
    if not (signs.dtype == np.bool_ or np.issubdtype(signs.dtype, np.number)) or np.iscomplexobj(signs):
        raise ValueError(f"signs must be a real float, bool or int array [N, bits]; got dtype {signs.dtype}")
    check_bits(signs.shape[1], "signs.shape[1] (bits)")
    if np.issubdtype(signs.dtype, np.floating) and np.isnan(signs).any():
        raise ValueError("signs contains NaN; expected finite values (bit = value > 0)")
    return np.packbits(signs > 0, axis=1, bitorder="little")


def unpack(packed, bits) -> np.ndarray:
    """Unpack uint8 [N, bits // 8] into a uint8 {0, 1} array [N, bits] (inverse of `pack`)."""
    bits = check_bits(bits)
    packed = check_packed(packed, "packed", bits // 8)
    return np.unpackbits(packed, axis=1, bitorder="little")


def words(packed: np.ndarray) -> np.ndarray:
    """View packed codes as uint64 words [N, ceil(nbytes / 8)], zero-padding the last word."""
    n, nbytes = packed.shape
    pad = (-nbytes) % 8
    if pad:
        packed = np.concatenate([packed, np.zeros((n, pad), np.uint8)], axis=1)
    return np.ascontiguousarray(packed).view(np.uint64)


def _popcount(x: np.ndarray) -> np.ndarray:
    """Popcount of a uint64 array, same shape, as uint8."""
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(x)
    return _POPCOUNT8[x.view(np.uint8)].reshape(*x.shape, 8).sum(axis=-1, dtype=np.uint8)


def hamming(a_packed, b_packed) -> np.ndarray:
    """Full Hamming distance matrix int32 [Na, Nb] between packed codes of the same width.

    Popcount of XOR over 64-bit words (np.bitwise_count, or a byte lookup table on numpy < 2),
    computed in row blocks so memory stays bounded. Agrees with faiss binary index distances.
    """
    a = check_packed(a_packed, "a_packed")
    b = check_packed(b_packed, "b_packed", a.shape[1])
    return hamming_words(words(a), words(b))


def hamming_words(wa: np.ndarray, wb: np.ndarray) -> np.ndarray:
    """`hamming` on codes already viewed as uint64 words [N, W] (see `words`); no checks."""
    na, nb = len(wa), len(wb)
    out = np.zeros((na, nb), np.int32)
    if na == 0 or nb == 0:
        return out
    rows = max(1, _BLOCK_CELLS // nb)
    for s in range(0, na, rows):
        blk = out[s : s + rows]
        for w in range(wa.shape[1]):
            blk += _popcount(wa[s : s + rows, w, None] ^ wb[None, :, w])
    return out


def bit_balance(packed, bits) -> np.ndarray:
    """Per-bit mean of ones, float64 [bits] (0.5 everywhere is a perfectly balanced code)."""
    bits = check_bits(bits)
    packed = check_packed(packed, "packed", bits // 8)
    if len(packed) == 0:
        raise ValueError("packed must have at least one row to compute bit balance; got shape (0, ...)")
    return unpack(packed, bits).mean(axis=0, dtype=np.float64)
