"""Log-mel features on the edge: Qwen3-ASR's WhisperFeatureExtractor(feature_size=128), streaming-exact.

The spectrogram runs in an ONNX graph (edge/models/logmel.onnx, built by
edge/models/build_logmel.py) on onnxruntime; numpy does the padding and bookkeeping. No torch.

The reference is a centred STFT: the signal gets 200 samples of reflect padding at each end,
frame t covers padded samples [160t, 160t + 400), and the last frame is dropped, so n samples
give n // 160 frames. Frame t therefore covers input samples [160t - 200, 160t + 200): it is final
once 160t + 200 samples exist, except frame 0, whose left reflection mirrors samples 1..200 and so
needs 201. Frames that reach into the right-hand reflection are only known at `flush()`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..shared.errors import AudioError, ModelError
from ..shared.features_spec import HOP_LENGTH, N_FFT, N_MELS, SAMPLE_RATE, normalize

DEFAULT_MODEL_PATH = Path(__file__).with_name("models") / "logmel.onnx"
PAD = N_FFT // 2  # reflect padding at each end of a centred STFT
MIN_SAMPLES = PAD + 1  # reflect padding of 200 needs more than 200 samples (the reference raises too)
OFFLINE_PIECE_SAMPLES = 30 * SAMPLE_RATE


def frames_final(n_samples: int) -> int:
    """How many frames are final (will not change whatever follows) once n_samples exist."""
    if n_samples < MIN_SAMPLES:
        return 0
    return (n_samples - PAD) // HOP_LENGTH + 1


def first_frame_from(sample: int) -> int:
    """The first frame computed from input that starts at sample `sample`: 0 from the start (the
    reflection stands in for what lies before), else the first whose window lies after it."""
    return 0 if sample == 0 else -(-(sample + PAD) // HOP_LENGTH)


def frames_total(n_samples: int) -> int:
    """Frames the reference gives for a complete input of n_samples (centred STFT minus its last)."""
    return n_samples // HOP_LENGTH


def _frames_in(n_padded: int) -> int:
    # Full 400-sample windows at hop 160 in an already padded signal.
    return 0 if n_padded < N_FFT else (n_padded - N_FFT) // HOP_LENGTH + 1


def _empty_frames() -> np.ndarray:
    return np.zeros((N_MELS, 0), dtype=np.float32)


class LogMelOnnx:
    """The committed log-mel ONNX graph on an onnxruntime CPU session.

    `threads` is the intra-op thread count: 1 by default, because the edge gets one core."""

    def __init__(self, path: str | Path | None = None, threads: int = 1):
        self.path = Path(path) if path is not None else DEFAULT_MODEL_PATH
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        try:
            self.session = ort.InferenceSession(str(self.path), options,
                                                providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own untyped errors for missing/bad files
            raise ModelError(f"{self.path}: cannot load the log-mel model ({e})") from e
        self._input = self.session.get_inputs()[0].name

    def __call__(self, padded: np.ndarray) -> np.ndarray:
        """padded: [n] or [1, n] float32 signal that already carries its padding.
        Returns raw log10 mel [128, (n - 400) // 160 + 1] float32 ([128, 0] when n < 400)."""
        x = np.ascontiguousarray(np.asarray(padded, dtype=np.float32).reshape(-1))
        if x.size < N_FFT:
            return _empty_frames()
        return self.session.run(None, {self._input: x})[0]


class StreamingLogMel:
    """One stream's log-mel state: push PCM pieces, get each frame as soon as it is final.

    Concatenating everything `push` and `flush` return equals the reference's frames for the
    concatenated input (raw log10 mel: no max-floor, no (x + 4) / 4). The buffer holds only the
    samples later frames still need: under 400 plus the latest piece."""

    def __init__(self, model: LogMelOnnx | None = None):
        self.model = model if model is not None else LogMelOnnx()
        self.n_samples = 0  # input samples pushed so far
        self.frames_emitted = 0  # frames returned so far
        self.finished = False
        # Before MIN_SAMPLES arrive: the raw input. After: the padded signal from the first
        # sample of frame `frames_emitted` on (padded index 160 * frames_emitted).
        self._buffer = np.zeros(0, dtype=np.float32)
        self._left_padded = False
        self._skip = 0  # input samples still to drop (`resume_at`)

    def resume_at(self, sample: int) -> None:
        """Continue a stream whose input before sample `sample` (> 0) is not at hand: the next
        `push` takes the input from `sample` on, and frames start at the first one whose window
        lies inside it (`first_frame_from`), each equal to the uninterrupted stream's."""
        if self.n_samples or self.finished or sample <= 0:
            raise RuntimeError("StreamingLogMel.resume_at starts a new stream past sample 0")
        self.n_samples = sample
        self.frames_emitted = first_frame_from(sample)
        # the buffer starts at the first sample of frame `frames_emitted` (input index 160 t - 200)
        self._skip = HOP_LENGTH * self.frames_emitted - PAD - sample
        self._left_padded = True

    @property
    def buffered_samples(self) -> int:
        """Samples held for frames not yet final: under 400 between calls."""
        return int(self._buffer.size)

    def push(self, pcm: np.ndarray) -> np.ndarray:
        """pcm: [n] float 16 kHz mono in [-1, 1], any n >= 0. Returns [128, k] float32: the frames that
        became final with this piece (k may be 0)."""
        if self.finished:
            raise RuntimeError("StreamingLogMel.push after flush: start a new stream")
        x = _as_pcm(pcm)
        self.n_samples += x.size
        if self._skip:
            dropped = min(self._skip, x.size)
            x, self._skip = x[dropped:], self._skip - dropped
        self._buffer = np.concatenate([self._buffer, x])
        if not self._left_padded:
            if self.n_samples < MIN_SAMPLES:
                return _empty_frames()
            self._buffer = np.concatenate([_left_reflection(self._buffer), self._buffer])
            self._left_padded = True
        return self._take(_frames_in(self._buffer.size))

    def flush(self, short_ok: bool = False) -> np.ndarray:
        """End of input: pad the end as the reference does (reflect) and return the remaining
        frames, so the stream's total is n_samples // 160 frames. Inputs the reference cannot take
        (200 samples or fewer) raise AudioError, or with `short_ok` give no frames (a live stream
        that ends within 12.5 ms of its start holds no speech)."""
        if self.finished:
            raise RuntimeError("StreamingLogMel.flush called twice")
        self.finished = True
        if self.n_samples < MIN_SAMPLES:
            self._buffer = np.zeros(0, dtype=np.float32)
            if short_ok:
                return _empty_frames()
            raise AudioError(f"{self.n_samples} samples is too short for log-mel features: the "
                             f"reference's reflect padding needs at least {MIN_SAMPLES}")
        self._buffer = np.concatenate([self._buffer, _right_reflection(self._buffer)])
        frames = self._take(frames_total(self.n_samples) - self.frames_emitted)
        self._buffer = np.zeros(0, dtype=np.float32)
        return frames

    def _take(self, k: int) -> np.ndarray:
        # One ONNX call for all k frames, then drop the samples no later frame needs.
        if k <= 0:
            return _empty_frames()
        frames = self.model(self._buffer[: HOP_LENGTH * (k - 1) + N_FFT])
        self._buffer = self._buffer[HOP_LENGTH * k:]
        self.frames_emitted += k
        return frames


def log_mel_raw(audio: np.ndarray, model: LogMelOnnx | None = None) -> np.ndarray:
    """Whole input -> raw log10 mel [128, len // 160] float32, through the streaming path."""
    stream = StreamingLogMel(model)
    # Pieces keep the graph's [frames, 400] intermediates small on long files; streaming is
    # bit-exact, so the split does not change a value.
    pieces = [stream.push(audio[i : i + OFFLINE_PIECE_SAMPLES])
              for i in range(0, len(audio), OFFLINE_PIECE_SAMPLES)]
    return np.concatenate([*pieces, stream.flush()], axis=1)


def log_mel(audio: np.ndarray, model: LogMelOnnx | None = None) -> np.ndarray:
    """Whole input -> [128, len // 160] float32, exactly what Qwen3-ASR's processor feeds the
    model: floor at (global max - 8), then (x + 4) / 4."""
    raw = log_mel_raw(audio, model)
    return normalize(raw, float(raw.max())).astype(np.float32)


def _as_pcm(pcm: np.ndarray) -> np.ndarray:
    x = np.asarray(pcm)
    if not np.issubdtype(x.dtype, np.floating):
        raise AudioError(f"expected float PCM in [-1, 1], got {x.dtype} (scale it with to_mono_16k)")
    x = x.astype(np.float32, copy=False)
    if x.ndim != 1:
        raise AudioError(f"expected mono PCM of shape [samples], got shape {x.shape}")
    if not np.isfinite(x).all():
        raise AudioError("PCM holds NaN or infinite samples")
    return x


def _left_reflection(x: np.ndarray) -> np.ndarray:
    # [200]: x[200], x[199], ..., x[1] — numpy/torch "reflect" (the edge sample is not repeated).
    return x[PAD:0:-1]


def _right_reflection(x: np.ndarray) -> np.ndarray:
    # [200]: x[-2], x[-3], ..., x[-201].
    return x[-2:-PAD - 2:-1]
