"""Subtitles from a transcript: one cue per finished segment, in SRT or WebVTT.

    cues = SubtitleCues()
    for event in events:                       # TranscriptEvents, as the engine or the SDK gives them
        cue = cues.add(event)                  # a Cue when `event` finishes its segment, else None
        if cue is not None:
            out.write(srt_cue(cue))            # or vtt_cue(cue), after vtt_header()

A cue's times are its segment's: from the segment's start to the end of the audio its final
covers, on the stream's timeline. A long segment is one cue (its text wrapped into lines of at most
`LINE_CHARS`), never split at guessed times. With speaker labels a cue names its segment's speaker:
"S1: " before its text in SRT, a voice span `<v S1>` in WebVTT. Segments that end with no words make no cue. Cues are
numbered 1, 2, ... in the order segments finish (segments of one stream finish in order).

Word-level cues (`WordCues`, `harken stream --format srt|vtt --word-cues`): with word timings (the
forced aligner's `SegmentTimings`, which follow each final), one cue per word instead: the word as the
aligner splits it (punctuation dropped), from its start to its end. A segment whose timings have no
words, or never come (`flush`: a server without an aligner), keeps its segment cue.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass

from .text import TranscriptText
from .transcript import SegmentTimings

LINE_CHARS = 42  # the usual broadcast limit per subtitle line


@dataclass(frozen=True)
class Cue:
    index: int  # 1-based, in order
    start_s: float
    end_s: float
    text: str
    speaker: str = ""  # with speaker labels: who said it (SRT "S1: " before the text, WebVTT <v S1>)


class SubtitleCues:
    """Finished segments -> cues, as events arrive (anything shaped like a `TranscriptEvent`)."""

    def __init__(self) -> None:
        self.text = TranscriptText()
        self.count = 0

    def add(self, event) -> Cue | None:
        words = self.text.add(event).strip()
        if not event.is_final or not words:
            return None
        self.count += 1
        return Cue(self.count, max(0.0, event.start_s), max(event.start_s, event.end_s), words,
                   getattr(event, "speaker", ""))


class WordCues:
    """Final segments and their word timings -> word-level cues, in order, numbered 1, 2, ... Each
    segment's cue is held until its timings come (they follow its final event)."""

    def __init__(self) -> None:
        self.segments = SubtitleCues()
        self.held: dict[int, Cue] = {}  # segment id -> its segment cue, waiting for its timings
        self.count = 0

    def add(self, item) -> list[Cue]:
        """A transcript event or a `SegmentTimings` -> the cues now complete."""
        if not isinstance(item, SegmentTimings):
            cue = self.segments.add(item)
            if cue is not None:
                self.held[item.segment_id] = cue
            return []
        # segments before this one whose timings never came keep their segment cues
        out = [self._number(self.held.pop(k)) for k in sorted(self.held) if k < item.segment_id]
        cue = self.held.pop(item.segment_id, None)
        if item.words:
            out += [self._number(Cue(0, max(0.0, w.start_s), max(w.start_s, w.end_s), w.text)) for w in item.words]
        elif cue is not None:
            out.append(self._number(cue))
        return out

    def flush(self) -> list[Cue]:
        """The held segment cues (no timings came for them), in order."""
        return [self._number(self.held.pop(k)) for k in sorted(self.held)]

    def _number(self, cue: Cue) -> Cue:
        self.count += 1
        return Cue(self.count, cue.start_s, cue.end_s, cue.text)


def cues_of(events) -> list[Cue]:
    """Every cue of a finished stream's events."""
    acc = SubtitleCues()
    return [c for c in (acc.add(e) for e in events) if c is not None]


def timestamp(seconds: float, separator: str) -> str:
    """HH:MM:SS,mmm (SRT, separator ',') or HH:MM:SS.mmm (WebVTT, '.'), rounded to the millisecond."""
    if not math.isfinite(seconds) or seconds < 0:
        seconds = 0.0
    ms = int(round(seconds * 1000))
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{separator}{ms:03d}"


def _lines(text: str) -> str:
    # a cue's text may not hold a blank line (it would end the cue) nor, in WebVTT, the arrow
    flat = " ".join(text.replace("-->", "->").split())
    return "\n".join(textwrap.wrap(flat, LINE_CHARS, break_long_words=False, break_on_hyphens=False)) or flat


def srt_cue(cue: Cue) -> str:
    text = f"{cue.speaker}: {cue.text}" if cue.speaker else cue.text
    return (f"{cue.index}\n{timestamp(cue.start_s, ',')} --> {timestamp(cue.end_s, ',')}\n"
            f"{_lines(text)}\n\n")


def vtt_header() -> str:
    return "WEBVTT\n\n"


def vtt_cue(cue: Cue) -> str:
    # a voice span (WebVTT's <v>) names the speaker; its name may not hold '>' or a line break
    text = _lines(cue.text)
    if cue.speaker:
        text = f"<v {cue.speaker.replace('>', '')}>{text}"
    return f"{cue.index}\n{timestamp(cue.start_s, '.')} --> {timestamp(cue.end_s, '.')}\n{text}\n\n"


def srt(cues: list[Cue]) -> str:
    return "".join(srt_cue(c) for c in cues)


def vtt(cues: list[Cue]) -> str:
    return vtt_header() + "".join(vtt_cue(c) for c in cues)
