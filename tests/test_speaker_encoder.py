"""The speaker encoder (cloud/model/speaker_encoder.py) against the package it was rebuilt from:
Resemblyzer 0.1.4's `VoiceEncoder` (its own librosa mel spectrogram, LSTM and partial windows) on
the same samples. Two voices saying the same sentence must come out further apart than one voice's
two sentences (espeak-ng's en-us and its female variant f3)."""

from __future__ import annotations

import numpy as np
import pytest
import resemblyzer  # the reference: `make` installs it (--no-deps) with librosa and webrtcvad-wheels
import torch

from harken.cloud.model.speaker_encoder import SpeakerEncoder, partial_slices, power_mel
from signals import speech


@pytest.fixture(scope="module")
def encoders():
    torch.set_num_threads(1)
    return SpeakerEncoder.load(), resemblyzer.VoiceEncoder(device="cpu", verbose=False)


@pytest.fixture(scope="module")
def utterances():
    return {"a1": speech("Good morning everyone, let us start the meeting.", voice="en-us"),
            "a2": speech("The report is due on Friday afternoon.", voice="en-us"),
            "b1": speech("Good morning everyone, let us start the meeting.", voice="en-us+f3"),
            "short": speech("Yes.", voice="en-us")}


def test_features_and_windows_are_resemblyzers(utterances):
    from resemblyzer import audio

    for wav in utterances.values():
        ours, theirs = power_mel(wav), audio.wav_to_mel_spectrogram(wav)
        assert ours.shape == theirs.shape
        assert np.allclose(ours, theirs, rtol=1e-3, atol=1e-6 * theirs.max())
    for n in (1, 1600, 25_599, 25_600, 25_601, 40_000, 123_457, 16000 * 30):
        _, mel_slices = resemblyzer.VoiceEncoder.compute_partial_slices(n, 1.3, 0.75)
        assert partial_slices(n) == mel_slices, n


def test_embeddings_equal_resemblyzers(encoders, utterances):
    ours, theirs = encoders
    for name, wav in utterances.items():
        a, b = ours.embed(wav), theirs.embed_utterance(wav)
        assert a.shape == (256,) and abs(np.linalg.norm(a) - 1) < 1e-5 and (a >= 0).all()
        assert float(a @ b) >= 0.9999, name


def test_one_voice_is_closer_to_itself_than_to_another(encoders, utterances):
    ours, _ = encoders
    e = {k: ours.embed(v) for k, v in utterances.items()}
    assert float(e["a1"] @ e["a2"]) > float(e["a1"] @ e["b1"])


def test_features_path_equals_the_audio_path(encoders, utterances):
    """The server's input (the edge's floored 128-band log10-mel, through the codec) gives the
    embedding of the audio itself at the fixed level, at any gain."""
    from harken.edge.features import log_mel_raw
    from harken.shared.codec import decode_frames, encode_frames
    from harken.shared.features_spec import RunningMaxFloor

    ours, _ = encoders
    for name in ("a1", "b1", "short"):
        for gain in (0.03, 1.0):
            wav = utterances[name] * gain
            reference = ours.embed_at_level(wav)
            floored = RunningMaxFloor()(log_mel_raw(wav))
            assert float(reference @ ours.embed_features(floored)) >= 0.999, (name, gain)
            assert float(reference @ ours.embed_features(decode_frames(encode_frames(floored)))) >= 0.99, (name, gain)
    quiet, loud = (ours.embed_features(RunningMaxFloor()(log_mel_raw(utterances["a1"] * g))) for g in (0.03, 1.0))
    assert float(quiet @ loud) >= 0.999  # the level step: a voice does not move with its loudness


def test_a_long_segment_embeds_at_most_max_partials_windows_close_to_all_of_them(encoders):
    """`max_partials` bounds a long segment's windows (the label's cost) and keeps its embedding: the
    windows picked are spread over the whole segment, first and last included."""
    from harken.cloud.model.speaker_encoder import power_mel, spread

    ours, _ = encoders
    windows = partial_slices(16000 * 15)
    assert len(windows) > 8
    picked = spread(windows, 8)
    assert len(picked) == 8 and picked[0] == windows[0] and picked[-1] == windows[-1]
    assert len(set((s.start for s in picked))) == 8 and spread(windows[:5], 8) == windows[:5]
    wav = speech("Two of our largest customers moved their orders to the spring, so the numbers from the "
                 "last quarter look worse than they are, and we should plan for a slower winter.", voice="en-us")
    assert len(wav) > 16000 * 9
    mel = power_mel(wav)
    assert float(ours.embed_mel(mel, 8) @ ours.embed_mel(mel)) >= 0.99
    assert np.array_equal(ours.embed_mel(mel, 1000), ours.embed_mel(mel))
