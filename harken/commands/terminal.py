"""What the commands print on a terminal: a transcript as text, JSON lines, SRT or WebVTT as it comes
(`TranscriptPrinter`), and the live view of `harken demo` (`LiveView`)."""

from __future__ import annotations

import json

from ..shared.errors import HarkenError


FORMATS = ("text", "json", "srt", "vtt")


class TranscriptPrinter:
    """What `harken stream` prints as events arrive, in one of `FORMATS`:

    text  committed text solid, partial text dimmed (`LiveView`)
    json  one object per event (`TranscriptEvent.as_dict`), then `{"final": true, "text": ...}`;
          with word timings, after each final segment `{"word_timings": SegmentTimings.as_dict()}`;
          the VAD's turn events as they come, `{"type": "speech_started" | "utterance_end", ...}`
          (`TurnEvent.as_dict`); with speaker labels, finals carry "speaker" and a relabel of a
          recent segment is `{"relabel": SpeakerChange.as_dict()}`
    srt   one SubRip cue per segment, written when the segment is final (shared/subtitles.py);
          `word_cues`: one cue per word, once the segment's word timings are in (`WordCues`)
    vtt   the same as WebVTT (its header first)

    `word_timings`: the stream asks for them (`--word-timings`, JSON lines); `word_cues` implies it.
    """

    def __init__(self, out, output_format: str = "text", word_timings: bool = False, word_cues: bool = False):
        from ..shared.subtitles import SubtitleCues, WordCues, vtt_header
        from ..shared.text import TranscriptText

        if output_format not in FORMATS:
            raise HarkenError(f"--format: one of {', '.join(FORMATS)}, got {output_format!r}")
        if word_cues and output_format not in ("srt", "vtt"):
            raise HarkenError("--word-cues goes with --format srt or vtt (a cue per word)")
        if word_timings and not word_cues and output_format != "json":
            raise HarkenError("--word-timings goes with --json (a JSON line per final segment); for subtitles "
                              "with a cue per word: --format srt|vtt --word-cues")
        self.out, self.format = out, output_format
        self.view = LiveView(out) if output_format == "text" else None
        self.text = TranscriptText()
        self.cues = SubtitleCues()
        self.word_cues = WordCues() if word_cues else None
        self.asks_timings = word_timings or word_cues  # the stream should ask for word timings
        self.asks_turns = output_format == "json"  # ... and turn events
        if output_format == "vtt":
            out.write(vtt_header())
            out.flush()

    def show(self, event) -> None:
        """A `TranscriptEvent`, a final segment's `SegmentTimings`, a `TurnEvent` or a `SpeakerChange`."""
        from ..shared.transcript import SegmentTimings, SpeakerChange, TurnEvent

        if isinstance(event, SpeakerChange):  # (subtitles and the live view keep the label a cue went out with)
            if self.format == "json":
                print(json.dumps({"relabel": event.as_dict()}), file=self.out, flush=True)
            return
        if isinstance(event, TurnEvent):
            if self.format == "json":
                print(json.dumps(event.as_dict()), file=self.out, flush=True)
            return
        if self.view is not None:
            if not isinstance(event, SegmentTimings):
                self.view.show(event)
            return
        if self.format == "json":
            if isinstance(event, SegmentTimings):
                print(json.dumps({"word_timings": event.as_dict()}, ensure_ascii=False), file=self.out, flush=True)
                return
            self.text.add(event)
            print(json.dumps(event.as_dict(), ensure_ascii=False), file=self.out, flush=True)
            return
        if self.word_cues is not None:
            self._write(self.word_cues.add(event))
            return
        if isinstance(event, SegmentTimings):
            return
        cue = self.cues.add(event)
        if cue is not None:
            self._write([cue])

    def no_timings(self) -> None:
        """None will come (a server without an aligner): held segment cues go out, later ones at once."""
        if self.word_cues is not None:
            self._write(self.word_cues.flush())
            self.cues = self.word_cues.segments
            self.word_cues = None

    def _write(self, cues) -> None:
        from ..shared.subtitles import srt_cue, vtt_cue

        for cue in cues:
            self.out.write(srt_cue(cue) if self.format == "srt" else vtt_cue(cue))
        self.out.flush()

    def close(self, finished: bool = True) -> None:
        """After the last event (`finished`: the stream ended normally, not by an error)."""
        if self.view is not None:
            self.view.close()
        elif self.word_cues is not None:
            self._write(self.word_cues.flush())
        elif self.format == "json" and finished:
            print(json.dumps({"final": True, "text": self.text.text}, ensure_ascii=False), file=self.out, flush=True)


class LiveView:
    """Terminal rendering of transcript events: the open segment's committed text, then its
    partial text (dimmed), rewritten in place (`\\r`) on a TTY; elsewhere one plain line per event
    (partial lines marked `~ `). A final segment's line stays. The embedded `harken stream` prints
    the same way."""

    def __init__(self, out):
        self.out = out
        self.tty = out.isatty()
        self.text: dict[int, str] = {}
        self.width = 0

    def show(self, event) -> None:
        text = self.text.get(event.segment_id, "") + event.committed_delta
        self.text[event.segment_id] = text
        if event.is_final and getattr(event, "speaker", ""):
            text = f"{event.speaker}: {text}"
        partial = event.partial.strip()
        sep = " " if text and partial else ""
        if not self.tty:
            print(("" if event.is_final else "~ ") + text + sep + partial, file=self.out, flush=True)
            return
        import shutil

        # the tail of the line that fits; the partial part dimmed
        cols = max(shutil.get_terminal_size().columns - 1, 10)
        tail = (sep + partial)[-cols:]
        head = text[max(len(text) - (cols - len(tail)), 0):] if cols > len(tail) else ""
        dim = f"\x1b[2m{tail}\x1b[0m" if tail else ""
        self.out.write("\r\x1b[K" + head + dim + ("\n" if event.is_final else ""))
        self.out.flush()
        self.width = 0 if event.is_final else len(head) + len(tail)

    def close(self) -> None:
        if self.tty and self.width:
            self.out.write("\n")
            self.out.flush()
