"""Zstandard frames through the standard library's API (PEP 784): `compression.zstd` from Python 3.14,
its backport (`backports.zstd`, a 0.5 MB wheel against `zstandard`'s 5.5 MB, which matters where a lent
GPU's carry is counted in MiB) before that. The frames are plain zstd, so files written by either
library (the committed warm-start state and shipped weights were) read with the other."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 14):
    from compression import zstd as _zstd
else:
    from backports import zstd as _zstd

ZstdError = _zstd.ZstdError


def compress(data: bytes, level: int) -> bytes:
    """One frame that records its content size, single-threaded (a training run may own the other cores)."""
    return _zstd.compress(data, level=level)


def decompress(data: bytes) -> bytes:
    """Every frame of `data`, concatenated; ZstdError where it is not zstd."""
    return _zstd.decompress(data)
