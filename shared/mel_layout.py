"""The codec's mel layout: which of the 128 mel bins are coded (the basis) and which follow exactly
from them (the dependents: a bin that sees one or two FFT bins each owned by a basis bin), derived
from the Slaney filter bank alone, so encoder and decoder agree by construction (shared/codec.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .features_spec import N_MELS, slaney_mel_filters


@dataclass(frozen=True)
class MelLayout:
    """Which mel bins are coded (basis) and which follow from them (dependents).

    dependent m = log10(ratio_a[m] * 10**x[source_a[m]] + ratio_b[m] * 10**x[source_b[m]]);
    ratio_b = 0 when m sees one FFT bin only."""

    basis: np.ndarray  # [nb] int
    dependent: np.ndarray  # [nd] int
    source_a: np.ndarray  # [nd] int (mel index)
    source_b: np.ndarray  # [nd] int
    ratio_a: np.ndarray  # [nd] float64
    ratio_b: np.ndarray  # [nd] float64
    # [128] how far above its sources a dependent can sit (log10(ratio_a + ratio_b)); values at
    # the floor are sunk this much further so their dependents' predictions stay under it too
    floor_sink: np.ndarray
    # the logs of the ratios, as the TypeScript codec reads them (edge/web/src/codec_tables.json):
    # computed by `math` (the C library), not by numpy, whose SIMD log differs in the last bit between
    # numpy versions and CPUs; -inf where ratio_b = 0
    log_ratio_a: np.ndarray
    log_ratio_b: np.ndarray
    log10_ratio_a: np.ndarray


@lru_cache(maxsize=1)
def mel_layout() -> MelLayout:
    """Derived from the filter bank alone, so encoder and decoder agree by construction."""
    fb = slaney_mel_filters().T  # [128, 201]
    support = [np.flatnonzero(fb[m] > 0) for m in range(N_MELS)]
    owner: dict[int, int] = {}  # FFT bin -> first mel bin that sees only it
    for m, s in enumerate(support):
        if len(s) == 1 and int(s[0]) not in owner:
            owner[int(s[0])] = m
    dep, src_a, src_b, r_a, r_b = [], [], [], [], []
    for m, s in enumerate(support):
        if not 1 <= len(s) <= 2 or any(int(k) not in owner for k in s):
            continue
        if len(s) == 1 and owner[int(s[0])] == m:
            continue
        srcs = [(owner[int(k)], fb[m, k] / fb[owner[int(k)], k]) for k in s]
        if len(srcs) == 1:
            srcs.append((srcs[0][0], 0.0))
        dep.append(m)
        (a, ra), (b, rb) = srcs
        src_a.append(a)
        src_b.append(b)
        r_a.append(ra)
        r_b.append(rb)
    basis = np.array([m for m in range(N_MELS) if m not in set(dep)])
    sink = np.zeros(N_MELS)
    for a, b, ra, rb in zip(src_a, src_b, r_a, r_b):
        sink[[a, b]] = np.maximum(sink[[a, b]], math.log10(float(ra + rb)))
    return MelLayout(basis, np.array(dep, dtype=np.int64), np.array(src_a, dtype=np.int64),
                     np.array(src_b, dtype=np.int64), np.array(r_a), np.array(r_b), sink,
                     np.array([math.log(float(r)) for r in r_a]),
                     np.array([math.log(float(r)) if r > 0 else -math.inf for r in r_b]),
                     np.array([math.log10(float(r)) for r in r_a]))


LN10 = math.log(10.0)


def predict_dependent(frames: np.ndarray, layout: MelLayout) -> np.ndarray:
    """frames: [128, k] (basis rows filled) -> [nd, k] predicted dependent rows."""
    a = frames[layout.source_a] * LN10 + layout.log_ratio_a[:, None]
    b = frames[layout.source_b] * LN10 + layout.log_ratio_b[:, None]
    return np.logaddexp(a, b) / LN10
