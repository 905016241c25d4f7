"""edge/audio: any readable file -> 16 kHz mono float32; clear errors otherwise."""

import numpy as np
import pytest
import soundfile as sf

from harken.edge.audio import load_audio, to_mono_16k
from harken.shared.errors import AudioError


def _tone(rate: int, seconds: float, freq: float, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _peak_freq(x: np.ndarray, rate: int = 16_000) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(x.size)))
    return float(np.fft.rfftfreq(x.size, 1 / rate)[np.argmax(spec)])


@pytest.mark.parametrize("rate", [8_000, 16_000, 22_050, 44_100, 48_000])
@pytest.mark.parametrize("subtype", ["PCM_16", "PCM_24", "PCM_32", "FLOAT"])
def test_wav_any_rate_and_width_gives_16k_mono(tmp_path, rate, subtype):
    x = _tone(rate, 1.0, 1000.0)
    path = tmp_path / "in.wav"
    sf.write(str(path), np.stack([x, x], axis=1), rate, subtype=subtype)  # stereo
    y = load_audio(path)
    assert y.dtype == np.float32 and y.ndim == 1
    assert abs(y.size - 16_000) <= 1
    mid = y[2000:-2000]  # away from resampler edge effects
    assert abs(_peak_freq(mid) - 1000.0) < 2.0
    # a sine of amplitude 0.5 keeps its RMS through mixing (both channels equal) and resampling
    assert np.sqrt(np.mean(mid**2)) == pytest.approx(0.5 / np.sqrt(2), rel=2e-3)


@pytest.mark.parametrize("fmt,ext", [("FLAC", "flac"), ("OGG", "ogg")])
def test_flac_and_ogg(tmp_path, fmt, ext):
    x = _tone(44_100, 0.5, 440.0)
    path = tmp_path / f"in.{ext}"
    sf.write(str(path), x, 44_100, format=fmt)
    y = load_audio(path)
    assert abs(y.size - 8_000) <= 1
    assert abs(_peak_freq(y[1000:-1000]) - 440.0) < 3.0


def test_stereo_is_mixed_to_mono():
    left = np.ones(1600, np.float32) * 0.5
    right = -np.ones(1600, np.float32) * 0.25
    y = to_mono_16k(np.stack([left, right], axis=1), 16_000)
    np.testing.assert_allclose(y, 0.125)


def test_int16_array_is_scaled_to_unit_range():
    y = to_mono_16k(np.array([-32768, 0, 16384], dtype=np.int16), 16_000)
    np.testing.assert_allclose(y, [-1.0, 0.0, 0.5])


def test_missing_file(tmp_path):
    with pytest.raises(AudioError, match="no such file"):
        load_audio(tmp_path / "nope.wav")


def test_not_audio(tmp_path):
    p = tmp_path / "text.wav"
    p.write_text("this is not a wav file\n")
    with pytest.raises(AudioError, match="not a readable audio file"):
        load_audio(p)


def test_empty_audio(tmp_path):
    p = tmp_path / "empty.wav"
    sf.write(str(p), np.zeros(0, np.float32), 16_000)
    with pytest.raises(AudioError, match="no audio samples"):
        load_audio(p)


def test_directory(tmp_path):
    with pytest.raises(AudioError, match="directory"):
        load_audio(tmp_path)
