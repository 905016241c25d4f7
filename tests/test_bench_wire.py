"""edge/bench_wire: the WebRTC wire bytes of `harken bench edge`, on generated speech."""

from __future__ import annotations

from harken.bench.edge import run_stream
from harken.bench.wire import IP_UDP_BYTES, RTP_PACKET_OVERHEAD, wire_comparison
from harken.edge.audio import peak_normalize
from signals import concat, silence, speech


def test_wire_bytes_of_the_data_channel_and_the_opus_track():
    audio = peak_normalize(concat(silence(0.5), speech("Counting the bytes on the wire."), silence(1.0)))
    seconds = audio.size / 16_000
    _, packets = run_stream(audio, "balanced")
    speech_s = sum(p.frame_count for p in packets) / 100
    r = wire_comparison(audio, packets, speech_s)
    # data channel, measured: one datagram per message at least; per message SCTP (28+) and
    # DTLS (13 header + 8 nonce + 16 tag) and UDP/IPv4 on top of the protobuf message
    assert r["webrtc_dc_messages"] == len(packets) + 2  # Start, the packets, End
    assert r["webrtc_dc_datagrams"] >= r["webrtc_dc_messages"]
    per_message = (r["webrtc_dc_wire_bytes"] - r["webrtc_dc_message_bytes"]) / r["webrtc_dc_messages"]
    assert 28 + 37 + IP_UDP_BYTES <= per_message <= 160, per_message
    # Opus: a packet every 20 ms for the whole audio, silence included; overhead per packet
    for kbps in (24, 32):
        n = r[f"webrtc_opus_{kbps}_packets"]
        assert abs(n - seconds / 0.02) <= 6
        assert r[f"webrtc_opus_{kbps}_wire_bytes"] >= n * (RTP_PACKET_OVERHEAD + 1)
        # the headers alone, every 20 ms, cost more than 20 kbps
        assert r[f"webrtc_opus_{kbps}_wire_kbps"] > RTP_PACKET_OVERHEAD * 8 / 0.02 / 1000 > 20
    # the features path costs less on the wire than the Opus track at browsers' bitrates
    assert r["webrtc_dc_wire_bytes"] < r["webrtc_opus_24_wire_bytes"]
