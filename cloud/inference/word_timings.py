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

import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from harken.cloud.model.aligner import AlignedWord, AlignRequest, Qwen3ForcedAligner


@dataclass(frozen=True)
class SegmentWords:
    """The words of one committed segment with their times on the stream's timeline (seconds)."""

    segment_id: int
    words: tuple[AlignedWord, ...]

    def as_dict(self) -> dict:
        return {"segment_id": self.segment_id, "words": [w.as_dict() for w in self.words]}


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
        self._queue: deque[_Pending] = deque()
        self._lock = threading.Lock()  # submit/drop from the event loop, step from the engine thread

    def submit(self, key: str, segment_id: int, features: np.ndarray, text: str, start_s: float,
               language: str = "English") -> None:
        """Queue one committed segment: its normalised log-mel [128, T] as the recogniser saw it, its
        committed text, and where it starts on the stream (seconds)."""
        item = _Pending(key, segment_id, np.asarray(features), text, float(start_s), language or "English")
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
        """One bounded aligner pass over the oldest waiting segments -> (key, SegmentWords) each."""
        batch = self._take()
        if not batch:
            return []
        results = self.aligner.align_batch([AlignRequest(p.features, p.text, p.language) for p in batch])
        out = []
        for p, words in zip(batch, results):
            shifted = tuple(AlignedWord(w.text, round(p.start_s + w.start, 3), round(p.start_s + w.end, 3))
                            for w in words)
            out.append((p.key, SegmentWords(p.segment_id, shifted)))
        return out


# --- the embedded path (`harken stream --json --word-timings`) --------------------------------------------

class SegmentTap:
    """Keeps each segment's normalised log-mel as the engine receives it (edge packets: the codec's
    floored raw log10-mel, normalised (x + 4) / 4 as the engine does), until the segment is final."""

    def __init__(self) -> None:
        self._frames: dict[int, list[np.ndarray]] = {}

    def add(self, packet) -> None:
        from harken.shared.codec import decode_frames

        frames = decode_frames(packet.payload)
        self._frames.setdefault(packet.segment_id, []).append((frames + 4.0) / 4.0)

    def take(self, segment_id: int) -> np.ndarray | None:
        parts = self._frames.pop(segment_id, None)
        return np.concatenate(parts, axis=1) if parts else None


def stream_with_word_timings(pieces, engine, options, timings: SegmentAligner, codec_mode: str | None = None):
    """`embedded.stream_pieces` that also yields a `SegmentWords` after each final event: the words of
    that segment's committed text (never changed) with their times on the stream's timeline."""
    from harken.cloud.embedded import stream_pieces
    from harken.shared.codec import DEFAULT_MODE

    tap = SegmentTap()
    committed: dict[int, list[str]] = {}
    key = "embedded"
    for event in stream_pieces(pieces, engine, options, codec_mode or DEFAULT_MODE, on_packet=tap.add):
        committed.setdefault(event.segment_id, []).append(event.committed_delta)
        yield event
        if event.is_final:
            feats = tap.take(event.segment_id)
            text = "".join(committed.pop(event.segment_id, []))
            language = event.language or _canonical(options.language) or "English"
            if feats is None or feats.shape[1] == 0 or language.lower() in ("japanese", "korean"):
                yield SegmentWords(event.segment_id, ())
                continue
            timings.submit(key, event.segment_id, feats, text, event.start_s, language)
            while timings.pending():
                for _, words in timings.step():
                    yield words


def _canonical(language: str | None) -> str | None:
    from harken.cloud.model.prompt import forced_language

    return forced_language(language)
