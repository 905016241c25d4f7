"""The entropy decoder's bit walk compiled with numba (shared/entropy.py holds the Python walk it
replaces, which stays where numba is missing: the edge needs neither).

`compiled()` (the walk, compiled on first use) decodes the levels of a body class run by class run, exactly as `entropy.decode_symbols`
does tuple by tuple: the same levels, the same bits read, and for a body that is not valid the same
error (as a negative code: `ERRORS`). It takes the code book's tables flattened into arrays
(`entropy.flat_tables`) as arguments and imports nothing of the codec, so there is no import loop.
Measured: 430 -> 74 us per 200-ms packet in the earlier design (docs/benchmarks.md has this tree's).
"""

from __future__ import annotations

import logging

from collections.abc import Callable
from typing import Any

import numpy as np

TRUNCATED, INVALID_CODE, ESCAPE_TOO_LONG = -1, -2, -3
ERRORS = {
    TRUNCATED: "payload truncated: entropy-coded body ends early",
    INVALID_CODE: "corrupt payload: invalid code word",
    ESCAPE_TOO_LONG: "corrupt payload: escape value too long",
}
MAX_CODE_LENGTH = 64  # the canonical tables' rows per class


def _walk(bits, run_cls, run_len, sparse_group, lut_bits, group, escape, lut_symbol, lut_length,
          first_code, first_index, count, order, order_off, digits, digit_off, out):  # pragma: no cover - compiled
    """bits: the body's bits (uint8, MSB first); runs of (class, levels) in coding order; the
    tables (see `entropy.flat_tables`); out: zeros, one slot per level. -> bits read, or an error
    code (< 0)."""
    end = bits.shape[0]
    lut_size = 1 << lut_bits
    pos = 0
    k = 0
    for r in range(run_cls.shape[0]):
        c = run_cls[r]
        n = run_len[r]
        g = group[c]
        if g == sparse_group:
            if pos >= end:
                return TRUNCATED
            flag = bits[pos]
            pos += 1
            if flag:  # an all-zero run
                k += n
                continue
        n_tuples = (n + g - 1) // g
        written = 0
        for _ in range(n_tuples):
            if pos >= end:
                return TRUNCATED
            w = 0
            for i in range(lut_bits):
                w <<= 1
                if pos + i < end:
                    w |= bits[pos + i]
            length = lut_length[c * lut_size + w]
            if length != 0 and pos + length <= end:
                sym = lut_symbol[c * lut_size + w]
                pos += length
            else:  # canonical decoding, one bit at a time
                code = 0
                sym = -1
                for length in range(1, MAX_CODE_LENGTH):
                    if pos >= end:
                        return TRUNCATED
                    code = (code << 1) | bits[pos]
                    pos += 1
                    row = c * MAX_CODE_LENGTH + length
                    off = code - first_code[row]
                    if 0 <= off < count[row]:
                        sym = order[order_off[c] + first_index[row] + off]
                        break
                if sym < 0:
                    return INVALID_CODE
            if sym == escape[c]:
                for _j in range(g):  # signed Exp-Golomb, one per level of the tuple
                    zeros = 0
                    while True:
                        if pos >= end:
                            return TRUNCATED
                        b = bits[pos]
                        pos += 1
                        if b:
                            break
                        zeros += 1
                        if zeros > 40:
                            return ESCAPE_TOO_LONG
                    if pos + zeros > end:
                        return TRUNCATED
                    u = 1
                    for _i in range(zeros):
                        u = (u << 1) | bits[pos]
                        pos += 1
                    u -= 1
                    v = u // 2 if u % 2 == 0 else -(u + 1) // 2
                    if written < n:
                        out[k + written] = v
                        written += 1
            else:
                base = digit_off[c] + sym * g
                for j in range(g):
                    if written < n:
                        out[k + written] = digits[base + j]
                        written += 1
        k += n
    return pos


_compiled: Any = None  # None: not looked for yet; False: no numba; else the compiled walk


def compiled() -> Callable[..., Any] | None:
    """The compiled walk, or None where numba is not installed. numba is imported on the first
    call, not with the codec: the edge, which only encodes, never loads it."""
    global _compiled
    if _compiled is None:
        try:
            import numba
        except ImportError:  # the Python walk decodes
            _compiled = False
        else:
            _compiled = numba.njit(cache=True, nogil=True)(_walk)
    return _compiled or None


def available() -> bool:
    return compiled() is not None


def warm() -> None:
    """Compile (or load from numba's cache) now rather than in the first packet's decode. A numba
    that cannot compile here (no writable cache, an LLVM fault) leaves the Python walk to decode,
    with a warning: a server starts either way."""
    global _compiled
    walk = compiled()
    if walk is None:
        return
    z = np.zeros(1, dtype=np.int64)
    try:
        walk(np.zeros(0, dtype=np.uint8), z[:0], z[:0], 4, 10, z, z, z, z, z, z, z, z, z, z, z, z.copy())
    except Exception as e:  # noqa: BLE001 -- whatever numba raises, the Python walk is exact
        logging.getLogger("harken").warning("the codec's compiled decoder failed to build (%s): decoding in "
                                            "Python", e)
        _compiled = False
