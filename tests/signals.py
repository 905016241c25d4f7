"""Generated test audio: espeak-ng speech, tones, noise, silence. 16 kHz mono float32."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import soundfile as sf

from harken.edge.audio import to_mono_16k

SR = 16_000


@lru_cache(maxsize=32)
def _speech(text: str, voice: str, speed: int) -> np.ndarray:
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise RuntimeError("espeak-ng is not installed: `make test` installs it (make sysdeps)")
    with tempfile.TemporaryDirectory() as d:
        wav = Path(d) / "s.wav"
        subprocess.run([exe, "-v", voice, "-s", str(speed), "-w", str(wav), text], check=True,
                       capture_output=True)
        data, rate = sf.read(str(wav), dtype="float32", always_2d=True)
    return to_mono_16k(data, rate)


def speech(text: str = "The quick brown fox jumps over the lazy dog.", voice: str = "en-us",
           speed: int = 160) -> np.ndarray:
    return _speech(text, voice, speed).copy()


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(round(seconds * SR)), dtype=np.float32)


def tone(freq_hz: float, seconds: float, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(round(seconds * SR))) / SR
    return (amplitude * np.sin(2 * np.pi * freq_hz * t)).astype(np.float32)


def noise(seconds: float, amplitude: float = 0.1, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (amplitude * rng.standard_normal(int(round(seconds * SR)))).astype(np.float32)


def noisy(x: np.ndarray, snr_db: float = 30.0, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = float(np.mean(x.astype(np.float64) ** 2)) or 1e-12
    n = rng.standard_normal(x.size) * np.sqrt(p / 10 ** (snr_db / 10))
    return (x + n).astype(np.float32)


def concat(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate([np.asarray(p, dtype=np.float32) for p in parts])


def write_wav(path: Path, x: np.ndarray, rate: int = SR, subtype: str = "PCM_16", channels: int = 1) -> Path:
    y = np.repeat(x[:, None], channels, axis=1) if channels > 1 else x
    sf.write(str(path), y, rate, subtype=subtype)
    return path
