"""shared/wire: the client's messages survive the wire as the server reads them,
and the server's proto messages arrive as the shared/protocol data the session works with."""

from __future__ import annotations

import math

import numpy as np

from harken.shared import wire
from harken.proto import harken_pb2 as pb
from harken.shared.codec import CODEC_NAME, encode_frames
from harken.shared.integrity import payload_crc32c
from harken.shared.protocol import (Ack, Audio, End, FeaturePacket, Features, Finalize, KeepAlive, Ready,
                                    ServerError, SessionSeed, Start, Transcript)
from harken.shared.transcript import TranscriptEvent


def _as_server_reads_it(msg):
    return wire.client_message_from_proto(wire.client_message_from_bytes(
        wire.client_message_to_proto(msg).SerializeToString()), front_end=None)


def test_client_messages_as_the_server_reads_them():
    """One type per concept: what the client sends is what the server reads, field for field."""
    frames = np.random.default_rng(0).normal(-0.5, 0.3, (128, 20)).astype(np.float32)
    p = FeaturePacket(3, 1200, 20, True, False, encode_frames(frames), running_max_log10=2.25)
    seed = SessionSeed(running_max_log10=-math.inf, context_tail="so far", next_segment_id=4)
    pcm = np.array([0, 1, -1, 32767, -32768], "<i2")
    for msg in (Features(7, p), Start(language="English", context="names", codec=CODEC_NAME, seed=seed),
                Start(session_id="abc", last_event_seq=9), Audio(2, pcm.tobytes(), 16_000), Finalize(), End(),
                KeepAlive()):  # KeepAlive is never taken for End
        assert _as_server_reads_it(msg) == msg
    np.testing.assert_array_equal(_as_server_reads_it(Audio(2, pcm.tobytes(), 16_000)).samples(), pcm / 32768.0)
    assert payload_crc32c(p.payload) == wire.features_to_proto(p, 7).features.payload_crc32c


def test_server_messages_as_shared_data():
    seed = pb.SessionSeed(present=True, running_max_log10=1.5, context_tail="tail", next_segment_id=2)
    t = pb.Transcript(segment_id=1, committed_delta="Hi", partial=" there", stability=0.25, start_s=0.5, end_s=1.25,
                      language="English", is_final=True, seed=seed, event_seq=11)
    assert wire.server_message_from_proto(pb.ServerMessage(transcript=t)) == Transcript(
        TranscriptEvent(1, "Hi", " there", 0.25, 0.5, 1.25, "English", True), event_seq=11,
        seed=SessionSeed(1.5, "tail", 2))
    t.ClearField("seed")
    no_seed = wire.server_message_from_proto(pb.ServerMessage(transcript=t))
    assert isinstance(no_seed, Transcript) and no_seed.seed is None
    assert wire.server_message_from_proto(pb.ServerMessage(ready=pb.Ready(session_id="s", resume_after_seq=4,
                                                               last_final_segment=-1))) == Ready("s", 4, -1)
    assert wire.server_message_from_proto(pb.ServerMessage(ready=pb.Ready(session_id="s", keep_alive=True))).keep_alive
    assert wire.server_message_from_proto(pb.ServerMessage(ack=pb.Ack(seq=5, last_final_segment=0))) == Ack(5, 0)
    assert wire.server_message_from_proto(pb.ServerMessage(error=pb.Error(code="NOT_FOUND", message="gone"))) == \
        ServerError("NOT_FOUND", "gone")
    assert wire.server_message_from_proto(pb.ServerMessage()) is None


def test_a_seed_goes_back_as_it_came():
    """The seed a final brings is the seed a replacement session's Start carries, bit for bit."""
    sent = pb.SessionSeed(present=True, running_max_log10=np.float32(1.1), context_tail="x", next_segment_id=3)
    event = pb.Transcript(segment_id=2, is_final=True, seed=sent, event_seq=1)
    received = wire.server_message_from_proto(pb.ServerMessage(transcript=event))
    assert isinstance(received, Transcript) and received.seed is not None
    assert wire.client_message_to_proto(Start(seed=received.seed)).start.seed == sent
