"""The client's wire boundary: shared/protocol messages <-> `harken.v1` proto messages.

The one place on the edge where proto names appear (besides the network drivers, which move these
messages as they are). `ClientSession` and everything behind it see only shared/protocol types.
"""

from __future__ import annotations

from harken.proto import harken_pb2 as pb
from harken.shared.integrity import payload_crc32c
from harken.shared.protocol import (Ack, Audio, ClientMessage, End, FeaturePacket, Features, Finalize, KeepAlive,
                                    Ready, ServerError, ServerMessage, SessionSeed, Start, Transcript)
from harken.shared.transcript import TranscriptEvent


def client_message(msg: ClientMessage) -> pb.ClientMessage:
    """A message to send, as proto."""
    if isinstance(msg, Features):
        return features_message(msg.packet, seq=msg.seq)
    if isinstance(msg, Audio):
        return pb.ClientMessage(audio=pb.Audio(seq=msg.seq, pcm16=msg.pcm16, sample_rate=msg.sample_rate))
    if isinstance(msg, Start):
        start = pb.Start(language=msg.language, context=msg.context, codec=msg.codec, session_id=msg.session_id,
                         last_event_seq=msg.last_event_seq)
        if msg.seed is not None:
            start.seed.CopyFrom(seed_message(msg.seed))
        return pb.ClientMessage(start=start)
    if isinstance(msg, KeepAlive):
        return pb.ClientMessage(keep_alive=pb.KeepAlive())
    if isinstance(msg, Finalize):
        return pb.ClientMessage(finalize=pb.Finalize())
    if isinstance(msg, End):
        return pb.ClientMessage(end=pb.End())
    raise TypeError(f"not a client message: {msg!r}")


def features_message(p: FeaturePacket, seq: int = 0) -> pb.ClientMessage:
    """The `Features` message of one edge packet, its payload's CRC32C beside it (the server
    rejects a payload that does not match)."""
    return pb.ClientMessage(features=pb.Features(
        seq=seq, segment_id=p.segment_id, first_frame=p.first_frame, frame_count=p.frame_count,
        segment_start=p.segment_start, segment_end=p.segment_end, payload=p.payload,
        running_max_log10=p.running_max_log10, payload_crc32c=payload_crc32c(p.payload)))


def server_message(msg: pb.ServerMessage) -> ServerMessage | None:
    """A received message as shared/protocol data; None for an empty message (no kind set)."""
    kind = msg.WhichOneof("kind")
    if kind == "transcript":
        t = msg.transcript
        event = TranscriptEvent(segment_id=t.segment_id, committed_delta=t.committed_delta, partial=t.partial,
                                stability=t.stability, start_s=t.start_s, end_s=t.end_s, language=t.language,
                                is_final=t.is_final)
        return Transcript(event, event_seq=t.event_seq, seed=_seed(t.seed))
    if kind == "ack":
        return Ack(seq=msg.ack.seq, last_final_segment=msg.ack.last_final_segment)
    if kind == "ready":
        r = msg.ready
        return Ready(session_id=r.session_id, resume_after_seq=r.resume_after_seq,
                     last_final_segment=r.last_final_segment, keep_alive=r.keep_alive)
    if kind == "error":
        return ServerError(code=msg.error.code, message=msg.error.message)
    return None


def _seed(s: pb.SessionSeed) -> SessionSeed | None:
    if not s.present:
        return None
    return SessionSeed(running_max_log10=s.running_max_log10, context_tail=s.context_tail,
                       next_segment_id=s.next_segment_id, front_end_state=bytes(s.front_end_state),
                       audio_sample=int(s.audio_sample))


def seed_message(s: SessionSeed) -> pb.SessionSeed:
    """A seed as proto: in a client's `Start`, and in the server's final `Transcript`s."""
    return pb.SessionSeed(present=True, running_max_log10=s.running_max_log10, context_tail=s.context_tail,
                          next_segment_id=s.next_segment_id, front_end_state=s.front_end_state,
                          audio_sample=s.audio_sample)
