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
