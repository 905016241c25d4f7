"""The log-mel feature contract shared by the edge (which computes it) and the cloud (which
consumes it). Values follow Qwen3-ASR's WhisperFeatureExtractor(feature_size=128)."""

SAMPLE_RATE = 16_000
N_FFT = 400
HOP_LENGTH = 160
N_MELS = 128
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100
LOG10_FLOOR = 1e-10  # log10(max(mel, 1e-10))
DYNAMIC_RANGE_LOG10 = 8.0  # floor at (max - 8) in log10 units = 80 dB


def samples_needed(frame: int) -> int:
    """Samples that must exist before frame `frame` is final (centred STFT, reflect pad 200)."""
    return HOP_LENGTH * frame + N_FFT // 2


def normalize(log_mel, max_log10: float):
    """The reference's last two steps: floor at (max - 8), then (x + 4) / 4. Works on numpy arrays."""
    import numpy as np

    return (np.maximum(log_mel, max_log10 - DYNAMIC_RANGE_LOG10) + 4.0) / 4.0
