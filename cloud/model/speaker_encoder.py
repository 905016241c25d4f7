"""The speaker encoder: who is speaking, as a 256-d unit vector (GE2E, Resemblyzer's pretrained model).

    encoder = SpeakerEncoder.load()                 # resemblyzer's pretrained.pt (see `weights_path`)
    e = encoder.embed(samples)                      # 16 kHz mono float32 -> [256], L2 norm 1, >= 0

Rebuilt with torch and numpy alone from Resemblyzer 0.1.4 (Apache-2.0; github.com/resemble-ai/
Resemblyzer), its embeddings equal to the package's (tests/test_speaker_encoder.py, cosine >= 0.9999):

- features: 40-band *power* mel spectrogram (not log), n_fft 400, hop 160, a periodic Hann window,
  the signal zero-padded by n_fft / 2 at both ends (librosa's `center=True`), the Slaney mel scale
  and area norm from 0 to 8 kHz (`shared.features_spec.slaney_mel_filters`, the feature contract's
  bank at 40 bands, which is librosa's);
- partials: windows of 160 frames (1.6 s) every round(16000 / 1.3 / 160) = 77 frames, the audio
  zero-padded to the last window's end, the last window dropped when it covers less than 75% of
  real audio (unless it is the only one);
- model: a 3-layer LSTM (40 -> 256) over each partial, its last layer's final hidden state through
  Linear(256, 256) and ReLU, L2-normalised; the utterance embedding is the partials' mean,
  L2-normalised. The embeddings are non-negative, so cosines between speakers run high (~0.7).

The weights: read at first use from the `resemblyzer` package's `pretrained.pt` (17 MB with the
optimiser's state; 1.42 M parameters used), found without importing the package (its import needs
librosa and webrtcvad, which harken does not), so the package is a data dependency:
`pip install resemblyzer==0.1.4 --no-deps`. Not converted into the repo: the file is its authors'
release, its licence travels with its wheel, and harken's checkout and wheel stay free of 6 MB of
someone else's weights.

On the cloud's features (`embed_features`): the server never has the audio, only the edge's 128-band
log10-mel (floored, through the codec). Both banks are Slaney triangles on the same FFT bins, so the
40-band power mel is, to a close approximation, a fixed linear map of the 128-band one: the matrix
`feature_map()` is the least-squares solution of bank40 = bank128 @ M (201 bins), applied to
10 ** log10-mel. Frame i of the edge's features and of Resemblyzer's mel are both centred on sample
160 i. The power mel depends on the input's gain and the LSTM is not gain-invariant, while the edge's
level is whatever the microphone gives: both `embed_features` and `embed_at_level` (the audio path)
first scale the power mel to a fixed mean (`LEVEL`, the mean of speech at -30 dBFS RMS, the level
Resemblyzer's own preprocessing normalises to), so a voice's embedding does not move with its
loudness. `embed` stays the package's own (no level step), for the reference test.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ...shared.errors import ModelError
from ...shared.features_spec import slaney_mel_filters

SAMPLE_RATE = 16000
N_FFT = 400  # 25 ms
HOP = 160  # 10 ms
N_MELS = 40
PARTIAL_FRAMES = 160  # 1.6 s
PARTIALS_PER_S = 1.3
MIN_COVERAGE = 0.75
HIDDEN = 256
LAYERS = 3
EMBEDDING = 256
# the mean 40-band power mel of espeak-ng and LibriVox speech at -30 dBFS RMS (see `embed_at_level`)
LEVEL = 0.009


def weights_path() -> Path:
    """resemblyzer's `pretrained.pt`, located without importing the package."""
    spec = importlib.util.find_spec("resemblyzer")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("speaker labels need the speaker encoder's weights from the resemblyzer package: "
                         "pip install resemblyzer==0.1.4 --no-deps")
    path = Path(next(iter(spec.submodule_search_locations))) / "pretrained.pt"
    if not path.is_file():
        raise ModelError(f"{path}: missing from the installed resemblyzer package (reinstall resemblyzer==0.1.4)")
    return path


def power_mel(samples: np.ndarray) -> np.ndarray:
    """[frames, 40] float32 power mel spectrogram of 16 kHz samples (librosa's melspectrogram with
    resemblyzer's settings: center=True with zero padding, periodic Hann, power 2)."""
    x = np.pad(np.asarray(samples, dtype=np.float32), N_FFT // 2)
    frames = 1 + (x.size - N_FFT) // HOP
    index = np.arange(N_FFT)[None, :] + HOP * np.arange(frames)[:, None]
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)).astype(np.float32)
    spectrum = np.fft.rfft(x[index] * window, axis=1)
    power = (spectrum.real ** 2 + spectrum.imag ** 2).astype(np.float32)
    return (power @ _mel_bank()).astype(np.float32)


_BANK: np.ndarray | None = None


def _mel_bank() -> np.ndarray:
    global _BANK
    if _BANK is None:
        _BANK = slaney_mel_filters(N_FFT // 2 + 1, N_MELS, 0.0, SAMPLE_RATE / 2, SAMPLE_RATE).astype(np.float32)
    return _BANK


def partial_slices(n_samples: int) -> list[slice]:
    """The mel-frame windows of an utterance of `n_samples` (see the module docstring)."""
    n_frames = int(np.ceil((n_samples + 1) / HOP))
    step = int(np.round((SAMPLE_RATE / PARTIALS_PER_S) / HOP))
    starts = range(0, max(1, n_frames - PARTIAL_FRAMES + step + 1), step)
    slices = [slice(i, i + PARTIAL_FRAMES) for i in starts]
    last = slices[-1]
    coverage = (n_samples - last.start * HOP) / (PARTIAL_FRAMES * HOP)
    if coverage < MIN_COVERAGE and len(slices) > 1:
        slices = slices[:-1]
    return slices


def spread(slices: list[slice], most: int | None) -> list[slice]:
    """At most `most` of `slices`, evenly spread from the first to the last (all of them: None)."""
    if most is None or len(slices) <= most:
        return slices
    return [slices[int(i)] for i in np.round(np.linspace(0, len(slices) - 1, most))]


class SpeakerEncoder(nn.Module):
    """GE2E's LSTM speaker encoder (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(N_MELS, HIDDEN, LAYERS, batch_first=True)
        self.linear = nn.Linear(HIDDEN, EMBEDDING)

    @classmethod
    def load(cls, path: str | Path | None = None) -> "SpeakerEncoder":
        checkpoint = torch.load(str(path or weights_path()), map_location="cpu", weights_only=True)
        state = {k: v for k, v in checkpoint["model_state"].items() if k.startswith(("lstm.", "linear."))}
        encoder = cls()
        encoder.load_state_dict(state)
        return encoder.eval()

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        """[B, frames, 40] power mel -> [B, 256] unit embeddings."""
        _, (hidden, _) = self.lstm(mels)
        raw = torch.relu(self.linear(hidden[-1]))
        return raw / torch.linalg.vector_norm(raw, dim=1, keepdim=True)

    @torch.no_grad()
    def embed(self, samples: np.ndarray) -> np.ndarray:
        """An utterance (16 kHz mono float32) -> its [256] unit embedding: the mean of its partials'."""
        slices = partial_slices(len(samples))
        end = slices[-1].stop * HOP
        padded = np.pad(samples, (0, max(0, end - len(samples))))
        mel = power_mel(padded)
        partials = self(torch.from_numpy(np.stack([mel[s] for s in slices])))
        mean = partials.mean(dim=0).numpy()
        return (mean / np.linalg.norm(mean)).astype(np.float32)

    @torch.no_grad()
    def embed_mel(self, mel: np.ndarray, max_partials: int | None = None) -> np.ndarray:
        """A [frames, 40] power mel (any level; scaled to `LEVEL`) -> its [256] unit embedding, with
        the partial windows of audio as long as the frames cover; at most `max_partials` of them,
        evenly spread (the cost of a long segment bounded: the LSTM runs once per window)."""
        mel = np.asarray(mel, dtype=np.float32)
        n = mel.shape[0]
        if n == 0:
            raise ValueError("no frames to embed")
        mel = mel * np.float32(LEVEL / max(float(mel.mean()), 1e-20))
        slices = spread(partial_slices((n - 1) * HOP), max_partials)
        mel = np.pad(mel, ((0, max(0, slices[-1].stop - n)), (0, 0)))
        partials = self(torch.from_numpy(np.stack([mel[s] for s in slices])))
        mean = partials.mean(dim=0).numpy()
        return (mean / np.linalg.norm(mean)).astype(np.float32)

    def embed_at_level(self, samples: np.ndarray) -> np.ndarray:
        """The audio path at a fixed level: `embed`'s features, scaled as `embed_features` scales
        its (what the features path is held to)."""
        return self.embed_mel(power_mel(samples))

    def embed_features(self, log10_mel: np.ndarray, max_partials: int | None = None) -> np.ndarray:
        """The edge's raw (floored) log10-mel [128, frames], as the server decodes it -> the [256] unit
        embedding of the speech it holds (see the module docstring; `max_partials`: `embed_mel`'s)."""
        return self.embed_mel(features_power_mel(log10_mel), max_partials)


def features_power_mel(log10_mel: np.ndarray) -> np.ndarray:
    """[128, frames] log10-mel (the feature contract's bank) -> [frames, 40] power mel on this
    encoder's bank (`feature_map`), non-negative."""
    power = np.power(10.0, np.asarray(log10_mel, dtype=np.float64).T)
    return np.maximum(power @ feature_map(), 0.0).astype(np.float32)


_MAP: np.ndarray | None = None


def feature_map() -> np.ndarray:
    """[128, 40] float64: the least-squares M with slaney_bank(40) ~= slaney_bank(128) @ M over the
    201 FFT bins (both banks from 0 to 8 kHz, area-normalised)."""
    global _MAP
    if _MAP is None:
        b128 = slaney_mel_filters(N_FFT // 2 + 1, 128, 0.0, SAMPLE_RATE / 2, SAMPLE_RATE)
        b40 = slaney_mel_filters(N_FFT // 2 + 1, N_MELS, 0.0, SAMPLE_RATE / 2, SAMPLE_RATE)
        _MAP = np.linalg.lstsq(b128, b40, rcond=None)[0]
    return _MAP
