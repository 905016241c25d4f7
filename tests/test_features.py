"""edge/features: the ONNX log-mel against Qwen3-ASR's WhisperFeatureExtractor, and streaming-exact.

Tolerances:
- 1e-4 max abs on normalised features vs transformers: both sides round a float32 DFT/FFT; the
  worst bins (a 7 kHz tone's leakage, speech onsets) differ by ~6e-5, typical ones by ~1e-6.
- Streaming vs one call: exact. Frames are rows of one GEMM in the graph, so a frame's arithmetic
  does not depend on how many frames share its call (see edge/models/build_logmel.py).
"""

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from qwen_asr.core.transformers_backend.processing_qwen3_asr import Qwen3ASRProcessorKwargs
from transformers import WhisperFeatureExtractor
from transformers.audio_utils import mel_filter_bank

from harken.edge.features import (
    OFFLINE_PIECE_SAMPLES,
    LogMelOnnx,
    StreamingLogMel,
    frames_final,
    frames_total,
    log_mel,
    log_mel_raw,
)
from harken.edge.models import build_logmel
from harken.shared.errors import AudioError
from harken.shared.features_spec import HOP_LENGTH, N_FFT, N_MELS, normalize, slaney_mel_filters
from signals import concat, noise, silence, speech, tone

TOL_NORMALISED = 1e-4


@pytest.fixture(scope="module")
def model() -> LogMelOnnx:
    return LogMelOnnx()


@pytest.fixture(scope="module")
def reference():
    """Features exactly as the official qwen-asr processor computes them for one audio."""
    extractor = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160,
                                        chunk_length=30, n_fft=400)
    # The processor's defaults, plus the two it forces before calling the extractor.
    kwargs = dict(Qwen3ASRProcessorKwargs._defaults["audio_kwargs"], padding=True, truncation=False)

    def features(audio: np.ndarray) -> np.ndarray:
        out = extractor(audio, return_tensors="np", **kwargs)
        n_frames = int(out["attention_mask"][0].sum())  # the model reads only the masked frames
        return out["input_features"][0][:, :n_frames]

    return features


def _clipped_sine() -> np.ndarray:
    return np.clip(tone(300.0, 1.0, amplitude=3.0), -1.0, 1.0)


SIGNALS = {
    "speech": lambda: speech(),
    "speech_in_silence": lambda: concat(silence(0.4), speech("Hello there."), silence(0.3)),
    "tone_440": lambda: tone(440.0, 1.0),
    "tone_7k_loud": lambda: tone(7000.0, 0.5, amplitude=0.95),
    "white_noise": lambda: noise(1.0),
    "digital_silence": lambda: silence(0.5),
    "clipped_sine": _clipped_sine,
    "quiet_tone": lambda: tone(1000.0, 0.5, amplitude=1e-4),
}


@pytest.mark.parametrize("name", sorted(SIGNALS))
def test_matches_reference(name, model, reference):
    x = SIGNALS[name]()
    want = reference(x)
    got = log_mel(x, model)
    assert got.dtype == np.float32
    assert got.shape == want.shape == (N_MELS, x.size // HOP_LENGTH)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL_NORMALISED)


@pytest.mark.parametrize("n", [201, 202, 360, 399, 400, 401, 560, 1000, 1234])
def test_short_inputs_match_reference(n, model, reference):
    x = noise(0.1, seed=n)[:n]
    want = reference(x)
    got = log_mel(x, model)
    assert got.shape == want.shape == (N_MELS, n // HOP_LENGTH)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL_NORMALISED)


@pytest.mark.parametrize("n", [1, 160, 199, 200])
def test_inputs_the_reference_cannot_pad_raise_audio_error(n, model, reference):
    x = noise(0.1, seed=n)[:n]
    with pytest.raises(RuntimeError, match="[Pp]adding"):  # torch's reflect pad needs n > 200
        reference(x)
    with pytest.raises(AudioError, match="too short"):
        log_mel(x, model)


def test_empty_input_raises_audio_error(model):
    with pytest.raises(AudioError, match="too short"):
        log_mel(np.zeros(0, np.float32), model)


def test_filterbank_matches_transformers():
    want = mel_filter_bank(num_frequency_bins=201, num_mel_filters=128, min_frequency=0,
                           max_frequency=8000, sampling_rate=16000, norm="slaney", mel_scale="slaney")
    np.testing.assert_allclose(slaney_mel_filters(), want, rtol=0, atol=1e-12)


def test_dft_basis_is_a_hann_windowed_rfft():
    frames = np.random.default_rng(0).standard_normal((7, N_FFT))  # [7, 400]
    spec = frames @ build_logmel.dft_basis().T  # [7, 402]
    want = np.fft.rfft(frames * np.hanning(N_FFT + 1)[:-1], axis=1)  # periodic Hann
    np.testing.assert_allclose(spec[:, :201], want.real, atol=1e-10)
    np.testing.assert_allclose(spec[:, 201:], want.imag, atol=1e-10)


def _pieces(x: np.ndarray, sizes) -> list[np.ndarray]:
    cuts = np.cumsum(sizes)
    return np.split(x, cuts[cuts < x.size])


def _stream(model: LogMelOnnx, pieces) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Frames from pushing `pieces` then flushing; with (samples, frames_emitted, buffered)
    recorded after every push."""
    stream = StreamingLogMel(model)
    out, trace, n = [], [], 0
    for piece in pieces:
        frames = stream.push(piece)
        assert frames.shape[0] == N_MELS and frames.dtype == np.float32
        out.append(frames)
        n += piece.size
        trace.append((n, stream.frames_emitted, stream.buffered_samples))
    out.append(stream.flush())
    assert stream.frames_emitted == frames_total(n)
    return np.concatenate(out, axis=1), trace


def _final_count(n: int) -> int:
    # Frame t covers input [160t - 200, 160t + 200), reflected at the start: it needs sample
    # 160t + 199, and frame 0 also needs sample 200 for its left reflection.
    return sum(1 for t in range(n // HOP_LENGTH + 1) if max(HOP_LENGTH * t + 200, 201) <= n)


@pytest.mark.parametrize("seed", range(6))
def test_random_pieces_equal_one_push(seed, model):
    x = concat(silence(0.2), speech("Streaming is exact."), noise(0.3, seed=seed))
    whole = log_mel_raw(x, model)
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 4001, size=x.size // 1000 + 10)
    sizes[rng.random(sizes.size) < 0.3] = rng.integers(0, 3)  # also 0-, 1- and 2-sample pieces
    got, trace = _stream(model, _pieces(x, sizes))
    np.testing.assert_array_equal(got, whole)
    for n, emitted, buffered in trace:
        assert emitted == _final_count(n) == frames_final(n)
        assert buffered < N_FFT


@settings(max_examples=40, deadline=None)
@given(n=st.integers(201, 2400), sizes=st.lists(st.integers(0, 500), min_size=1, max_size=30),
       seed=st.integers(0, 2**16))
def test_any_split_of_a_short_input_equals_one_push(model, n, sizes, seed):
    x = noise(0.2, seed=seed)[:n]
    got, trace = _stream(model, _pieces(x, sizes))
    np.testing.assert_array_equal(got, log_mel_raw(x, model))
    assert [e for _, e, _ in trace] == [_final_count(k) for k, _, _ in trace]


def test_sample_by_sample_emits_each_frame_the_moment_it_is_final(model):
    x = speech("Hi.")[:2000]
    stream = StreamingLogMel(model)
    whole = log_mel_raw(x, model)
    for n in range(1, x.size + 1):
        frames = stream.push(x[n - 1 : n])
        new = _final_count(n) - _final_count(n - 1)
        assert frames.shape == (N_MELS, new)
        if new:  # the frame that just became final is already its whole-input value
            np.testing.assert_array_equal(frames[:, 0], whole[:, stream.frames_emitted - 1])
    assert stream.flush().shape[1] == frames_total(x.size) - _final_count(x.size)


def test_long_input_in_offline_pieces_equals_one_call(model):
    x = concat(speech("Long files go in pieces."), noise(30.0, amplitude=0.01))
    assert x.size > OFFLINE_PIECE_SAMPLES
    whole = model(np.pad(x, N_FFT // 2, mode="reflect"))[:, : frames_total(x.size)]
    np.testing.assert_array_equal(log_mel_raw(x, model), whole)


def test_final_frames_do_not_depend_on_what_follows(model):
    x = speech("Final means final.")
    n = 5_003
    a = log_mel_raw(np.concatenate([x[:n], noise(0.5, seed=1)]), model)
    b = log_mel_raw(np.concatenate([x[:n], silence(0.5)]), model)
    k = frames_final(n)
    np.testing.assert_array_equal(a[:, :k], b[:, :k])
    assert not np.array_equal(a[:, k], b[:, k])  # the next frame does see the continuation


def test_stream_rejects_use_after_flush_and_bad_shapes(model):
    stream = StreamingLogMel(model)
    with pytest.raises(AudioError, match="shape"):
        stream.push(np.zeros((2, 100), np.float32))
    with pytest.raises(AudioError, match="NaN"):
        stream.push(np.array([0.0, np.nan], np.float32))
    with pytest.raises(AudioError, match="int16"):
        stream.push(np.zeros(100, np.int16))
    stream.push(noise(0.1))
    stream.flush()
    with pytest.raises(RuntimeError, match="after flush"):
        stream.push(noise(0.1))


def test_build_script_rebuilds_the_committed_model(tmp_path, model):
    rebuilt = LogMelOnnx(build_logmel.export(tmp_path / "logmel.onnx"))
    padded = np.pad(concat(speech("Rebuild."), noise(0.2)), N_FFT // 2, mode="reflect")
    committed = model(padded)
    np.testing.assert_array_equal(rebuilt(padded), committed)
    with torch.no_grad():
        eager = build_logmel.LogMel()(torch.from_numpy(padded)).numpy()
    assert eager.shape == committed.shape == (N_MELS, (padded.size - N_FFT) // HOP_LENGTH + 1)
    # Two float32 GEMM libraries (torch's and onnxruntime's MLAS) round differently: compare as
    # the model sees it, normalised with one max, at the tolerance used against the reference.
    top = float(eager.max())
    np.testing.assert_allclose(normalize(committed, top), normalize(eager, top), rtol=0,
                               atol=TOL_NORMALISED)


def test_model_accepts_batch_of_one_and_short_signals(model):
    padded = noise(0.1)
    np.testing.assert_array_equal(model(padded[None, :]), model(padded))
    assert model(padded[: N_FFT - 1]).shape == (N_MELS, 0)
    assert model(padded[:N_FFT]).shape == (N_MELS, 1)


def test_edge_module_does_not_import_torch():
    code = "import sys, harken.edge.features; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
