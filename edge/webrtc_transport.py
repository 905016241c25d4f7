"""The edge's WebRTC client: the gRPC client's streaming, buffering and resume logic
(`edge/transport.py`) over an aiortc data channel instead of an HTTP/2 stream.

    WebRTCTranscriptionClient("http://host:8080", api_key=...)   same interface as
    TranscriptionClient: stream(source) -> TranscriptEvents, transcribe(source) -> text

One stream attempt = one peer connection (offer/answer over HTTP POST to the server's signaling
endpoint, `cloud/webrtc.py`) with one reliable, ordered data channel: binary messages are the
serialized `ClientMessage`/`ServerMessage` of the gRPC stream; text messages frame the call (the
client's half-close, the server's status). A channel that closes without a status is a dropped
connection (UNAVAILABLE): the client resumes the session on a new peer connection exactly as after
a dropped gRPC stream.

No torch here: aiortc, aiohttp, protobuf, numpy.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc

from harken.edge.transport import ClientOptions, TranscriptionClient

OFFER_PATH = "/v1/webrtc/offer"
CHANNEL_LABEL = "harken"
SEND_HIGH_WATER = 1 << 20  # bytes queued on the channel before a write waits


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


_HTTP_CODES = {401: grpc.StatusCode.UNAUTHENTICATED, 403: grpc.StatusCode.PERMISSION_DENIED,
               400: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED}


class DataChannelCall:
    """A `harken.v1.Transcription/Stream` call over a data channel, with the methods of a
    grpc.aio stream-stream call that `TranscriptionClient` uses."""

    def __init__(self, channel, deserialize, serialize):
        self.channel = channel
        self._deserialize = deserialize
        self._serialize = serialize
        self._incoming: asyncio.Queue = asyncio.Queue()
        self._status: tuple[grpc.StatusCode, str] | None = None
        self._eof = False
        channel.on("message", self._on_message)
        channel.on("close", self._on_close)

    def _on_message(self, data) -> None:
        if isinstance(data, bytes):
            self._incoming.put_nowait(data)
            return
        try:
            status = json.loads(data)
            code = grpc.StatusCode[status["status"]]
        except (ValueError, KeyError, TypeError):
            code, status = grpc.StatusCode.INTERNAL, {"message": "malformed status from the server"}
        if self._status is None:
            self._status = (code, str(status.get("message", "")))
        self._incoming.put_nowait(None)

    def _on_close(self) -> None:
        if self._status is None:
            self._status = (grpc.StatusCode.UNAVAILABLE, "the data channel closed")
        self._incoming.put_nowait(None)

    async def write(self, message) -> None:
        if self.channel.readyState != "open" or self._status is not None:
            raise _rpc_error(*(self._status or (grpc.StatusCode.UNAVAILABLE, "the data channel is closed")))
        while self.channel.bufferedAmount > SEND_HIGH_WATER:
            await asyncio.sleep(0.01)
            if self.channel.readyState != "open":
                raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "the data channel closed")
        self.channel.send(self._serialize(message))

    async def read(self):
        if self._eof:
            return grpc.aio.EOF
        data = await self._incoming.get()
        if data is None:
            self._eof = True
            return grpc.aio.EOF
        return self._deserialize(data)

    async def done_writing(self) -> None:
        if self.channel.readyState == "open":
            self.channel.send(json.dumps({"half_close": True}))

    async def code(self) -> grpc.StatusCode:
        return self._status[0] if self._status else grpc.StatusCode.UNAVAILABLE

    async def details(self) -> str:
        return self._status[1] if self._status else ""

    def cancel(self) -> bool:
        if self._status is None:
            self._status = (grpc.StatusCode.CANCELLED, "cancelled by the client")
        self.channel.close()
        return True


class PeerConnectionChannel:
    """Stands in for a grpc.aio channel in `TranscriptionClient._attempt`: entering it makes the
    peer connection (signaling over HTTP, ICE, DTLS, SCTP) with its data channel open; the
    stub's `Stream` call then runs over that channel; leaving it closes the connection."""

    def __init__(self, url: str, api_key: str | None, connect_timeout_s: float, ssl=None):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.connect_timeout_s = connect_timeout_s
        self.ssl = ssl
        self.pc = None
        self.channel = None

    async def __aenter__(self) -> "PeerConnectionChannel":
        try:
            await asyncio.wait_for(self._connect(), self.connect_timeout_s)
        except asyncio.TimeoutError:
            await self.close()
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "WebRTC connection not established in time") from None
        except grpc.aio.AioRpcError:
            await self.close()
            raise
        except Exception as e:
            await self.close()
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, f"WebRTC connection failed: {e}") from e
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self.pc is not None:
            await self.pc.close()

    async def _connect(self) -> None:
        import aiohttp
        from aiortc import RTCPeerConnection, RTCSessionDescription

        self.pc = RTCPeerConnection()
        self.channel = self.pc.createDataChannel(CHANNEL_LABEL, ordered=True)
        opened = asyncio.Event()
        self.channel.on("open", opened.set)
        await self.pc.setLocalDescription(await self.pc.createOffer())
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        offer = {"sdp": self.pc.localDescription.sdp, "type": self.pc.localDescription.type}
        async with aiohttp.ClientSession() as http:
            async with http.post(self.url + OFFER_PATH, json=offer, headers=headers, ssl=self.ssl) as r:
                body = await r.json(content_type=None)
                if r.status != 200:
                    code = _HTTP_CODES.get(r.status, grpc.StatusCode.UNAVAILABLE)
                    raise _rpc_error(code, str(body.get("message", f"HTTP {r.status}")))
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=body["sdp"], type=body["type"]))
        if self.channel.readyState != "open":
            await opened.wait()

    def stream_stream(self, method, request_serializer=None, response_deserializer=None, **_):
        def call(metadata=None, **__):
            return DataChannelCall(self.channel, response_deserializer, request_serializer)
        return call


class WebRTCTranscriptionClient(TranscriptionClient):
    """`TranscriptionClient` over WebRTC. `target` is the server's HTTP URL ("http://host:port",
    as `harken serve --http-port` prints it; a bare "host:port" means http). `tls` for https: a
    PEM root certificate path, or True for the system roots."""

    def __init__(self, target: str, api_key: str | None = None, tls: bool | str | Path | None = None,
                 language: str | None = None, context: str | None = None,
                 options: ClientOptions | None = None, **kw):
        if "://" not in target:
            target = ("https://" if tls else "http://") + target
        super().__init__(target, api_key=api_key, tls=None, language=language, context=context,
                         options=options, **kw)
        self._ssl = None
        if isinstance(tls, (str, Path)):
            import ssl

            self._ssl = ssl.create_default_context(cafile=str(tls))

    def _channel(self) -> PeerConnectionChannel:
        return PeerConnectionChannel(self.target, self.api_key, self.options.connect_timeout_s, self._ssl)


__all__ = ["WebRTCTranscriptionClient", "DataChannelCall", "PeerConnectionChannel"]
