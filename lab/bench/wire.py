"""Wire bytes of the two WebRTC paths on the same audio, packet overheads counted (`harken bench
edge`): the edge's features over the data channel vs the audio as an Opus track.

Data channel: measured. A real aiortc peer connection on loopback carries the stream's
`ClientMessage`s (Start, every Features packet the edge makes, End); every UDP datagram the client
sends after the channel opened is counted, plus 28 bytes of IPv4 + UDP header each. That is the
message, SCTP (chunk + common header, padding), DTLS (record header, AES-GCM nonce and tag), and
what SCTP/ICE send besides (SACKs for the server's Acks, heartbeats, consent checks).

Opus track: libopus at the bitrates browsers use for speech (20 ms packets, VBR, voip), packet
sizes measured; per packet RTP 12 + one-byte header extensions as Chrome sends them (audio level,
abs-send-time, transport-cc: 16) + SRTP auth tag 10 + UDP 8 + IPv4 20. The track sends a packet
every 20 ms in silence too (no DTX by default), the data channel only during speech (VAD gating).
"""

from __future__ import annotations

import asyncio

import numpy as np

from harken.edge.pipeline import FeaturePacket

IP_UDP_BYTES = 20 + 8
RTP_PACKET_OVERHEAD = 12 + 16 + 10 + IP_UDP_BYTES  # RTP + header extensions + SRTP tag + UDP/IPv4
WEBRTC_OPUS_KBPS = (24, 32)  # 32: Chrome's default for mono speech


def opus_track_wire(audio: np.ndarray, kbps: int) -> dict:
    from harken.bench.opus_reference import opus_round_trip

    rt = opus_round_trip(audio, kbps)
    return {"payload_bytes": rt.payload_bytes, "packets": rt.packets,
            "wire_bytes": rt.payload_bytes + rt.packets * RTP_PACKET_OVERHEAD}


def data_channel_wire(packets: list[FeaturePacket]) -> dict:
    """Send the stream's messages over a loopback aiortc data channel; count what goes out."""
    return asyncio.run(_data_channel_wire(packets))


async def open_loopback(client, server, channel, timeout_s: float = 10.0) -> None:
    """Connect two aiortc peer connections on this machine (offer/answer in memory) and wait until
    `channel`, created on `client`, is open."""
    opened = asyncio.Event()
    channel.on("open", opened.set)
    await client.setLocalDescription(await client.createOffer())
    await server.setRemoteDescription(client.localDescription)
    await server.setLocalDescription(await server.createAnswer())
    await client.setRemoteDescription(server.localDescription)
    await asyncio.wait_for(opened.wait(), timeout_s)


async def _data_channel_wire(packets: list[FeaturePacket]) -> dict:
    from aiortc import RTCPeerConnection

    from harken.shared.wire import features_to_proto
    from harken.proto import harken_pb2 as pb
    from harken.shared.codec import CODEC_NAME

    messages = [pb.ClientMessage(start=pb.Start(codec=CODEC_NAME)).SerializeToString()]
    for seq, p in enumerate(packets, 1):
        messages.append(features_to_proto(p, seq=seq).SerializeToString())  # as the client sends them
    messages.append(pb.ClientMessage(end=pb.End()).SerializeToString())

    client, server = RTCPeerConnection(), RTCPeerConnection()
    got, received = [0], asyncio.Event()

    @server.on("datachannel")
    def on_channel(channel):
        @channel.on("message")
        def on_message(data):
            got[0] += 1
            if got[0] == len(messages):
                received.set()

    channel = client.createDataChannel("harken", ordered=True)
    try:
        await open_loopback(client, server, channel)
        await asyncio.sleep(0.2)  # let the handshake's last datagrams go: they are not counted
        counted = {"bytes": 0, "datagrams": 0}
        assert client.sctp is not None  # the data channel is open
        ice = client.sctp.transport.transport._connection
        pair = ice._nominated[1]
        protocol = pair.protocol
        send_data = protocol.send_data

        async def counting_send(data, addr):
            counted["bytes"] += len(data) + IP_UDP_BYTES
            counted["datagrams"] += 1
            await send_data(data, addr)

        setattr(protocol, "send_data", counting_send)  # count what goes out, then put it back
        try:
            for m in messages:
                channel.send(m)
            await asyncio.wait_for(received.wait(), 30)
            await asyncio.sleep(0.3)  # the last SACKs
        finally:
            setattr(protocol, "send_data", send_data)
    finally:
        await client.close()
        await server.close()
    return {"messages": len(messages), "message_bytes": sum(len(m) for m in messages),
            "wire_bytes": counted["bytes"], "datagrams": counted["datagrams"]}


def wire_comparison(audio: np.ndarray, packets: list[FeaturePacket], speech_s: float) -> dict:
    """The bench's keys: kbps over the whole audio and bytes per second of speech, both paths."""
    seconds = audio.size / 16_000
    dc = data_channel_wire(packets)
    out = {"webrtc_dc_messages": dc["messages"], "webrtc_dc_message_bytes": dc["message_bytes"],
           "webrtc_dc_wire_bytes": dc["wire_bytes"], "webrtc_dc_datagrams": dc["datagrams"],
           "webrtc_dc_wire_kbps": dc["wire_bytes"] * 8 / seconds / 1000,
           "webrtc_dc_wire_bytes_per_speech_s": dc["wire_bytes"] / speech_s if speech_s else 0.0}
    for kbps in WEBRTC_OPUS_KBPS:
        t = opus_track_wire(audio, kbps)
        out[f"webrtc_opus_{kbps}_packets"] = t["packets"]
        out[f"webrtc_opus_{kbps}_wire_bytes"] = t["wire_bytes"]
        out[f"webrtc_opus_{kbps}_wire_kbps"] = t["wire_bytes"] * 8 / seconds / 1000
        out[f"webrtc_opus_{kbps}_wire_bytes_per_speech_s"] = t["wire_bytes"] / speech_s if speech_s else 0.0
    return out
