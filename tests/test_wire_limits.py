"""shared/wire (the server reading): what one message may claim, checked before any decoding work, and a fuzz over the
decoder: whatever the bytes, a Features message either decodes to what it says or is rejected with
an error that maps to INVALID_ARGUMENT (never another exception)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from harken.cloud.hosting.audio_front_end import check_seeded_front_end

from harken.shared import wire
from harken.cloud.adapters.grpc_service import status_of
from harken.proto import harken_pb2 as pb
from harken.shared.codec import MAX_FRAMES_PER_PAYLOAD_BYTE, MAX_PACKET_FRAMES, encode_frames
from harken.shared.protocol import Features

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _at_floor(frames: int) -> bytes:
    return encode_frames(np.full((128, frames), -3.0, np.float32), floor_log10=-3.0)


def _features(payload: bytes, frame_count: int) -> bytes:
    return pb.ClientMessage(features=pb.Features(seq=1, segment_start=True, frame_count=frame_count,
                                                 payload=payload)).SerializeToString()


def _decode(data: bytes):
    item = wire.client_message_from_proto(wire.client_message_from_bytes(data), front_end=check_seeded_front_end)
    return wire.decode_features(item.packet) if isinstance(item, Features) else None


@pytest.mark.parametrize("frames", [1, 20, MAX_PACKET_FRAMES])
def test_any_packet_the_edge_may_send_is_within_the_bound(frames):
    """Even a packet entirely at its floor (a 9-byte header) of the most frames an edge packet may
    hold decodes."""
    payload = _at_floor(frames)
    assert len(payload) == 9
    assert _decode(_features(payload, frames)).shape == (128, frames)


@pytest.mark.parametrize("frames", [MAX_PACKET_FRAMES + 1, 600, 6000])
def test_a_payload_claiming_more_frames_than_its_bytes_allow_is_invalid_argument(frames):
    payload = _at_floor(frames)
    assert frames > MAX_FRAMES_PER_PAYLOAD_BYTE * len(payload)
    with pytest.raises(Exception) as e:
        _decode(_features(payload, frames))
    assert status_of(e.value) == INVALID
    assert "frames per byte" in str(e.value)


def test_a_header_claiming_more_frames_than_the_message_is_rejected_before_decoding():
    """frame_count small, the payload's header a minute: refused on the header alone."""
    with pytest.raises(Exception) as e:
        _decode(_features(_at_floor(6000), 20))
    assert status_of(e.value) == INVALID
    assert str(e.value) == "payload claims 6000 frames, more than the 20 expected"


def test_the_edge_cannot_be_configured_to_send_larger_packets():
    from harken.edge.pipeline import FeatureStream

    with pytest.raises(ValueError, match=f"packet_frames must be 1..{MAX_PACKET_FRAMES}"):
        FeatureStream(packet_frames=MAX_PACKET_FRAMES + 1)
