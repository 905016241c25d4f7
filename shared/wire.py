"""The wire contract's one mapping: shared/protocol messages <-> `harken.v1` proto messages, both ways.

Proto names appear here and in the network drivers that move these messages as they are; the
client's `ClientSession` and the server's `ServerSession` see only shared/protocol types. Every
name says its direction:

    client sends      client_message_to_proto, features_to_proto, seed_to_proto
    server reads      client_message_from_bytes, client_message_from_proto, require_start,
                      decode_features, front_end_checkpoint
    server sends      server_message_to_proto, transcript_to_proto, word_timings_to_proto, seed_to_proto
    client reads      server_message_from_proto, seed_from_proto

On the way in, everything a message can get wrong on its own (sizes, counts, values, a payload's
checksum, a payload the codec rejects) raises `MalformedMessage` or `CodecError` here, so nothing
malformed gets further in; what depends on the session's state (order, gaps, ownership) is checked
by the server's session core (`cloud/hosting/server_session.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from google.protobuf.message import DecodeError

from ..proto import harken_pb2 as pb
from .codec import (CODEC_NAME, MAX_FRAMES, MAX_FRAMES_PER_PAYLOAD_BYTE, decode_frames,
                                 max_frames_for_payload)
from .errors import MalformedMessage, MessageTooLarge, OutOfOrder
from .features_spec import N_MELS
from .front_end_checkpoint import SIZE as FRONT_END_STATE_BYTES
from .front_end_checkpoint import FrontEndCheckpoint
from .integrity import payload_crc32c
from .protocol import (Ack, Audio, ClientMessage, Configure, End, FeaturePacket, Features, Finalize,
                                    KeepAlive,
                                    Ready, ServerError, ServerMessage, SessionSeed, SpeakerLabel, Start, Transcript,
                                    Turn, WordTimings)
from .transcript import (SPEECH_STARTED, UTTERANCE_END, SegmentTimings, SpeakerChange, TimedWord, TranscriptEvent,
                         TurnEvent)

# Checks a thin client's seeded front-end state against the server's own front end (ValueError if not)
FrontEndCheck = Callable[[FrontEndCheckpoint], None]

MAX_LANGUAGE_CHARS = 64
MAX_CONTEXT_CHARS = 8_000
MAX_KEYTERMS = 100
MAX_KEYTERM_CHARS = 100
MAX_SESSION_ID_CHARS = 64
MAX_FRAMES_PER_MESSAGE = MAX_FRAMES
MAX_FRAME_INDEX = 1 << 40  # ~350 years of frames: bounds the arithmetic, rejects garbage
MAX_AUDIO_SECONDS_PER_MESSAGE = 30
MIN_SAMPLE_RATE = 8_000
MAX_SAMPLE_RATE = 192_000
# The last id a segment may have: the seed sent with its final names the next one, which must fit
# the proto's uint32 as well (an id of 2^32 - 1 made that seed unsendable: INTERNAL, found by fuzzing).
MAX_SEGMENT_ID = (1 << 32) - 2


# ---- the client sends -----------------------------------------------------------------------

def client_message_to_proto(msg: ClientMessage) -> pb.ClientMessage:
    """A message to send, as proto."""
    if isinstance(msg, Features):
        return features_to_proto(msg.packet, seq=msg.seq)
    if isinstance(msg, Audio):
        return pb.ClientMessage(audio=pb.Audio(seq=msg.seq, pcm16=msg.pcm16, sample_rate=msg.sample_rate))
    if isinstance(msg, Start):
        start = pb.Start(language=msg.language, context=msg.context, codec=msg.codec, session_id=msg.session_id,
                         last_event_seq=msg.last_event_seq, word_timings=msg.word_timings,
                         turn_events=msg.turn_events, keyterms=list(msg.keyterms), diarize=msg.diarize)
        if msg.seed is not None:
            start.seed.CopyFrom(seed_to_proto(msg.seed))
        return pb.ClientMessage(start=start)
    if isinstance(msg, KeepAlive):
        return pb.ClientMessage(keep_alive=pb.KeepAlive())
    if isinstance(msg, Finalize):
        return pb.ClientMessage(finalize=pb.Finalize())
    if isinstance(msg, Configure):
        configure = pb.Configure(keyterms=list(msg.keyterms))
        if msg.context is not None:
            configure.context = msg.context
        return pb.ClientMessage(configure=configure)
    if isinstance(msg, End):
        return pb.ClientMessage(end=pb.End())
    raise TypeError(f"not a client message: {msg!r}")


def features_to_proto(p: FeaturePacket, seq: int = 0) -> pb.ClientMessage:
    """The `Features` message of one edge packet, its payload's CRC32C beside it (the server
    rejects a payload that does not match)."""
    return pb.ClientMessage(features=pb.Features(
        seq=seq, segment_id=p.segment_id, first_frame=p.first_frame, frame_count=p.frame_count,
        segment_start=p.segment_start, segment_end=p.segment_end, payload=p.payload,
        running_max_log10=p.running_max_log10, payload_crc32c=payload_crc32c(p.payload), finalized=p.finalized))


# ---- the server reads ------------------------------------------------------------------------

def client_message_from_bytes(data: bytes, max_bytes: int | None = None) -> pb.ClientMessage:
    """The raw request bytes -> ClientMessage (the service parses them itself, so that bytes that
    are no ClientMessage get INVALID_ARGUMENT with a reason instead of a generic failure). More
    than `max_bytes`: MessageTooLarge."""
    if max_bytes is not None and len(data) > max_bytes:
        raise MessageTooLarge(f"a message of {len(data)} bytes is larger than the server's maximum of {max_bytes}")
    try:
        return pb.ClientMessage.FromString(data)
    except DecodeError as e:
        raise MalformedMessage(f"not a harken.v1.ClientMessage ({e})") from e


def client_message_from_proto(msg: pb.ClientMessage, front_end: FrontEndCheck | None) -> ClientMessage:
    """Proto -> domain, validating everything the message holds on its own. `front_end`: what checks
    that a thin client's seeded front-end state is one this server's front end can resume (the
    server passes `harken.cloud.hosting.audio_front_end.check_resumable`); None takes any well-formed one."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise MalformedMessage("empty ClientMessage: set one of start, features, audio, finalize, end, keep_alive, "
                               "configure")
    if kind == "start":
        return _parse_start(msg.start, front_end)
    if kind == "features":
        return _parse_features(msg.features)
    if kind == "audio":
        return _parse_audio(msg.audio)
    if kind == "finalize":
        return Finalize()
    if kind == "keep_alive":
        return KeepAlive()
    if kind == "configure":
        c = msg.configure
        if c.HasField("context") and len(c.context) > MAX_CONTEXT_CHARS:
            raise MalformedMessage(f"configure.context longer than {MAX_CONTEXT_CHARS} characters")
        return Configure(_keyterms(c.keyterms, "configure"), c.context if c.HasField("context") else None)
    return End()


def _keyterms(terms, where: str) -> tuple[str, ...]:
    if len(terms) > MAX_KEYTERMS:
        raise MalformedMessage(f"{where}.keyterms: at most {MAX_KEYTERMS}")
    if any(len(t) > MAX_KEYTERM_CHARS for t in terms):
        raise MalformedMessage(f"{where}.keyterms: each at most {MAX_KEYTERM_CHARS} characters")
    return tuple(terms)


def _parse_start(s: pb.Start, front_end: FrontEndCheck | None) -> Start:
    if len(s.language) > MAX_LANGUAGE_CHARS:
        raise MalformedMessage(f"start.language longer than {MAX_LANGUAGE_CHARS} characters")
    if len(s.context) > MAX_CONTEXT_CHARS:
        raise MalformedMessage(f"start.context longer than {MAX_CONTEXT_CHARS} characters")
    if s.codec not in ("", CODEC_NAME):
        raise MalformedMessage(f"start.codec {s.codec[:40]!r} is not supported; use {CODEC_NAME!r}")
    if len(s.session_id) > MAX_SESSION_ID_CHARS:
        raise MalformedMessage(f"start.session_id longer than {MAX_SESSION_ID_CHARS} characters")
    seed = None
    if s.seed.present:
        if not math.isfinite(s.seed.running_max_log10) and s.seed.running_max_log10 != -math.inf:
            raise MalformedMessage("start.seed.running_max_log10 must be finite (or -inf before any sound)")
        if abs(s.seed.running_max_log10) > 100 and math.isfinite(s.seed.running_max_log10):
            raise MalformedMessage("start.seed.running_max_log10 is not a log10-mel value")
        if len(s.seed.context_tail) > MAX_CONTEXT_CHARS:
            raise MalformedMessage(f"start.seed.context_tail longer than {MAX_CONTEXT_CHARS} characters")
        if s.seed.front_end_state:
            _check_front_end(s.seed, front_end)
        seed = SessionSeed(float(s.seed.running_max_log10), s.seed.context_tail, int(s.seed.next_segment_id),
                           bytes(s.seed.front_end_state),
                           int(s.seed.audio_sample) if s.seed.front_end_state else 0)
    if s.session_id and seed is not None:
        raise MalformedMessage("start: a resume (session_id) takes no seed; a seed starts a new session")
    return Start(language=s.language, context=s.context, codec=s.codec, session_id=s.session_id,
                 last_event_seq=int(s.last_event_seq), seed=seed, word_timings=bool(s.word_timings),
                 turn_events=bool(s.turn_events), keyterms=_keyterms(s.keyterms, "start"),
                 diarize=bool(s.diarize))


def _check_front_end(seed: pb.SessionSeed, front_end: FrontEndCheck | None) -> None:
    """A thin client's `front_end_state` must be a well-formed checkpoint (and one `front_end`
    accepts); `front_end_checkpoint` parses it again when the audio comes."""
    if len(seed.front_end_state) > FRONT_END_STATE_BYTES:
        raise MalformedMessage(f"start.seed.front_end_state longer than {FRONT_END_STATE_BYTES} bytes")
    try:
        checkpoint = FrontEndCheckpoint.parse(seed.front_end_state)
        if front_end is not None:
            front_end(checkpoint)
    except ValueError as e:
        raise MalformedMessage(f"start.seed.front_end_state: {e}") from e
    if seed.audio_sample != checkpoint.replay_from:
        raise MalformedMessage(f"start.seed.audio_sample {seed.audio_sample} is not where its front_end_state "
                               f"replays from ({checkpoint.replay_from})")


def front_end_checkpoint(seed: SessionSeed | None) -> FrontEndCheckpoint | None:
    """The thin-client front end a seed resumes (checked when its Start was parsed), if any."""
    if seed is None or not seed.front_end_state:
        return None
    return FrontEndCheckpoint.parse(seed.front_end_state)


def _parse_features(f: pb.Features) -> Features:
    if f.seq < 1:
        raise MalformedMessage("features.seq must be >= 1")
    if f.frame_count > MAX_FRAMES_PER_MESSAGE:
        raise MalformedMessage(f"features.frame_count {f.frame_count} exceeds {MAX_FRAMES_PER_MESSAGE}")
    if f.segment_id > MAX_SEGMENT_ID:
        raise MalformedMessage(f"features.segment_id is at most {MAX_SEGMENT_ID}")
    if f.first_frame + f.frame_count > MAX_FRAME_INDEX:
        raise MalformedMessage("features.first_frame is out of range")
    if not f.payload:
        raise MalformedMessage("features.payload is empty")
    if f.frame_count > max_frames_for_payload(len(f.payload)):
        raise MalformedMessage(f"features.frame_count {f.frame_count} is more than a payload of {len(f.payload)} "
                               f"bytes may carry ({MAX_FRAMES_PER_PAYLOAD_BYTE} frames per byte)")
    running_max = None
    if f.HasField("running_max_log10"):
        running_max = float(f.running_max_log10)
        if not abs(running_max) <= 100:
            raise MalformedMessage("features.running_max_log10 must be a finite log10-mel value")
    # a corrupted payload is never decoded; a message without a checksum (a client older than the
    # field) is taken unchecked
    if f.HasField("payload_crc32c") and payload_crc32c(f.payload) != f.payload_crc32c:
        raise MalformedMessage("features.payload_crc32c does not match the payload: it was corrupted "
                               "on the way (CRC32C of the payload bytes)")
    if f.finalized and not f.segment_end:
        raise MalformedMessage("features.finalized goes with segment_end: it says why the segment ended")
    return Features(int(f.seq), FeaturePacket(
        segment_id=int(f.segment_id), first_frame=int(f.first_frame), frame_count=int(f.frame_count),
        segment_start=bool(f.segment_start), segment_end=bool(f.segment_end), payload=bytes(f.payload),
        running_max_log10=running_max, finalized=bool(f.finalized)))


def _parse_audio(a: pb.Audio) -> Audio:
    if a.seq < 1:
        raise MalformedMessage("audio.seq must be >= 1")
    if not MIN_SAMPLE_RATE <= a.sample_rate <= MAX_SAMPLE_RATE:
        raise MalformedMessage(f"audio.sample_rate {a.sample_rate} outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE}")
    if len(a.pcm16) % 2:
        raise MalformedMessage("audio.pcm16 has an odd number of bytes (expected 16-bit samples)")
    n = len(a.pcm16) // 2
    if n > MAX_AUDIO_SECONDS_PER_MESSAGE * a.sample_rate:
        raise MalformedMessage(f"audio message longer than {MAX_AUDIO_SECONDS_PER_MESSAGE} s")
    return Audio(seq=int(a.seq), pcm16=bytes(a.pcm16), sample_rate=int(a.sample_rate))


def decode_features(f: FeaturePacket) -> np.ndarray:
    """The payload's frames [128, frame_count] float32. CodecError for a bad payload,
    MalformedMessage when it disagrees with the message or holds non-finite values."""
    frames = decode_frames(f.payload, max_frames=f.frame_count)
    if frames.shape != (N_MELS, f.frame_count):
        raise MalformedMessage(f"features.frame_count is {f.frame_count} but the payload holds "
                               f"{frames.shape[1]} frames")
    if not np.all(np.isfinite(frames)):
        raise MalformedMessage("features payload decodes to NaN or infinite values")
    return frames


def require_start(msg: pb.ClientMessage, front_end: FrontEndCheck | None) -> Start:
    """The first message of a stream: it must be `start` (`front_end` as in `client_message_from_proto`)."""
    kind = msg.WhichOneof("kind")
    if kind != "start":
        raise OutOfOrder(f"the first message must be start, got {kind or 'an empty message'}")
    return _parse_start(msg.start, front_end)


# ---- the server sends ------------------------------------------------------------------------

def server_message_to_proto(msg: ServerMessage) -> pb.ServerMessage:
    """A message the server sends, as proto."""
    if isinstance(msg, Transcript):
        return transcript_to_proto(msg)
    if isinstance(msg, WordTimings):
        return word_timings_to_proto(msg)
    if isinstance(msg, Turn):
        return turn_to_proto(msg)
    if isinstance(msg, SpeakerLabel):
        return pb.ServerMessage(speaker_label=pb.SpeakerLabel(segment_id=msg.change.segment_id,
                                                              speaker=msg.change.speaker, event_seq=msg.event_seq))
    if isinstance(msg, Ack):
        return pb.ServerMessage(ack=pb.Ack(seq=msg.seq, last_final_segment=msg.last_final_segment))
    if isinstance(msg, Ready):
        return pb.ServerMessage(ready=pb.Ready(session_id=msg.session_id, resume_after_seq=msg.resume_after_seq,
                                               last_final_segment=msg.last_final_segment,
                                               keep_alive=msg.keep_alive, word_timings=msg.word_timings,
                                               turn_events=msg.turn_events, diarize=msg.diarize))
    return pb.ServerMessage(error=pb.Error(code=msg.code, message=msg.message))


def transcript_to_proto(t: Transcript) -> pb.ServerMessage:
    e = t.event
    out = pb.Transcript(segment_id=e.segment_id, committed_delta=e.committed_delta, partial=e.partial,
                        stability=e.stability, start_s=e.start_s, end_s=e.end_s, language=e.language,
                        is_final=e.is_final, event_seq=t.event_seq, from_finalize=e.from_finalize,
                        word_confidence=list(e.word_confidence), speaker=e.speaker)
    if t.seed is not None:
        out.seed.CopyFrom(seed_to_proto(t.seed))
    return pb.ServerMessage(transcript=out)


def word_timings_to_proto(w: WordTimings) -> pb.ServerMessage:
    t = w.timings
    return pb.ServerMessage(word_timings=pb.WordTimings(
        segment_id=t.segment_id, event_seq=w.event_seq,
        words=[pb.Word(text=x.text, start_s=x.start_s, end_s=x.end_s) for x in t.words]))


_TURN_KINDS = {SPEECH_STARTED: pb.Turn.SPEECH_STARTED, UTTERANCE_END: pb.Turn.UTTERANCE_END}
_TURN_NAMES = {v: k for k, v in _TURN_KINDS.items()}


def turn_to_proto(t: Turn) -> pb.ServerMessage:
    e = t.turn
    return pb.ServerMessage(turn=pb.Turn(segment_id=e.segment_id, kind=_TURN_KINDS[e.kind], audio_s=e.audio_s,
                                         event_seq=t.event_seq))


# ---- the client reads ------------------------------------------------------------------------

def server_message_from_proto(msg: pb.ServerMessage) -> ServerMessage | None:
    """A received message as shared/protocol data; None for an empty message (no kind set)."""
    kind = msg.WhichOneof("kind")
    if kind == "transcript":
        t = msg.transcript
        event = TranscriptEvent(segment_id=t.segment_id, committed_delta=t.committed_delta, partial=t.partial,
                                stability=t.stability, start_s=t.start_s, end_s=t.end_s, language=t.language,
                                is_final=t.is_final, from_finalize=t.from_finalize,
                                word_confidence=tuple(round(c, 4) for c in t.word_confidence), speaker=t.speaker)
        return Transcript(event, event_seq=t.event_seq, seed=seed_from_proto(t.seed))
    if kind == "word_timings":
        w = msg.word_timings
        words = tuple(TimedWord(x.text, x.start_s, x.end_s) for x in w.words)
        return WordTimings(SegmentTimings(w.segment_id, words), event_seq=w.event_seq)
    if kind == "turn":
        u = msg.turn
        name = _TURN_NAMES.get(u.kind)
        if name is None:  # a kind from a newer server: nothing this client knows to show
            return None
        return Turn(TurnEvent(name, u.segment_id, u.audio_s), event_seq=u.event_seq)
    if kind == "speaker_label":
        label = msg.speaker_label
        return SpeakerLabel(SpeakerChange(label.segment_id, label.speaker), event_seq=label.event_seq)
    if kind == "ack":
        return Ack(seq=msg.ack.seq, last_final_segment=msg.ack.last_final_segment)
    if kind == "ready":
        r = msg.ready
        return Ready(session_id=r.session_id, resume_after_seq=r.resume_after_seq,
                     last_final_segment=r.last_final_segment, keep_alive=r.keep_alive,
                     word_timings=r.word_timings, turn_events=r.turn_events, diarize=r.diarize)
    if kind == "error":
        return ServerError(code=msg.error.code, message=msg.error.message)
    return None


def seed_from_proto(s: pb.SessionSeed) -> SessionSeed | None:
    if not s.present:
        return None
    return SessionSeed(running_max_log10=s.running_max_log10, context_tail=s.context_tail,
                       next_segment_id=s.next_segment_id, front_end_state=bytes(s.front_end_state),
                       audio_sample=int(s.audio_sample))


def seed_to_proto(s: SessionSeed) -> pb.SessionSeed:
    """A seed as proto: in a client's `Start`, and in the server's final `Transcript`s."""
    return pb.SessionSeed(present=True, running_max_log10=s.running_max_log10, context_tail=s.context_tail,
                          next_segment_id=s.next_segment_id, front_end_state=s.front_end_state,
                          audio_sample=s.audio_sample)
