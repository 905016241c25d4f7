"""The transcript events both sides speak: what the engine emits, the service sends as a proto
`Transcript` (or `WordTimings`), and the SDK yields. Riva/Google StreamingRecognize conventions."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TranscriptEvent:
    """One transcript update of a segment.

    committed_delta: text committed now, appended to the segment's text and never retracted;
    partial: the current guess after all committed text (replaces the previous partial);
    stability: 0..1, how likely the partial is to survive; start_s/end_s: the segment's start and
    the end of the audio this event covers, on the stream's timeline; language: "" when unknown;
    is_final: the segment is finished, all its text committed, partial empty.
    """

    segment_id: int
    committed_delta: str
    partial: str
    stability: float
    start_s: float
    end_s: float
    language: str
    is_final: bool

    def as_dict(self) -> dict:
        """The JSON form (`harken stream --json`): exactly these eight keys."""
        return {"segment_id": self.segment_id, "committed_delta": self.committed_delta,
                "partial": self.partial, "stability": self.stability, "start_s": self.start_s,
                "end_s": self.end_s, "language": self.language, "is_final": self.is_final}


@dataclass(frozen=True)
class TimedWord:
    """One word of committed text and when it was said, on the stream's timeline (seconds)."""

    text: str
    start_s: float
    end_s: float

    def as_dict(self) -> dict:
        """The JSON form: {"text", "start", "end"} (as `harken align --json` prints a word)."""
        return {"text": self.text, "start": self.start_s, "end": self.end_s}


@dataclass(frozen=True)
class SegmentTimings:
    """The words of one final segment's committed text with their times (the forced aligner's), sent
    after that segment's final event. It refers to the committed text and never changes it: `words`
    are that text's words as the aligner splits them (`cloud/model/aligner.split_words`), in order.
    Empty: nothing to time (no words; a language the aligner cannot split)."""

    segment_id: int
    words: tuple[TimedWord, ...]

    def as_dict(self) -> dict:
        """The JSON form (`harken stream --json --word-timings`, inside {"word_timings": ...})."""
        return {"segment_id": self.segment_id, "words": [w.as_dict() for w in self.words]}
