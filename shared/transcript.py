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
    is_final: the segment is finished, all its text committed, partial empty; from_finalize: this
    final came because the client asked to finalize (`Finalize`, or an edge that cut its segment
    on request) rather than by the VAD's end of speech or the input's end.
    """

    segment_id: int
    committed_delta: str
    partial: str
    stability: float
    start_s: float
    end_s: float
    language: str
    is_final: bool
    from_finalize: bool = False
    # on an item's final pass: each word of the item's text (whitespace-separated), its confidence
    # (the mean probability the model gave the word's tokens: in the pass that committed each one);
    # () where unknown (the vLLM decoder)
    word_confidence: tuple[float, ...] = ()
    # on final events of sessions that asked for speaker labels (`Start.diarize`): who said the
    # segment, "S1", "S2", ... (stable for the session; a later `SpeakerChange` may move it); else ""
    speaker: str = ""

    def as_dict(self) -> dict:
        """The JSON form (`harken stream --json`): these nine keys, and "speaker" when labelled."""
        out = {"segment_id": self.segment_id, "committed_delta": self.committed_delta,
               "partial": self.partial, "stability": self.stability, "start_s": self.start_s,
               "end_s": self.end_s, "language": self.language, "is_final": self.is_final,
               "from_finalize": self.from_finalize}
        if self.speaker:
            out["speaker"] = self.speaker
        return out


SPEECH_STARTED = "speech_started"
UTTERANCE_END = "utterance_end"


@dataclass(frozen=True)
class TurnEvent:
    """A turn boundary as the VAD knows it, sent at once, never waiting for text.

    kind: `SPEECH_STARTED` (a segment opens; `audio_s` is its onset, padded as the VAD pads it) or
    `UTTERANCE_END` (the segment's speech is over; `audio_s` is its end, the VAD's end of the last
    word plus the VAD's padding, or where a finalize cut it). Times on the stream's timeline, as
    `TranscriptEvent.start_s`. Every segment has exactly one of each, in that order, and its
    `UTTERANCE_END` comes before its final `TranscriptEvent`.
    """

    kind: str
    segment_id: int
    audio_s: float

    def as_dict(self) -> dict:
        """The JSON form (`harken stream --json`): {"type", "segment_id", "audio_s"}."""
        return {"type": self.kind, "segment_id": self.segment_id, "audio_s": self.audio_s}


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


@dataclass(frozen=True)
class SpeakerChange:
    """A better speaker label for a final segment sent before (sessions that asked, `Start.diarize`):
    the segment `segment_id` was said by `speaker`. Additive: the segment's text and times stay as
    they are; only who said it changes. Later changes of one segment replace earlier ones."""

    segment_id: int
    speaker: str

    def as_dict(self) -> dict:
        """The JSON form (`harken stream --json --diarize`, inside {"relabel": ...})."""
        return {"segment_id": self.segment_id, "speaker": self.speaker}
