"""Word timings for committed segments: the aligner's side of the live path, batched and bounded.

A stream's committed text never changes, so each committed (final) segment can be aligned once and its
words' times sent as an addition that refers to it by segment id. This module is that step, apart from
the engine's tick loop so the tick only has to call it:

    timings = SegmentAligner(Qwen3ForcedAligner.load(MODEL), max_batch=8, max_frames=3000)
    timings.submit(sid, segment_id, features, committed_text, start_s)  # on a final event, if asked for
    for sid, words in timings.step():                                   # once per tick, when pending()
        send(sid, words)                                                # SegmentWords, stream times

`step` aligns the oldest waiting segments, first come first served, in ONE aligner pass (one encoder
batch and one packed decoder pass) of at most `max_batch` segments and `max_frames` feature frames (a
longer segment goes alone), so a pass is bounded like the engine's other passes. Results do not depend
on the batch (`Qwen3ForcedAligner.align_batch`). A segment whose text has no words gives an empty
`SegmentWords` at no model cost; a closed session's waiting segments are dropped with `drop(sid)`.
Sessions that never submit pay nothing.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..model.aligner import AlignedWord, AlignRequest, Qwen3ForcedAligner
from ...shared.transcript import SegmentTimings, TimedWord
from ..model.prompt import forced_language
from ...shared.codec import decode_frames

log = logging.getLogger("harken.server")
_UNSPLIT_LANGUAGES = ("japanese", "korean")  # their word splitting needs dictionaries harken does not ship


@dataclass(frozen=True)
class SegmentWords:
    """The words of one committed segment with their times on the stream's timeline (seconds)."""

    segment_id: int
    words: tuple[AlignedWord, ...]

    def as_dict(self) -> dict:
        return {"segment_id": self.segment_id, "words": [w.as_dict() for w in self.words]}

    def shared(self) -> SegmentTimings:
        """As the wire's `WordTimings` carry it (shared/transcript.py)."""
        return SegmentTimings(self.segment_id, tuple(TimedWord(w.text, w.start, w.end) for w in self.words))


@dataclass
class _Pending:
    key: str
    segment_id: int
    features: np.ndarray
    text: str
    start_s: float
    language: str = "English"
    frames: int = field(init=False)

    def __post_init__(self) -> None:
        self.frames = int(self.features.shape[-1])


class SegmentAligner:
    def __init__(self, aligner: Qwen3ForcedAligner, max_batch: int = 8, max_frames: int = 3000):
        if max_batch < 1 or max_frames < 1:
            raise ValueError("max_batch and max_frames must be >= 1")
        self.aligner = aligner
        self.max_batch = max_batch
        self.max_frames = max_frames
        # the longest segment the aligner's time bins reach (longer ones get no words)
        self.reach_frames = int(aligner.config.classify_num * aligner.config.timestamp_segment_time / 10)
        self._queue: deque[_Pending] = deque()
        self._lock = threading.Lock()  # submit/drop from the event loop, step from the engine thread

    def submit(self, key: str, segment_id: int, features: np.ndarray | None, text: str, start_s: float,
               language: str = "English") -> None:
        """Queue one committed segment: its normalised log-mel [128, T] as the recogniser saw it, its
        committed text, and where it starts on the stream (seconds). A segment the aligner cannot time
        (no frames, longer than its bins reach, Japanese or Korean) is queued with no text: `step`
        gives it an empty `SegmentWords` at no model cost, in its turn."""
        language = language or "English"
        if (features is None or features.shape[-1] == 0 or features.shape[-1] > self.reach_frames
                or language.strip().lower() in _UNSPLIT_LANGUAGES):
            features, text = np.zeros((128, 0), np.float32), ""
        item = _Pending(key, segment_id, np.asarray(features), text, float(start_s), language)
        with self._lock:
            self._queue.append(item)

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def drop(self, key: str) -> int:
        """Forget a session's waiting segments (it closed); returns how many."""
        with self._lock:
            keep = deque(p for p in self._queue if p.key != key)
            n = len(self._queue) - len(keep)
            self._queue = keep
        return n

    def _take(self) -> list[_Pending]:
        with self._lock:
            batch: list[_Pending] = []
            frames = 0
            while self._queue and len(batch) < self.max_batch:
                nxt = self._queue[0]
                if batch and frames + nxt.frames > self.max_frames:
                    break
                batch.append(self._queue.popleft())
                frames += nxt.frames
            return batch

    def step(self) -> list[tuple[str, SegmentWords]]:
        """One bounded aligner pass over the oldest waiting segments -> (key, SegmentWords) each. If
        the pass raises, its segments get no words (logged): a session waiting for them goes on."""
        batch = self._take()
        if not batch:
            return []
        try:
            results = self.aligner.align_batch([AlignRequest(p.features, p.text, p.language) for p in batch])
        except Exception:  # noqa: BLE001 - timings are an addition: their failure must not stop a stream
            log.exception("aligner pass over %d segments failed: they get no word timings", len(batch))
            results = [[] for _ in batch]
        return [(p.key, SegmentWords(p.segment_id, on_stream(words, p.start_s, p.frames / 100)))
                for p, words in zip(batch, results)]


def on_stream(words: list[AlignedWord], start_s: float, duration_s: float) -> tuple[AlignedWord, ...]:
    """A segment's word times (from its start) -> times on the stream: each kept within the segment's
    audio (the aligner's bins reach far past a short segment; a word said in it ends in it), then
    shifted by its start. Clamping keeps the order, so times stay non-decreasing."""
    def at(t: float) -> float:
        return round(start_s + min(max(t, 0.0), duration_s), 3)

    return tuple(AlignedWord(w.text, at(w.start), at(w.end)) for w in words)


# --- each session's side: frames and text of its segments until their finals ---------------------------

class SegmentTap:
    """Keeps each segment's normalised log-mel as the engine receives it (the codec's floored raw
    log10-mel, normalised (x + 4) / 4 as the engine does) and its committed text, until the segment's
    final event: then `on_event` hands both over, for `SegmentAligner.submit`."""

    def __init__(self) -> None:
        self._frames: dict[int, list[np.ndarray]] = {}
        self._text: dict[int, list[str]] = {}

    def add(self, packet) -> None:
        """An edge packet (its payload decoded here)."""

        self.add_frames(packet.segment_id, decode_frames(packet.payload))

    def add_frames(self, segment_id: int, frames: np.ndarray) -> None:
        """A packet's decoded frames [128, k] (floored raw log10-mel), in order."""
        if frames.shape[1]:
            self._frames.setdefault(segment_id, []).append((frames + 4.0) / 4.0)

    def take(self, segment_id: int) -> np.ndarray | None:
        parts = self._frames.pop(segment_id, None)
        return np.concatenate(parts, axis=1) if parts else None

    def on_event(self, event) -> tuple[np.ndarray | None, str] | None:
        """A transcript event of the session: on a final, (the segment's features, its committed
        text), and the segment is forgotten; else None."""
        self._text.setdefault(event.segment_id, []).append(event.committed_delta)
        if not event.is_final:
            return None
        return self.take(event.segment_id), "".join(self._text.pop(event.segment_id, []))


def segment_language(detected: str, requested: str | None) -> str:
    """The language to split a segment's words in: the one its final event names, else the one the
    session forced (canonical name), else English."""

    return detected or forced_language(requested or None) or "English"
