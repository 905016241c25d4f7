"""How far a reconstruction of log-mel features is from the original, in dB of mel power.

One log10 unit is 10 dB. Only bins within 80 dB of the running maximum of the reference count:
below that the model's input is floored anyway, so errors there cannot reach it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .features_spec import DYNAMIC_RANGE_LOG10


@dataclass(frozen=True)
class FeatureError:
    rms_db: float
    max_db: float
    bins: int  # how many (bin, frame) values were compared


def feature_error_db(reference: np.ndarray, test: np.ndarray, frame_mask: np.ndarray | None = None) -> FeatureError:
    """reference, test: [128, T] log10-mel (raw or floored the same way). frame_mask: [T] bool,
    the frames to count (e.g. speech frames); all frames if None."""
    ref = np.asarray(reference, dtype=np.float64)
    tst = np.asarray(test, dtype=np.float64)
    if ref.shape != tst.shape:
        raise ValueError(f"shape mismatch: reference {ref.shape} vs test {tst.shape}")
    running_max = np.maximum.accumulate(ref.max(axis=0)) if ref.shape[1] else np.zeros(0)
    mask = ref > (running_max - DYNAMIC_RANGE_LOG10)[None, :]
    if frame_mask is not None:
        mask &= np.asarray(frame_mask, dtype=bool)[None, :]
    n = int(mask.sum())
    if n == 0:
        return FeatureError(0.0, 0.0, 0)
    diff_db = 10.0 * np.abs(ref - tst)[mask]
    return FeatureError(float(np.sqrt(np.mean(diff_db**2))), float(diff_db.max()), n)
