"""The session protocol's messages as plain data: `proto/harken.proto` (harken.v1) without proto.

One type per concept, on both sides of the wire: a feature packet, the resume seed, the messages
of one `Transcription/Stream` call. Proto names stay at the wire boundary (`shared/wire.py`, both
ways); everything inside works with these. The session semantics are documented in the proto.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .features_spec import FRAMES_PER_SECOND
from .transcript import SPEECH_STARTED, UTTERANCE_END, SegmentTimings, SpeakerChange, TranscriptEvent, TurnEvent


@dataclass(frozen=True)
class FeaturePacket:
    """One `Features` message's worth: frames [first_frame, first_frame + frame_count) of a segment."""

    segment_id: int
    first_frame: int
    frame_count: int
    segment_start: bool
    segment_end: bool
    payload: bytes  # one self-contained codec payload (shared/codec.py)
    # the floor state after these frames (travels with final segments); None from a client older
    # than the field (the server keeps the segment's own)
    running_max_log10: float | None
    # this packet ends its segment because the client asked to finalize (the edge cut its segment
    # there; speech that goes on continues as the next segment): the segment's final says so
    finalized: bool = False

    def turns(self) -> list[TurnEvent]:
        """The turn events this packet decides: its segment's onset and/or its end (frame times)."""
        out = []
        if self.segment_start:
            out.append(TurnEvent(SPEECH_STARTED, self.segment_id, self.first_frame / FRAMES_PER_SECOND))
        if self.segment_end:
            out.append(TurnEvent(UTTERANCE_END, self.segment_id,
                                 (self.first_frame + self.frame_count) / FRAMES_PER_SECOND))
        return out


@dataclass(frozen=True)
class SessionSeed:
    """The little state a session carries from one segment to the next (on every final event), so
    that a replacement session continues exactly where a lost one was."""

    running_max_log10: float
    context_tail: str
    next_segment_id: int
    # Thin clients: the server's front end at a quiet point (opaque bytes, shared/front_end_checkpoint.py), and
    # the sample (in the seeding session's count) a replacement session's audio must start at.
    front_end_state: bytes = b""
    audio_sample: int = 0


# ---- client -> server ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Start:
    """The first message of every call: a new session, a resume (`session_id`, `last_event_seq`)
    or a seeded replacement session (`seed`)."""

    language: str = ""  # "" = detect
    context: str = ""
    codec: str = ""  # the Features payloads' codec; "" when sending Audio
    session_id: str = ""  # "" = a new session
    last_event_seq: int = 0  # on resume: the highest event_seq received
    seed: SessionSeed | None = None
    word_timings: bool = False  # send each final segment's word times (`WordTimings`)
    turn_events: bool = False  # send the VAD's turn events (`Turn`: speech started, utterance end)
    keyterms: tuple[str, ...] = ()  # words and names to expect (Qwen3-ASR's context, after `context`)
    diarize: bool = False  # label each final segment's speaker (`Transcript.speaker`, `SpeakerLabel`)

    @property
    def model_context(self) -> str:
        return model_context(self.context, self.keyterms)


def model_context(context: str, keyterms: tuple[str, ...]) -> str:
    """The context text the model reads (its system turn, as the official package puts `context`):
    the caller's context, then the keyterms, comma-separated, on a line of their own."""
    terms = ", ".join(t.strip() for t in keyterms if t.strip())
    return f"{context}\n{terms}" if context and terms else context or terms


@dataclass(frozen=True)
class Features:
    seq: int  # per session, contiguous from 1
    packet: FeaturePacket


@dataclass(frozen=True)
class Audio:
    """Thin clients: little-endian PCM16 mono; the server runs VAD + features on it."""

    seq: int
    pcm16: bytes
    sample_rate: int

    def samples(self) -> np.ndarray:
        """The PCM as float32 in [-1, 1)."""
        return np.frombuffer(self.pcm16, dtype="<i2").astype(np.float32) / 32768.0


@dataclass(frozen=True)
class Finalize:
    """Close the open segment at the audio received so far; its final follows at once, marked
    `from_finalize`. The session goes on: a thin client's speech that continues after it is the
    next segment. (A feature client cuts its own segment: `FeaturePacket.finalized`.)"""


@dataclass(frozen=True)
class End:
    """No more input: the server finalises, sends the last finals, closes the call with OK."""


@dataclass(frozen=True)
class KeepAlive:
    """Nothing to send for a while (a feature client in silence): the server's idle timeout must
    not take the stream for an abandoned one."""


@dataclass(frozen=True)
class Configure:
    """Change what the model is told from the session's next audio item on (the item in progress
    keeps its prompt): `keyterms` replace the session's, `context` (None: unchanged) replaces its
    context. Not acknowledged; a client sends its latest again after a reconnect."""

    keyterms: tuple[str, ...] = ()
    context: str | None = None


ClientMessage = Start | Features | Audio | Finalize | End | KeepAlive | Configure


# ---- server -> client ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Ready:
    session_id: str
    resume_after_seq: int  # the highest seq applied: the client resends everything after it
    last_final_segment: int = -1
    keep_alive: bool = False  # the server takes KeepAlive: the client writes them only then
    word_timings: bool = False  # the session asked for word timings and this server sends them
    turn_events: bool = False  # the session asked for turn events and this server sends them
    diarize: bool = False  # the session asked for speaker labels and this server gives them


@dataclass(frozen=True)
class Transcript:
    event: TranscriptEvent
    event_seq: int  # per session from 1, for replay after a resume
    seed: SessionSeed | None = None  # on final events

    @property
    def segment_id(self) -> int:
        return self.event.segment_id


@dataclass(frozen=True)
class WordTimings:
    """A final segment's word times (sessions that asked): in the event log with the Transcripts."""

    timings: SegmentTimings
    event_seq: int  # counts on with the Transcripts' event_seq

    @property
    def segment_id(self) -> int:
        return self.timings.segment_id


@dataclass(frozen=True)
class Turn:
    """A turn event (sessions that asked, `Start.turn_events`): in the event log with the Transcripts,
    sent as soon as the frames that decide it are applied."""

    turn: TurnEvent
    event_seq: int

    @property
    def segment_id(self) -> int:
        return self.turn.segment_id


@dataclass(frozen=True)
class SpeakerLabel:
    """A better speaker for a segment already final (sessions that asked, `Start.diarize`): in the
    event log with the Transcripts. Additive: the segment's text never changes."""

    change: SpeakerChange
    event_seq: int

    @property
    def segment_id(self) -> int:
        return self.change.segment_id


@dataclass(frozen=True)
class Ack:
    seq: int  # the highest client seq applied
    last_final_segment: int = -1  # the highest segment id final (-1: none)


@dataclass(frozen=True)
class ServerError:
    """The server's last message before it ends the call with the status `code` (a gRPC status
    code name, e.g. "INVALID_ARGUMENT")."""

    code: str
    message: str


ServerMessage = Ready | Transcript | WordTimings | Turn | SpeakerLabel | Ack | ServerError
# what a session's event log holds (and replays after a resume), in event_seq order
LoggedEvent = Transcript | WordTimings | Turn | SpeakerLabel
