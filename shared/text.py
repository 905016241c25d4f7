"""Transcript text rules both sides share: how the texts of consecutive segments are joined."""

from __future__ import annotations


def join_texts(left: str, right: str) -> str:
    """The separator between consecutive pieces of text (segments, items): a space, except next to
    CJK characters (which are written without spaces) or when either side is empty."""
    if not left or not right:
        return ""
    if _is_cjk(left[-1]) or _is_cjk(right[0]):
        return ""
    return " "


def transcript_text(segment_texts: dict[int, str]) -> str:
    """All committed text of a stream from its per-segment texts, segments in order."""
    text = ""
    for segment_id in sorted(segment_texts):
        piece = segment_texts[segment_id]
        text += join_texts(text, piece) + piece
    return text


def _is_cjk(ch: str) -> bool:
    o = ord(ch)
    return 0x2E80 <= o <= 0x9FFF or 0xAC00 <= o <= 0xD7AF or 0xF900 <= o <= 0xFAFF or 0xFF00 <= o <= 0xFFEF


class TranscriptText:
    """A stream's committed text as its events arrive (anything with `segment_id` and
    `committed_delta`): per segment, joined in segment order on demand."""

    def __init__(self) -> None:
        self.segments: dict[int, str] = {}

    def add(self, event) -> str:
        """Take one event's committed text; returns its segment's text so far."""
        text = self.segments.get(event.segment_id, "") + event.committed_delta
        self.segments[event.segment_id] = text
        return text

    @property
    def text(self) -> str:
        return transcript_text(self.segments)


def events_text(events) -> str:
    """All committed text of a list of events, segments in order."""
    acc = TranscriptText()
    for e in events:
        acc.add(e)
    return acc.text
