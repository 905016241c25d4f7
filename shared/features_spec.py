"""The log-mel feature contract shared by the edge (which computes it) and the cloud (which
consumes it). Values follow Qwen3-ASR's WhisperFeatureExtractor(feature_size=128)."""

import math

SAMPLE_RATE = 16_000
N_FFT = 400
HOP_LENGTH = 160
N_MELS = 128
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100
LOG10_FLOOR = 1e-10  # log10(max(mel, 1e-10))
DYNAMIC_RANGE_LOG10 = 8.0  # floor at (max - 8) in log10 units = 80 dB


# The mel scale through the C library's log and exp (`math`), element by element, not numpy's: on
# CPUs with AVX-512 numpy computes float64 exp/log with its own SIMD code, a few ULPs away from
# libm, which moved the filter bank and the codec's derived constants (edge/web/src/codec_tables.json,
# which the TypeScript codec reads) with the machine. These are 130 points: speed does not matter.

def _hz_to_mel_slaney(hz):
    # Slaney: linear below 1 kHz (3 mels per 200 Hz), logarithmic above (27 steps per factor 6.4).
    import numpy as np

    f_sp, min_log_hz, logstep = 200.0 / 3.0, 1000.0, math.log(6.4) / 27.0
    return np.array([min_log_hz / f_sp + math.log(h / min_log_hz) / logstep if h >= min_log_hz else h / f_sp
                     for h in np.atleast_1d(np.asarray(hz, dtype=np.float64)).tolist()]).reshape(np.shape(hz))


def _mel_to_hz_slaney(mel):
    import numpy as np

    f_sp, min_log_hz, logstep = 200.0 / 3.0, 1000.0, math.log(6.4) / 27.0
    min_log_mel = min_log_hz / f_sp
    return np.array([min_log_hz * math.exp(logstep * (m - min_log_mel)) if m >= min_log_mel else m * f_sp
                     for m in np.atleast_1d(np.asarray(mel, dtype=np.float64)).tolist()]).reshape(np.shape(mel))


def slaney_mel_filters(n_freqs: int = N_FFT // 2 + 1, n_mels: int = N_MELS, f_min: float = 0.0,
                       f_max: float = SAMPLE_RATE / 2, sample_rate: int = SAMPLE_RATE):
    """[n_freqs, n_mels] float64 triangular filters on the Slaney mel scale with Slaney (area)
    norm: the bank of the feature contract, as transformers' `mel_filter_bank(201, 128, 0, 8000,
    16000, norm="slaney", mel_scale="slaney")` builds it — triangle corners at n_mels + 2 points
    evenly spaced in mel, evaluated at the FFT bin centres. The edge's log-mel graph and the
    codec's mel layout both use it."""
    import numpy as np

    fft_hz = np.linspace(0.0, sample_rate / 2, n_freqs)
    hz_points = _mel_points_hz(n_mels, f_min, f_max)
    widths = np.diff(hz_points)
    slopes = hz_points[None, :] - fft_hz[:, None]  # [n_freqs, n_mels + 2]
    filters = np.maximum(0.0, np.minimum(-slopes[:, :-2] / widths[:-1], slopes[:, 2:] / widths[1:]))
    # each filter has unit area, so wide high-frequency filters are not louder
    return filters * (2.0 / (hz_points[2:] - hz_points[:-2]))[None, :]


def mel_centres_hz(n_mels: int = N_MELS, f_min: float = 0.0, f_max: float = SAMPLE_RATE / 2):
    """[n_mels] float64: the frequency at which each filter of `slaney_mel_filters` peaks."""
    return _mel_points_hz(n_mels, f_min, f_max)[1:-1]


def _mel_points_hz(n_mels: int, f_min: float, f_max: float):
    # the n_mels + 2 triangle corners, evenly spaced in mel
    import numpy as np

    return _mel_to_hz_slaney(np.linspace(_hz_to_mel_slaney(f_min), _hz_to_mel_slaney(f_max), n_mels + 2))


def samples_needed(frame: int) -> int:
    """Samples that must exist before frame `frame` is final (centred STFT, reflect pad 200).
    Frame 0 needs one more: its left reflection mirrors samples 1..200."""
    return max(HOP_LENGTH * frame + N_FFT // 2, N_FFT // 2 + 1)


def normalize(log_mel, max_log10: float):
    """The reference's last two steps: floor at (max - 8), then (x + 4) / 4. Works on numpy arrays."""
    import numpy as np

    return (np.maximum(log_mel, max_log10 - DYNAMIC_RANGE_LOG10) + 4.0) / 4.0


class RunningMaxFloor:
    """Floors raw log10-mel frames at (running max - 8) as they arrive, so a frame's value never
    changes afterwards (cached encoder windows stay valid). The state is one float that travels
    with each final segment, so a replacement session can be seeded with it."""

    def __init__(self, max_log10: float = float("-inf")):
        self.max_log10 = float(max_log10)

    def __call__(self, frames):
        """frames: [128, k] raw log10-mel -> [128, k] floored (float32). Updates the running max."""
        import numpy as np

        frames = np.asarray(frames, dtype=np.float32)
        if frames.shape[-1] == 0:
            return frames.copy()
        running = np.maximum.accumulate(np.maximum(frames.max(axis=0), self.max_log10))
        self.max_log10 = float(running[-1])
        return np.maximum(frames, (running - DYNAMIC_RANGE_LOG10)[None, :]).astype(np.float32)
