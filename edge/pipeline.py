"""The edge pipeline: PCM -> VAD-gated, compressed feature packets, ready for the transport.

Every sample goes through the streaming log-mel (frames are final 12.5 ms after their centre) and
the running-max floor; silero-vad decides which frames belong to speech. Frames of a segment leave
in packets of `packet_frames` (default 20 = 200 ms), each an independent codec payload tagged with
the segment, its first frame index and start/end flags, which maps 1:1 onto the wire's `Features`
message. Silence sends nothing.

The VAD confirms a start only after `min_speech_duration_ms` and reports it `speech_pad_ms` early,
so the stream keeps the last few hundred ms of frames while idle (`lookback_frames`, derived from
the VAD's documented worst-case delay); memory stays constant however long the stream runs.

Frames of an open segment leave as soon as they are final and the VAD can no longer end the
segment before them (`SpeechSegmenter.earliest_end_sample`): while speech goes on that bound runs
ahead of the audio, so words are not held back; inside a pause, frames past the pause's start plus
the padding wait until the pause ends or ends the segment. So a segment's packets end exactly at
the VAD's end (on the frame grid), and what a stream sends is a function of its samples alone,
never of how they were cut into pieces: the same audio in 20 ms pieces or in one gives the same
packets, byte for byte.

On the frame grid a segment [start_sample, end_sample) is frames [start_sample // 160,
ceil(end_sample / 160)) — the frames centred inside it — except that a start never goes before the
previous segment's end frame (two segments 0.01 s apart share no frame).

Checkpoints (shared/front_end_checkpoint.py): `checkpoint()` gives the stream's whole state at a quiet point on
the `CHECKPOINT_SAMPLES` grid, and `FeatureStream.resume(checkpoint)` a stream that, fed the audio
from the checkpoint's `replay_from` on, sends exactly what this one sent after it. A thin client's
server takes them, so that a replacement session continues the lost one by construction.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field, fields

import numpy as np

from ..shared.front_end_checkpoint import FrontEndCheckpoint
from .features import StreamingLogMel, first_frame_from
from .vad import WINDOW_SAMPLES, SegmentEnd, SegmentStart, StreamingVad, VadOptions
from ..shared.codec import DEFAULT_MODE, MAX_PACKET_FRAMES, encode_frames
from ..shared.features_spec import DYNAMIC_RANGE_LOG10, HOP_LENGTH, N_MELS, SAMPLE_RATE, RunningMaxFloor
from ..shared.integrity import payload_crc32c
from ..shared.protocol import FeaturePacket as FeaturePacket  # the packet, one type on both sides

VAD_WINDOW_MS = 32
# Checkpoints lie on multiples of the log-mel hop and the VAD window (160 ms): there the stream's
# frames and windows both start afresh, so the state holds no partial window or frame.
CHECKPOINT_SAMPLES = math.lcm(HOP_LENGTH, WINDOW_SAMPLES)


@dataclass
class StageSeconds:
    """CPU time spent per stage (perf_counter), for the benchmark's real-time factors."""

    vad: float = 0.0
    features: float = 0.0
    codec: float = 0.0


@dataclass
class _Segment:
    segment_id: int
    next_frame: int  # first frame not yet sent
    end_frame: int | None = None  # exclusive; None while the segment is open
    started: bool = False  # a packet with segment_start has gone out
    finalized: bool = False  # ended by a finalize request: its last packet says so


@dataclass
class FeatureStream:
    """One audio stream -> `FeaturePacket`s. `push()` PCM pieces as they arrive, `flush()` at the end."""

    vad_options: VadOptions = field(default_factory=VadOptions)
    mode: str = DEFAULT_MODE
    packet_frames: int = 20
    running_max_log10: float = float("-inf")  # seed from a previous session to continue its floor
    first_segment_id: int = 0  # the first segment's id; later ones count on from it

    def __post_init__(self):
        if not 1 <= self.packet_frames <= MAX_PACKET_FRAMES:
            # more could be refused by the server: a packet at its floor is a 9-byte header
            raise ValueError(f"packet_frames must be 1..{MAX_PACKET_FRAMES}")
        self.vad = StreamingVad(self.vad_options, first_segment_id=self.first_segment_id)
        self.mel = StreamingLogMel()
        self.floor = RunningMaxFloor(self.running_max_log10)
        self.seconds = StageSeconds()
        self.lookback_frames = _lookback_frames(self.vad_options)
        self.settings = settings_digest(self.vad_options, self.mode, self.packet_frames)
        self._frames: deque[np.ndarray] = deque()  # floored [128] frames, oldest first
        self._running: deque[float] = deque()  # the running max after each buffered frame
        self._running_before = self.floor.max_log10  # the running max before self._frames[0]
        self._first_buffered = 0  # absolute index of self._frames[0]
        self._frames_computed = 0
        self._last_end_frame = 0  # end frame (exclusive) of the last segment ended
        self._segments: deque[_Segment] = deque()
        self._samples = 0  # samples of the stream pushed (a resumed stream counts from the start)
        self._vad_from = 0  # a resumed stream's VAD starts at its checkpoint, not at the replay's start
        self._cut_sample = -1  # where the latest finalize ended a segment (the next may start there)

    @property
    def samples(self) -> int:
        """Samples of the stream so far, counted from its start (a resumed one's too)."""
        return self._samples

    def push(self, pcm: np.ndarray) -> list[FeaturePacket]:
        """Feed the next 16 kHz mono float32 piece; return the packets it completed."""
        pcm = np.asarray(pcm, dtype=np.float32)
        t0 = time.perf_counter()
        frames = self.mel.push(pcm)
        t1 = time.perf_counter()
        before_vad = min(max(self._vad_from - self._samples, 0), pcm.size)
        self._samples += pcm.size
        events = self.vad.push(pcm[before_vad:])
        t2 = time.perf_counter()
        self.seconds.features += t1 - t0
        self.seconds.vad += t2 - t1
        return self._advance(frames, events, final=False)

    def flush(self) -> list[FeaturePacket]:
        """End of stream: the remaining frames and the close of any open segment."""
        if self._samples < self._vad_from:
            # a resumed stream that never got back to its checkpoint (which no segment was open
            # at): nothing to close, and too little audio to end the log-mel on
            return []
        t0 = time.perf_counter()
        frames = self.mel.flush(short_ok=True)  # a stream too short for one frame holds no speech
        t1 = time.perf_counter()
        events = self.vad.flush()
        t2 = time.perf_counter()
        self.seconds.features += t1 - t0
        self.seconds.vad += t2 - t1
        return self._advance(frames, events, final=True)

    def finalize(self) -> list[FeaturePacket]:
        """Finalize on request (the speaker stopped; push-to-talk released): the open segment ends
        at the audio pushed so far, its last packet `finalized`, at once. Speech that goes on is
        the next segment (`SpeechSegmenter.finalize`). Nothing open: no packets."""
        events = self.vad.finalize()
        ended = {e.segment_id for e in events if isinstance(e, SegmentEnd)}
        for seg in self._segments:
            seg.finalized = seg.finalized or seg.segment_id in ended
        return self._advance(np.zeros((N_MELS, 0), np.float32), events, final=False)

    def _advance(self, frames: np.ndarray, events, final: bool) -> list[FeaturePacket]:
        t0 = time.perf_counter()
        before = self.floor.max_log10
        floored = self.floor(frames)
        running = np.maximum.accumulate(np.maximum(frames.max(axis=0, initial=-np.inf), before)) \
            if frames.shape[1] else np.zeros(0)
        t_floor = time.perf_counter() - t0
        self._frames.extend(floored.T)
        self._running.extend(running.tolist())
        self._frames_computed += floored.shape[1]
        for e in events:
            if isinstance(e, SegmentStart):
                # the VAD never starts a segment before the previous end, but on the frame grid the
                # two may fall into one frame: it belongs to the earlier segment
                first = max(e.start_sample // HOP_LENGTH, self._first_buffered, self._last_end_frame)
                if e.start_sample == self._cut_sample:  # speech that went on after a finalize: no gap
                    first = self._last_end_frame
                self._segments.append(_Segment(e.segment_id, first))
            elif isinstance(e, SegmentEnd):
                seg = next((s for s in self._segments if s.segment_id == e.segment_id), None)
                if seg is not None:
                    # no frame past the end has gone out: `_open_limit` held them back
                    seg.end_frame = max(seg.next_frame, -(-e.end_sample // HOP_LENGTH))
                    if seg.finalized:  # at once: not a frame past those computed
                        seg.end_frame = max(seg.next_frame, min(seg.end_frame, self._frames_computed))
                        self._cut_sample = e.end_sample
                    self._last_end_frame = seg.end_frame
        packets = self._emit(final)
        self._trim()
        self.seconds.features += t_floor
        return packets

    def _emit(self, final: bool) -> list[FeaturePacket]:
        packets = []
        while self._segments:
            seg = self._segments[0]
            end_frame = seg.end_frame
            limit = self._open_limit() if end_frame is None else min(end_frame, self._frames_computed)
            while limit - seg.next_frame >= self.packet_frames:
                packets.append(self._packet(seg, seg.next_frame + self.packet_frames, end=False))
            closing = end_frame is not None and (end_frame <= self._frames_computed or final)
            if end_frame is None or not closing:
                break
            end = min(end_frame, self._frames_computed)
            packets.append(self._packet(seg, end, end=True))
            self._segments.popleft()
        return packets

    def checkpoint(self) -> FrontEndCheckpoint | None:
        """The stream's state now, if it can be resumed from here (see shared/front_end_checkpoint.py): on the
        `CHECKPOINT_SAMPLES` grid, the VAD idle (no segment open or undecided) and every segment's
        packets out. Else None."""
        sample = self._samples
        if sample % CHECKPOINT_SAMPLES or sample < self._vad_from or self.mel.finished or self._segments \
                or not self.vad.segmenter.idle:
            return None
        replay_from = max(0, sample - replay_lead_samples(self.vad_options))
        first = first_frame_from(replay_from)
        if first < self._first_buffered:
            return None  # trimmed already (never for a stream whose look-back covers the lead)
        state, context = self.vad.vad.snapshot()
        segmenter = self.vad.segmenter.state
        return FrontEndCheckpoint(sample=sample, replay_from=replay_from, vad_state=state, vad_context=context,
                                  last_end_sample=segmenter.last_end_sample,
                                  next_segment_id=segmenter.next_segment_id, last_end_frame=self._last_end_frame,
                                  running_max_log10=self._running_after(first - 1),
                                  settings=self.settings)

    @classmethod
    def resume(cls, checkpoint: FrontEndCheckpoint, vad_options: VadOptions | None = None,
               mode: str = DEFAULT_MODE, packet_frames: int = 20) -> FeatureStream:
        """A stream that goes on from `checkpoint`: fed the stream's audio from
        `checkpoint.replay_from` on, it sends exactly the packets the checkpointed stream sent after
        the checkpoint. ValueError when the checkpoint was made with other settings."""
        options = vad_options if vad_options is not None else VadOptions()
        check_resumable(checkpoint, options, mode, packet_frames)
        cp = checkpoint
        stream = cls(options, mode, packet_frames, running_max_log10=cp.running_max_log10,
                     first_segment_id=cp.next_segment_id)
        if cp.replay_from:
            stream.mel.resume_at(cp.replay_from)
        # frames before the replay's first are never needed again: no segment can start before
        # it (see `replay_lead_samples`), and the running max before it is the checkpoint's
        stream._first_buffered = stream._frames_computed = stream.mel.frames_emitted
        stream._last_end_frame = cp.last_end_frame
        stream._samples, stream._vad_from = cp.replay_from, cp.sample
        stream.vad.resume(cp.sample, cp.vad_state, cp.vad_context, cp.last_end_sample, cp.next_segment_id)
        return stream

    def _open_limit(self) -> int:
        """Frames of the open segment that may leave: those final and before the earliest end
        the VAD can still give it."""
        earliest_end = self.vad.segmenter.earliest_end_sample
        if earliest_end is None:
            return self._frames_computed
        return min(self._frames_computed, -(-earliest_end // HOP_LENGTH))

    def _running_after(self, frame: int) -> float:
        """The running max once frame `frame` was floored (frame -1: before the first frame)."""
        i = frame - self._first_buffered
        return self._running[i] if i >= 0 else self._running_before

    def _packet(self, seg: _Segment, stop: int, end: bool) -> FeaturePacket:
        start = seg.next_frame
        frames = self._slice(start, stop)
        # the floor in force before this packet, so values at the floor cost nothing
        before = self._running_after(start - 1)
        floor = before - DYNAMIC_RANGE_LOG10 if np.isfinite(before) else None
        t0 = time.perf_counter()
        payload = encode_frames(frames, self.mode, floor_log10=floor)
        self.seconds.codec += time.perf_counter() - t0
        # the floor state after this packet's frames, not after every frame computed so far: a
        # function of the samples, whatever the piece that completed the packet held
        packet = FeaturePacket(seg.segment_id, start, stop - start, not seg.started, end, payload,
                               self._running_after(stop - 1), finalized=end and seg.finalized)
        seg.started = True
        seg.next_frame = stop
        return packet

    def _slice(self, start: int, stop: int) -> np.ndarray:
        if stop <= start:
            return np.zeros((N_MELS, 0), np.float32)
        i, j = start - self._first_buffered, stop - self._first_buffered
        return np.stack([self._frames[k] for k in range(i, j)], axis=1)

    def _trim(self) -> None:
        keep_from = self._frames_computed - self.lookback_frames
        if self._segments:
            keep_from = min(keep_from, self._segments[0].next_frame - 1)
        while self._frames and self._first_buffered < keep_from:
            self._frames.popleft()
            self._running_before = self._running.popleft()
            self._first_buffered += 1


def replay_lead_samples(o: VadOptions) -> int:
    """How far before a checkpoint its replay starts. At a checkpoint the VAD is idle, so the next
    segment starts `speech_pad_ms` before it at the earliest; the replay covers that, the frame
    before it (its running max is a packet's floor) and the log-mel window's half (200 samples)."""
    pad_frames = -(-int(round(SAMPLE_RATE * o.speech_pad_ms / 1000)) // HOP_LENGTH)
    lead = HOP_LENGTH * (pad_frames + 2)
    return -(-lead // CHECKPOINT_SAMPLES) * CHECKPOINT_SAMPLES


def settings_digest(o: VadOptions, mode: str, packet_frames: int) -> int:
    """What a checkpoint is only valid with: a stream with other settings would go on differently."""
    described = repr(([(f.name, getattr(o, f.name)) for f in fields(o)], mode, packet_frames))
    return payload_crc32c(described.encode())


def check_resumable(cp: FrontEndCheckpoint, o: VadOptions = VadOptions(), mode: str = DEFAULT_MODE,
                    packet_frames: int = 20) -> None:
    """ValueError unless a stream with these settings can resume from `cp`."""
    if cp.settings != settings_digest(o, mode, packet_frames):
        raise ValueError("made by a front end with other settings (VAD options, codec mode or packet size)")
    if cp.sample % CHECKPOINT_SAMPLES or cp.replay_from != max(0, cp.sample - replay_lead_samples(o)):
        raise ValueError(f"sample {cp.sample} / replay_from {cp.replay_from} are not a checkpoint's")


def _lookback_frames(o: VadOptions) -> int:
    """Frames to keep while idle: the VAD's worst-case start delay (see edge/vad.py), plus margin."""
    worst_ms = o.min_speech_duration_ms + o.min_silence_duration_ms + o.speech_pad_ms + 2 * VAD_WINDOW_MS
    return worst_ms // 10 + 8
