"""Voice activity detection: silero-vad on onnxruntime, and a streaming segment state machine.

Two layers, in the order the data flows:

- `SileroVad` computes silero-vad's speech probabilities exactly as silero's own `OnnxWrapper`
  does at 16 kHz: 512-sample windows, each fed with the previous window's last 64 samples
  prepended, the recurrent state carried from window to window. It runs a graph derived from the
  vendored model (edge/models/build_silero_vad_windows.py) that takes all complete windows of a
  piece in one call: same weights, same ops, same results, about twice as fast on long pieces.
  `push()` takes PCM pieces of any size and returns the probabilities of the windows they
  completed.
- `SpeechSegmenter` turns window probabilities into segment events (`SegmentStart`, `SegmentEnd`)
  with silero's rules (threshold with hysteresis, min speech, min silence, padding, optional max
  speech). `StreamingVad` joins the two. `get_speech_timestamps()` is a single push plus a flush,
  so offline and streaming results agree by construction.

Look-ahead (how far behind the audio an event is emitted; `decided_at_sample - start/end_sample`):

- A start is only known once the segment is certain to outlast `min_speech_duration_ms` (shorter
  bursts are dropped), and it is reported `speech_pad_ms` before the first speech window. While the
  speech goes on that is at most min_speech + pad + one 32 ms window. A pause inside that first
  min_speech stretch defers the decision until the pause ends (speech resumes: start confirmed) or
  reaches min_silence (burst dropped), so the worst case is min_speech + min_silence + pad + 64 ms.
- An end is known once the pause (from the first window below `neg_threshold` until a window
  reaches `threshold` again) has lasted `min_silence_duration_ms` (counted in whole
  windows), and it is reported `speech_pad_ms` after the last speech window: at most
  max(min_silence - pad, 0) + 64 ms behind.
- A cut at `max_speech_duration_s` (off by default) ends the segment at the longest pause inside
  it, which may lie up to max_speech in the past.

Memory is constant: less than one window of audio, the 64-sample context, the model state and a
few integers, however long the stream runs. No torch here: onnxruntime and numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..shared.errors import AudioError, HarkenError, ModelError
from ..shared.features_spec import SAMPLE_RATE

WINDOW_SAMPLES = 512  # 32 ms: the only window silero-vad accepts at 16 kHz
CONTEXT_SAMPLES = 64  # the tail of the previous window the model sees before each window
FRAME_SAMPLES = CONTEXT_SAMPLES + WINDOW_SAMPLES
STATE_SHAPE = (2, 1, 128)  # LSTM (h, c) for a batch of one stream
MODEL_PATH = Path(__file__).parent / "models" / "silero_vad_windows.onnx"
VENDORED_MODEL_PATH = Path(__file__).parent / "models" / "silero_vad.onnx"  # MODEL_PATH's source
MAX_WINDOWS_PER_RUN = 1024  # 33 s of audio, 2.4 MB of frames: bounds memory for huge pushes

# silero's max-speech cut only considers pauses longer than this (its `min_silence_at_max_speech`)
MIN_SILENCE_AT_MAX_SPEECH_MS = 98


@dataclass(frozen=True)
class VadOptions:
    """Segmenting rules. Defaults match the `harken vad` command line."""

    threshold: float = 0.5  # a window with probability >= this is speech
    min_speech_duration_ms: int = 250  # segments this short or shorter are dropped
    min_silence_duration_ms: int = 300  # a pause must last this long to end a segment
    speech_pad_ms: int = 100  # added before and after each segment, never over a neighbour
    neg_threshold: float | None = None  # leave speech below this; None: threshold - 0.15
    max_speech_duration_s: float = math.inf  # longer segments are cut (the cloud cuts its own)

    def __post_init__(self):
        if not 0.0 < self.threshold < 1.0:
            raise HarkenError(f"VAD threshold must lie in (0, 1), got {self.threshold}")
        if self.neg_threshold is not None and not 0.0 <= self.neg_threshold <= self.threshold:
            raise HarkenError(f"VAD neg_threshold must lie in [0, threshold], got {self.neg_threshold}")
        for name in ("min_speech_duration_ms", "min_silence_duration_ms", "speech_pad_ms"):
            if getattr(self, name) < 0:
                raise HarkenError(f"VAD {name} must be >= 0, got {getattr(self, name)}")
        if not self.max_speech_duration_s > 0:
            raise HarkenError(f"VAD max_speech_duration_s must be > 0, got {self.max_speech_duration_s}")

    @property
    def exit_threshold(self) -> float:
        """Probability below which speech ends (silero's default: threshold - 0.15, at least 0.01)."""
        if self.neg_threshold is not None:
            return self.neg_threshold
        return max(self.threshold - 0.15, 0.01)


def _ms_to_samples(ms: float) -> int:
    return int(round(SAMPLE_RATE * ms / 1000))


def _as_pcm(pcm) -> np.ndarray:
    """1-D float32 in [-1, 1]; integer PCM is scaled by its full range."""
    x = np.asarray(pcm)
    if x.ndim != 1:
        raise AudioError(f"VAD expects 1-D mono audio, got shape {x.shape}")
    if np.issubdtype(x.dtype, np.integer):
        return x.astype(np.float32) / float(np.iinfo(x.dtype).max + 1)
    return x.astype(np.float32, copy=False)


def _load_session(model_path: Path):
    import onnxruntime

    opts = onnxruntime.SessionOptions()
    opts.intra_op_num_threads = 1  # the edge budget is one core
    opts.inter_op_num_threads = 1
    try:
        return onnxruntime.InferenceSession(str(model_path), sess_options=opts,
                                            providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types, not OSError/ValueError
        raise ModelError(f"{model_path}: cannot load the silero-vad model ({e})") from e


class SileroVad:
    """silero-vad (ONNX) at 16 kHz on one CPU thread: speech probability per 512-sample window.

    Window k covers samples [512 k, 512 k + 512) of the stream. All complete windows of a push go
    through the model in one call: the convolutional front end batches them, the LSTM runs over
    them as one sequence.
    """

    def __init__(self, model_path: str | Path = MODEL_PATH, session=None):
        """Load the windows graph at `model_path`, or use an already loaded `session` of it."""
        self._session = session if session is not None else _load_session(Path(model_path))
        self.reset()

    def new_stream(self) -> SileroVad:
        """Another SileroVad for another stream, sharing this one's loaded model (onnxruntime
        sessions may run concurrently), so many streams cost one model load."""
        return SileroVad(session=self._session)

    def reset(self) -> None:
        """Start a new stream: zero state, zero context, nothing buffered."""
        self._state = np.zeros(STATE_SHAPE, dtype=np.float32)
        # each window is fed as [64 context samples | 512 window samples]; the first context is zeros
        self._context = np.zeros(CONTEXT_SAMPLES, dtype=np.float32)
        self._pending = np.zeros(0, dtype=np.float32)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """(LSTM state [2, 1, 128], context [64]) between two windows: all `restore` needs to go on
        exactly as this stream goes on."""
        if self._pending.size:
            raise RuntimeError("SileroVad.snapshot inside a window: take it on a window boundary")
        return self._state.copy(), self._context.copy()

    def restore(self, state: np.ndarray, context: np.ndarray) -> None:
        """Continue a stream from a `snapshot`: the next sample pushed starts a window."""
        self._state = np.zeros(STATE_SHAPE, dtype=np.float32)
        self._state[...] = np.asarray(state, dtype=np.float32).reshape(STATE_SHAPE)
        self._context = np.asarray(context, dtype=np.float32).reshape(CONTEXT_SAMPLES).copy()
        self._pending = np.zeros(0, dtype=np.float32)

    @property
    def buffered_samples(self) -> int:
        """Samples received but not yet part of a complete window (always < 512)."""
        return int(self._pending.size)

    def _windows(self, samples: np.ndarray) -> np.ndarray:
        """samples: [512 k] -> probabilities [k], state and context carried on."""
        step = MAX_WINDOWS_PER_RUN * WINDOW_SAMPLES
        probs = [self._run(samples[i:i + step]) for i in range(0, samples.size, step)]
        return probs[0] if len(probs) == 1 else np.concatenate(probs)

    def _run(self, samples: np.ndarray) -> np.ndarray:
        windows = samples.reshape(-1, WINDOW_SAMPLES)  # [k, 512]
        frames = np.empty((windows.shape[0], FRAME_SAMPLES), dtype=np.float32)  # [k, 576]
        frames[:, CONTEXT_SAMPLES:] = windows
        # each window's context is the previous window's tail (silero's `x[..., -context_size:]`)
        frames[0, :CONTEXT_SAMPLES] = self._context
        frames[1:, :CONTEXT_SAMPLES] = windows[:-1, -CONTEXT_SAMPLES:]
        self._context = windows[-1, -CONTEXT_SAMPLES:].copy()
        out, self._state = self._session.run(None, {"frames": frames, "state": self._state})
        return out

    def push(self, pcm) -> np.ndarray:
        """Feed the next piece of the stream (any length); return the probabilities of the windows
        it completed, float32 [k]."""
        x = _as_pcm(pcm)
        if self._pending.size:
            x = np.concatenate([self._pending, x])
        complete = x.size - x.size % WINDOW_SAMPLES
        probs = self._windows(x[:complete]) if complete else np.zeros(0, dtype=np.float32)
        self._pending = x[complete:].copy()
        return probs

    def flush(self) -> np.ndarray:
        """End the stream: zero-pad a partial last window as silero does and return its
        probability ([0] or [1] values), then reset for a new stream."""
        probs = np.zeros(0, dtype=np.float32)
        if self._pending.size:
            last = np.zeros(WINDOW_SAMPLES, dtype=np.float32)
            last[:self._pending.size] = self._pending
            probs = self._windows(last)
        self.reset()
        return probs

    def probabilities(self, audio) -> np.ndarray:
        """Offline: probabilities of a whole recording, one per window, ceil(n / 512) values.
        Starts from a fresh state and leaves the object reset."""
        self.reset()
        return np.concatenate([self.push(audio), self.flush()])


@dataclass(frozen=True)
class SegmentStart:
    """Speech begins at `start_sample` (padding included). `decided_at_sample` is the stream
    position whose window decided it: the event is emitted that much later than it happened."""

    segment_id: int
    start_sample: int
    decided_at_sample: int

    @property
    def start_s(self) -> float:
        return self.start_sample / SAMPLE_RATE


@dataclass(frozen=True)
class SegmentEnd:
    """Speech of segment `segment_id` ends at `end_sample` (exclusive, padding included)."""

    segment_id: int
    start_sample: int
    end_sample: int
    decided_at_sample: int

    @property
    def start_s(self) -> float:
        return self.start_sample / SAMPLE_RATE

    @property
    def end_s(self) -> float:
        return self.end_sample / SAMPLE_RATE


SegmentEvent = SegmentStart | SegmentEnd


@dataclass(frozen=True)
class SpeechSegment:
    """One speech segment of a recording, samples [start_sample, end_sample) at 16 kHz."""

    start_sample: int
    end_sample: int

    @property
    def start_s(self) -> float:
        return self.start_sample / SAMPLE_RATE

    @property
    def end_s(self) -> float:
        return self.end_sample / SAMPLE_RATE


@dataclass
class _Pause:
    """A stretch of non-speech inside a segment: a candidate cut point at max speech."""

    start_sample: int
    length_samples: int


@dataclass
class _PendingEnd:
    """A segment whose raw end is known but whose padded end is not yet decided."""

    segment_id: int
    start_sample: int
    raw_end_sample: int


@dataclass
class SegmenterState:
    """Everything the segmenter carries between windows: a fixed handful of fields."""

    windows_seen: int = 0
    triggered: bool = False  # inside speech (silero's `triggered`)
    raw_start_sample: int = 0  # first speech window of the current segment, unpadded
    confirmed: bool = False  # the current segment will outlast min speech: its start was emitted
    silence_start_sample: int | None = None  # silero's `temp_end`: where the current pause began
    longest_pause: _Pause | None = None  # cut point for max speech
    pending_end: _PendingEnd | None = None
    last_end_sample: int = 0  # padded end of the previous segment: the next must not start before
    next_segment_id: int = 0
    current_segment_id: int = 0
    padded_start_sample: int = 0


@dataclass(frozen=True)
class _Limits:
    """VadOptions turned into sample counts, mirroring silero's arithmetic."""

    min_speech: int
    min_silence: int
    pad: int
    max_speech: float
    min_pause_at_max_speech: int

    @classmethod
    def from_options(cls, o: VadOptions) -> _Limits:
        pad = _ms_to_samples(o.speech_pad_ms)
        return cls(min_speech=_ms_to_samples(o.min_speech_duration_ms),
                   min_silence=_ms_to_samples(o.min_silence_duration_ms), pad=pad,
                   max_speech=SAMPLE_RATE * o.max_speech_duration_s - WINDOW_SAMPLES - 2 * pad,
                   min_pause_at_max_speech=_ms_to_samples(MIN_SILENCE_AT_MAX_SPEECH_MS))


class SpeechSegmenter:
    """Window probabilities -> segment events, silero's `get_speech_timestamps` rules as a
    streaming state machine (see the module docstring for how late each event comes).

    One deviation from silero: silero measures a pause's length only on windows below
    `neg_threshold`; here every window of the pause counts, so a segment whose probabilities hover
    between the two thresholds still ends min silence after the pause began. Sequences without
    such hovering give silero's segments exactly.

    Padding: a start is moved `speech_pad_ms` earlier but never before the previous segment's
    padded end; an end is moved `speech_pad_ms` later but never past the next speech onset. When
    min_silence >= 2 * pad (the defaults) this equals silero's padding exactly.
    """

    def __init__(self, options: VadOptions = VadOptions(), first_segment_id: int = 0):
        self.options = options
        self.first_segment_id = first_segment_id  # the first segment's id (later ones count on)
        self._limits = _Limits.from_options(options)
        self.reset()

    def reset(self) -> None:
        self.state = SegmenterState(next_segment_id=self.first_segment_id)

    @property
    def idle(self) -> bool:
        """No segment is open or undecided, not even a burst too short to keep yet: all the state
        says is where the stream is, where the last segment ended and the next segment's id."""
        return not self.state.triggered and self.state.pending_end is None

    def resume(self, sample: int, last_end_sample: int, next_segment_id: int) -> None:
        """Go on from an idle state (see `idle`) `sample` samples into the stream (a multiple of
        the window): the next window pushed is the one that starts there."""
        if sample % WINDOW_SAMPLES:
            raise ValueError(f"a segmenter resumes on a window boundary, not at sample {sample}")
        self.state = SegmenterState(windows_seen=sample // WINDOW_SAMPLES, last_end_sample=last_end_sample,
                                    next_segment_id=next_segment_id)

    @property
    def earliest_end_sample(self) -> int | None:
        """The earliest sample at which the segment whose start was emitted and whose end was not
        can still end (padded end), whatever the windows still to come (only the stream's end may
        cut it shorter, and no frame exists past that); None when no such segment exists. A function of the windows seen so far, never of how the audio was cut, so the
        frames a stream sends of an open segment (edge/pipeline.py) never run past its end.

        While speech goes on, a pause may begin at the next window at the earliest; a pause in
        progress ends the segment where it began. The padding after the raw end is at least
        min(pad, min silence): an end's padding stops only at the next onset, which comes a whole
        min silence after the pause began. A cut at max speech ends the segment at a past pause
        with a padding that may stop at once, so with max speech set no padding is counted."""
        s, lim = self.state, self._limits
        next_window = s.windows_seen * WINDOW_SAMPLES  # where a pause can begin at the earliest
        if s.pending_end is not None:
            # closed, its padding still open: an onset at the next window would clip it there
            return min(s.pending_end.raw_end_sample + lim.pad, next_window)
        if not (s.triggered and s.confirmed):
            return None
        raw_end = next_window if s.silence_start_sample is None else s.silence_start_sample
        if math.isinf(self.options.max_speech_duration_s):
            return raw_end + min(lim.pad, lim.min_silence)
        if s.longest_pause is not None:
            raw_end = min(raw_end, s.longest_pause.start_sample)
        return raw_end

    def push(self, probabilities) -> list[SegmentEvent]:
        """Consume the probabilities of the next full windows; return the events they decide."""
        events: list[SegmentEvent] = []
        for p in np.asarray(probabilities, dtype=np.float64).reshape(-1):
            now = (self.state.windows_seen + 1) * WINDOW_SAMPLES
            self._window(float(p), now, events)
        return events

    def finish(self, last_probabilities, total_samples: int) -> list[SegmentEvent]:
        """End of stream: consume the (zero-padded) last window's probabilities, close what is open
        with the stream's true length `total_samples`, and reset."""
        events: list[SegmentEvent] = []
        for p in np.asarray(last_probabilities, dtype=np.float64).reshape(-1):
            self._window(float(p), total_samples, events)
        s = self.state
        if s.pending_end is not None:
            self._emit_end(min(s.pending_end.raw_end_sample + self._limits.pad, total_samples),
                           total_samples, events)
        # silero closes an open segment at the end of the audio, even inside a pause
        if s.triggered and total_samples - s.raw_start_sample > self._limits.min_speech:
            self._close(total_samples, total_samples, events)
            self._emit_end(total_samples, total_samples, events)
        self.reset()
        return events

    def finalize(self) -> list[SegmentEvent]:
        """Finalize on request (the speaker stopped, push-to-talk released): decide now what the
        windows seen so far can decide. A segment whose end waits for its padding ends at once
        (the padding cut at the stream's position); the segment in progress ends at the position
        (in a pause: where the pause began, plus what of the padding has been heard), and speech
        that goes on opens the next segment there, unconfirmed like any onset. A burst not yet
        confirmed (shorter than min speech so far) is left to the ordinary rules."""
        s, lim = self.state, self._limits
        events: list[SegmentEvent] = []
        now = s.windows_seen * WINDOW_SAMPLES
        if s.pending_end is not None:
            self._emit_end(min(s.pending_end.raw_end_sample + lim.pad, now), now, events)
        if not (s.triggered and s.confirmed):
            return events
        pause = s.silence_start_sample
        self._close(now if pause is None else pause, now, events)
        self._emit_end(now if pause is None else min(pause + lim.pad, now), now, events)
        s.silence_start_sample, s.longest_pause = None, None
        if pause is not None:
            s.triggered = False
            return events
        s.raw_start_sample, s.confirmed = now, False
        s.current_segment_id = s.next_segment_id
        s.next_segment_id += 1
        return events

    def _window(self, p: float, now: int, events: list[SegmentEvent]) -> None:
        """One window, in silero's order of checks. `now`: stream position at the window's end."""
        s, lim = self.state, self._limits
        cur = s.windows_seen * WINDOW_SAMPLES
        s.windows_seen += 1
        speech = p >= self.options.threshold
        if speech and s.silence_start_sample is not None:
            self._pause_over(cur)
        if speech and not s.triggered:
            self._open(cur, events)
        elif s.triggered and cur - s.raw_start_sample > lim.max_speech:
            self._cut(cur, now, events)
        if s.triggered and p < self.options.exit_threshold and s.silence_start_sample is None:
            s.silence_start_sample = cur
        # A pause lasts until a window reaches `threshold` again. silero tests its length only on
        # windows below `exit_threshold`, so probabilities hovering between the two would hold a
        # segment open (and its end undecided) indefinitely; testing every window bounds the delay.
        if s.silence_start_sample is not None and cur - s.silence_start_sample >= lim.min_silence:
            self._silence_end(now, events)
        self._settle(now, events)

    def _pause_over(self, cur: int) -> None:
        s = self.state
        start = s.silence_start_sample
        assert start is not None  # called in a pause
        length = cur - start
        if length > self._limits.min_pause_at_max_speech and (
                s.longest_pause is None or length > s.longest_pause.length_samples):
            s.longest_pause = _Pause(start, length)
        s.silence_start_sample = None

    def _open(self, cur: int, events: list[SegmentEvent]) -> None:
        s = self.state
        if s.pending_end is not None:
            # the previous segment's end padding stops at this onset
            self._emit_end(min(s.pending_end.raw_end_sample + self._limits.pad, cur), cur, events)
        s.triggered, s.raw_start_sample, s.confirmed = True, cur, False
        s.silence_start_sample, s.longest_pause = None, None
        s.current_segment_id = s.next_segment_id
        s.next_segment_id += 1

    def _cut(self, cur: int, now: int, events: list[SegmentEvent]) -> None:
        """Max speech reached: end at the longest pause inside the segment (speech goes on after
        it), or, with no pause, right here."""
        s = self.state
        pause = s.longest_pause
        end = pause.start_sample if pause is not None else cur
        self._close(end, now, events)
        s.silence_start_sample, s.longest_pause = None, None
        if pause is None:
            s.triggered = False
            return
        onset = pause.start_sample + pause.length_samples
        self._emit_end(min(end + self._limits.pad, onset), now, events)
        s.raw_start_sample, s.confirmed = onset, False
        s.current_segment_id = s.next_segment_id
        s.next_segment_id += 1

    def _silence_end(self, now: int, events: list[SegmentEvent]) -> None:
        """The pause lasted min silence: the segment ends where the pause began, and is kept
        only if longer than min speech."""
        s = self.state
        end = s.silence_start_sample
        assert end is not None  # called in a pause
        if s.confirmed or end - s.raw_start_sample > self._limits.min_speech:
            self._close(end, now, events)
        s.triggered, s.silence_start_sample, s.longest_pause = False, None, None

    def _close(self, raw_end: int, now: int, events: list[SegmentEvent]) -> None:
        """The current segment is kept and ends at `raw_end`; its padded end is decided later."""
        s = self.state
        if not s.confirmed:
            self._emit_start(now, events)
        s.pending_end = _PendingEnd(s.current_segment_id, s.padded_start_sample, raw_end)

    def _settle(self, now: int, events: list[SegmentEvent]) -> None:
        """Emit what `now` decides: a start certain to outlast min speech, an end whose padding
        has fully elapsed (no later onset can clip it any more)."""
        s, lim = self.state, self._limits
        if s.pending_end is not None and s.pending_end.raw_end_sample + lim.pad <= now:
            self._emit_end(s.pending_end.raw_end_sample + lim.pad, now, events)
        if s.triggered and not s.confirmed:
            # the segment's end can be no earlier than this (the pause's start, or the window end)
            earliest_end = s.silence_start_sample if s.silence_start_sample is not None else now
            if earliest_end - s.raw_start_sample > lim.min_speech:
                self._emit_start(now, events)

    def _emit_start(self, now: int, events: list[SegmentEvent]) -> None:
        s = self.state
        s.confirmed = True
        s.padded_start_sample = max(s.raw_start_sample - self._limits.pad, s.last_end_sample, 0)
        events.append(SegmentStart(s.current_segment_id, s.padded_start_sample, now))

    def _emit_end(self, end_sample: int, now: int, events: list[SegmentEvent]) -> None:
        s = self.state
        pending = s.pending_end
        assert pending is not None  # called with an end pending
        events.append(SegmentEnd(pending.segment_id, pending.start_sample, end_sample, now))
        s.last_end_sample = end_sample
        s.pending_end = None


class StreamingVad:
    """One audio stream -> segment events. `push()` PCM pieces of any size as they arrive,
    `flush()` at the end. State is constant-size (see the module docstring).

    `vad`: the SileroVad to run, reset here and owned by this stream from now on; give each stream
    its own (`SileroVad.new_stream()` shares the loaded model). None loads the model.
    """

    def __init__(self, options: VadOptions = VadOptions(), vad: SileroVad | None = None, first_segment_id: int = 0):
        self.options = options
        self.vad = vad if vad is not None else SileroVad()
        self.vad.reset()
        self.segmenter = SpeechSegmenter(options, first_segment_id)
        self._samples_seen = 0

    @property
    def samples_seen(self) -> int:
        return self._samples_seen

    def push(self, pcm) -> list[SegmentEvent]:
        """Feed the next piece of audio (16 kHz mono); return the events it decided."""
        x = _as_pcm(pcm)
        self._samples_seen += x.size
        probabilities = self.vad.push(x)
        return self.segmenter.push(probabilities) if probabilities.size else []

    def finalize(self) -> list[SegmentEvent]:
        """Finalize on request (`SpeechSegmenter.finalize`): the events it decides now."""
        return self.segmenter.finalize()

    def flush(self) -> list[SegmentEvent]:
        """End of stream: close any open segment; return the last events, then reset."""
        events = self.segmenter.finish(self.vad.flush(), self._samples_seen)
        self._samples_seen = 0
        return events

    def resume(self, sample: int, vad_state: np.ndarray, vad_context: np.ndarray, last_end_sample: int,
               next_segment_id: int) -> None:
        """Go on from a stream's idle state `sample` samples in (`SileroVad.snapshot` and the
        segmenter's fields there): the next sample pushed is the stream's sample `sample`."""
        self.segmenter.resume(sample, last_end_sample, next_segment_id)
        self.vad.restore(vad_state, vad_context)
        self._samples_seen = sample


def segments_from_events(events: list[SegmentEvent]) -> list[SpeechSegment]:
    """The closed segments among `events`, in order."""
    return [SpeechSegment(e.start_sample, e.end_sample) for e in events if isinstance(e, SegmentEnd)]


def get_speech_timestamps(audio, options: VadOptions = VadOptions(),
                          vad: SileroVad | None = None) -> list[SpeechSegment]:
    """Speech segments of a whole 16 kHz mono recording: the streaming machine in one push."""
    stream = StreamingVad(options, vad)
    events = stream.push(audio) + stream.flush()
    return segments_from_events(events)
