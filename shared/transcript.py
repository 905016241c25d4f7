"""The transcript event both sides speak: what the engine emits, the service sends as a proto
`Transcript`, and the SDK yields. Riva/Google StreamingRecognize conventions."""

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
