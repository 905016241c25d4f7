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
