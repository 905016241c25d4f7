"""The integrity check of a `Features` payload on the wire: CRC32C (`Features.payload_crc32c`).

The codec's payload has no redundancy to spare (every bit is entropy-coded), so a flipped bit can
decode into other, valid-looking features. The edge sends the CRC32C of each payload beside it and
the server compares when it parses the message, before any decoding (`shared/wire.py`): a mismatch
is INVALID_ARGUMENT.

CRC32C (Castagnoli) rather than zlib's CRC-32: the same cost with hardware support (SSE4.2, ARMv8),
a larger Hamming distance at packet sizes, and it is what SCTP, iSCSI and Google Cloud Storage use,
so clients in other languages have it at hand. Either detects every error burst up to 32 bits,
so every single-bit flip. `google-crc32c` (C, with a pure-Python fallback) is already in every edge
install (aiortc needs it) and is listed in the `edge` extra in its own right.
"""

from __future__ import annotations

import google_crc32c


def payload_crc32c(payload: bytes) -> int:
    """CRC32C of `payload` as an unsigned 32-bit int (check value: b"123456789" -> 0xE3069283)."""
    return google_crc32c.value(bytes(payload))


__all__ = ["payload_crc32c"]
