"""Audio in: any file or microphone -> 16 kHz mono float32 in [-1, 1].

soundfile reads WAV/FLAC/OGG of any width and channel count; soxr resamples (VHQ). No torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..shared.errors import AudioError
from ..shared.features_spec import SAMPLE_RATE


def to_mono_16k(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    """Mix down and resample. samples: [n] or [n, channels], any float/int dtype."""
    x = np.asarray(samples)
    if np.issubdtype(x.dtype, np.integer):
        x = x.astype(np.float32) / float(np.iinfo(x.dtype).max + 1)
    x = x.astype(np.float32, copy=False)
    if x.ndim == 2:
        x = x.mean(axis=1, dtype=np.float32)
    elif x.ndim != 1:
        raise AudioError(f"expected [samples] or [samples, channels] audio, got shape {x.shape}")
    if sample_rate != SAMPLE_RATE and x.size:
        import soxr

        x = soxr.resample(x, sample_rate, SAMPLE_RATE, quality="VHQ").astype(np.float32, copy=False)
    return np.ascontiguousarray(x)


def load_audio(path: str | Path) -> np.ndarray:
    """Read an audio file into 16 kHz mono float32. Raises AudioError with a one-line reason."""
    import soundfile as sf

    p = Path(path)
    if not p.exists():
        raise AudioError(f"{p}: no such file")
    if p.is_dir():
        raise AudioError(f"{p}: is a directory, not an audio file")
    try:
        data, rate = sf.read(str(p), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        raise AudioError(f"{p}: not a readable audio file ({_short(e)})") from e
    if data.shape[0] == 0:
        raise AudioError(f"{p}: holds no audio samples")
    audio = to_mono_16k(data, int(rate))
    if not np.all(np.isfinite(audio)):
        raise AudioError(f"{p}: holds NaN or infinite samples")
    return audio


def peak_normalize(audio: np.ndarray) -> np.ndarray:
    """The official package's rule before its feature extractor: audio whose peak exceeds 1.0 (hot
    float input) is divided by its peak, then everything is clipped to [-1, 1]."""
    peak = float(np.max(np.abs(audio))) if audio.size else 0.0
    if peak > 1.0:
        audio = audio / peak
    return np.clip(audio, -1.0, 1.0).astype(np.float32, copy=False)


MAX_PASS_SECONDS = 1200.0  # the official package's longest single pass (MAX_ASR_INPUT_SECONDS)


def split_at_quiet_points(audio: np.ndarray, max_seconds: float = MAX_PASS_SECONDS,
                          search_seconds: float = 5.0, window_ms: float = 100.0) -> list[tuple[int, int]]:
    """Cut audio longer than `max_seconds` into consecutive [start, end) sample spans, as the
    official package does before transcribing: each cut goes near `max_seconds` after the previous
    one, at the quietest point within +-`search_seconds` (the `window_ms` window of least summed
    |x|, then its quietest sample). The spans cover the audio exactly, without overlap."""
    n = len(audio)
    max_len = int(max_seconds * SAMPLE_RATE)
    if max_len < 1:
        raise ValueError("max_seconds must be positive")
    expand = int(search_seconds * SAMPLE_RATE)
    win = max(4, int(window_ms / 1000 * SAMPLE_RATE))
    spans, start = [], 0
    while n - start > max_len:
        target = start + max_len
        lo, hi = max(start, target - expand), min(n, target + expand)
        cut = target
        if hi - lo > win:
            mag = np.abs(audio[lo:hi]).astype(np.float32)
            sums = np.convolve(mag, np.ones(win, dtype=np.float32), mode="valid")
            w = int(np.argmin(sums))
            cut = lo + w + int(np.argmin(mag[w:w + win]))
        cut = min(max(cut, start + 1), n)
        spans.append((start, cut))
        start = cut
    spans.append((start, n))
    return spans


def microphone_chunks(block_ms: int = 32, device: int | str | None = None) -> Iterator[np.ndarray]:
    """Yield 16 kHz mono float32 blocks from a microphone until the caller stops iterating."""
    try:
        import sounddevice as sd
    except (ImportError, OSError) as e:
        raise AudioError("microphone capture needs the 'mic' extra: pip install 'harken[mic]'") from e
    import queue

    blocks: queue.Queue[np.ndarray] = queue.Queue()
    frames = SAMPLE_RATE * block_ms // 1000
    with sd.InputStream(samplerate=SAMPLE_RATE, channels=1, dtype="float32", blocksize=frames,
                        device=device, callback=lambda data, *_: blocks.put(data[:, 0].copy())):
        while True:
            yield blocks.get()


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
