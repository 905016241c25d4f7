"""The committed gRPC stubs are what `make proto` generates from proto/harken.proto today."""

from pathlib import Path

from harken.proto import generate
from harken.proto import harken_pb2 as pb


def test_committed_stubs_are_current(tmp_path):
    for fresh in generate.generate(tmp_path):
        committed = Path(generate.PROTO_DIR) / fresh.name
        assert committed.read_text() == fresh.read_text(), \
            f"proto/{fresh.name} is stale: run `make proto` and commit the result"


def test_messages_round_trip():
    msg = pb.ClientMessage(features=pb.Features(seq=7, segment_id=2, first_frame=1234, frame_count=20,
                                                segment_start=True, payload=b"HK\x01"))
    back = pb.ClientMessage.FromString(msg.SerializeToString())
    assert back.WhichOneof("kind") == "features"
    assert (back.features.seq, back.features.first_frame, back.features.payload) == (7, 1234, b"HK\x01")
