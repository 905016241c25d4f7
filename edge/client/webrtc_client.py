"""The edge's WebRTC client: `TranscriptionClient` with its calls on aiortc data channels instead
of HTTP/2 streams (`DataChannelCalls`); the same `ClientSession` decides what to send, resend and show.

    WebRTCTranscriptionClient("http://host:8080", api_key=...)   same interface as
    TranscriptionClient: stream(source) -> TranscriptEvents, transcribe(source) -> text

One stream attempt = one peer connection (offer/answer over HTTP POST to the server's signaling
endpoint, `cloud/adapters/webrtc.py`) with one reliable, ordered data channel: binary messages are the
serialized `ClientMessage`/`ServerMessage` of the gRPC stream; text messages frame the call (the
client's half-close, the server's status). A channel that closes without a status is a dropped
connection (UNAVAILABLE): the client resumes the session on a new peer connection exactly as after
a dropped gRPC stream. Writes wait on the channel's `bufferedamountlow` event while its queue is
long (`shared/datachannel.py`).

No torch here: aiortc, aiohttp, protobuf, numpy.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from google.protobuf.message import DecodeError

from .call import EOF, STATUS_NAMES, CallEnd, CallFailed
from .session import ClientOptions
from .errors import ServerRejectedError
from .front_end import as_async_pieces
from .grpc_client import TranscriptionClient
from ...proto import harken_pb2 as pb
from ...shared import wire
from ...shared.datachannel import send_when_drained
from ...shared.protocol import ClientMessage, End, ServerMessage, Start, Transcript

if TYPE_CHECKING:
    from aiortc import RTCDataChannel, RTCPeerConnection

OFFER_PATH = "/v1/webrtc/offer"
CHANNEL_LABEL = "harken"

_HTTP_CODES = {401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 400: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED"}


class DataChannelCall:
    """A `harken.v1.Transcription/Stream` call over a data channel, as an edge/client/call.py `Call`:
    binary frames carry the serialized messages (shared/wire.py), text frames the call's framing."""

    def __init__(self, channel):
        self.channel = channel
        self._incoming: asyncio.Queue = asyncio.Queue()
        self._status: tuple[str, str] | None = None  # (code name, details) once the call is over
        self._eof = False
        channel.on("message", self._on_message)
        channel.on("close", self._on_close)

    def _on_message(self, data) -> None:
        if isinstance(data, bytes):
            self._incoming.put_nowait(data)
            return
        try:
            status = json.loads(data)
            code = status["status"]
            if code not in STATUS_NAMES:
                raise KeyError(code)
        except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested too deep
            code, status = "INTERNAL", {"message": "malformed status from the server"}
        if self._status is None:
            self._status = (code, str(status.get("message", "")))
        self._incoming.put_nowait(None)

    def _on_close(self) -> None:
        if self._status is None:
            self._status = ("UNAVAILABLE", "the data channel closed")
        self._incoming.put_nowait(None)

    async def write(self, message: ClientMessage) -> None:
        if self.channel.readyState != "open" or self._status is not None:
            raise CallFailed(*(self._status or ("UNAVAILABLE", "the data channel is closed")))
        try:
            await send_when_drained(self.channel, wire.client_message_to_proto(message).SerializeToString())
        except ConnectionError:
            raise CallFailed("UNAVAILABLE", "the data channel closed") from None

    async def read(self) -> ServerMessage | None | CallEnd:
        if not self._eof:
            data = await self._incoming.get()
            if data is not None:
                try:
                    return wire.server_message_from_proto(pb.ServerMessage.FromString(data))
                except DecodeError:
                    # the server broke the protocol: the call fails with INTERNAL (as the gRPC
                    # driver's does with the None that grpc.aio hands over for it, edge/grpc_faults.call_message)
                    self._status = ("INTERNAL", "malformed message from the server")
                    self._eof = True
                    self.channel.close()
                    raise CallFailed(*self._status) from None
            self._eof = True
        code, details = self._status or ("UNAVAILABLE", "")
        if code != "OK":
            raise CallFailed(code, details)
        return EOF

    async def done_writing(self) -> None:
        if self.channel.readyState == "open":
            self.channel.send(json.dumps({"half_close": True}))

    def cancel(self) -> None:
        if self._status is None:
            self._status = ("CANCELLED", "cancelled by the client")
        self.channel.close()


class PeerConnectionChannel:
    """One stream attempt's peer connection: entering it makes the connection (signaling over
    HTTP, ICE, DTLS, SCTP) with its data channel open (`CallFailed` if it cannot); `call()` is
    the stream's call over that channel; leaving it closes the connection."""

    def __init__(self, url: str, api_key: str | None, connect_timeout_s: float, ssl=None, tracks=()):
        self.tracks = tracks  # media tracks to send besides the data channel (`stream_opus`)
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.connect_timeout_s = connect_timeout_s
        self.ssl = ssl
        self.pc: RTCPeerConnection | None = None
        self.channel: RTCDataChannel | None = None

    async def __aenter__(self) -> "PeerConnectionChannel":
        try:
            await asyncio.wait_for(self._connect(), self.connect_timeout_s)
        except asyncio.TimeoutError:
            await self.close()
            raise CallFailed("UNAVAILABLE", "WebRTC connection not established in time") from None
        except CallFailed:
            await self.close()
            raise
        except Exception as e:
            await self.close()
            raise CallFailed("UNAVAILABLE", f"WebRTC connection failed: {e}") from e
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
        for track in self.tracks:
            self.pc.addTrack(track)
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
                    code = _HTTP_CODES.get(r.status, "UNAVAILABLE")
                    raise CallFailed(code, str(body.get("message", f"HTTP {r.status}")))
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=body["sdp"], type=body["type"]))
        if self.channel.readyState != "open":
            await opened.wait()

    def call(self) -> DataChannelCall:
        """The stream's call over the open data channel."""
        assert self.channel is not None  # open once entered
        return DataChannelCall(self.channel)


class DataChannelCalls:
    """Each call of a stream a data channel on a peer connection of its own (the API key goes with
    the offer; the route key is for gRPC routers only): a `TranscriptionClient`'s `calls`."""

    def __init__(self, url: str, api_key: str | None, ssl=None):
        self.url, self.api_key, self.ssl = url, api_key, ssl

    @asynccontextmanager
    async def open(self, metadata: list[tuple[str, str]], options: ClientOptions) -> AsyncIterator[DataChannelCall]:
        async with self.peer(options) as peer:
            yield peer.call()

    def peer(self, options: ClientOptions) -> PeerConnectionChannel:
        """The peer connection of one call."""
        return PeerConnectionChannel(self.url, self.api_key, options.connect_timeout_s, self.ssl)


def WebRTCTranscriptionClient(target: str, api_key: str | None = None, tls: bool | str | Path | None = None,
                              language: str | None = None, context: str | None = None,
                              options: ClientOptions | None = None, **kw) -> TranscriptionClient:
    """A `TranscriptionClient` whose calls are WebRTC data channels (`DataChannelCalls`): the same
    session, resume, replay and interface. `target` is the server's HTTP URL ("http://host:port", as
    `harken serve --http-port` prints it; a bare "host:port" means http). `tls` for https: a PEM root
    certificate path, or True for the system roots."""
    if "://" not in target:
        target = ("https://" if tls else "http://") + target
    ssl_context = None
    if isinstance(tls, (str, Path)):
        import ssl

        ssl_context = ssl.create_default_context(cafile=str(tls))
    return TranscriptionClient(target, api_key=api_key, language=language, context=context, options=options,
                               calls=DataChannelCalls(target.rstrip("/"), api_key, ssl_context), **kw)


__all__ = ["WebRTCTranscriptionClient", "DataChannelCalls", "DataChannelCall", "PeerConnectionChannel"]


# ---- Opus: audio as a WebRTC track, VAD and features on the server (browsers, thin clients) ----

OPUS_RATE = 48_000
OPUS_FRAME_SAMPLES = 960  # 20 ms at 48 kHz, WebRTC's usual Opus packet
TRAILING_SILENCE_S = 1.0  # sent after the source: the jitter buffer and the VAD's hangover drain


def _pcm_track(pieces, speed: float = 1.0):
    """A live audio track from float32 48 kHz pieces (`_pieces_48k`): 20 ms s16 frames, paced in
    real time (`speed` > 1 plays faster; receivers' jitter buffers expect about real time).
    `track.source_done` is set once the source is exhausted. (A factory: aiortc loads lazily.)"""
    from fractions import Fraction

    import av
    from aiortc import MediaStreamTrack

    class PcmTrack(MediaStreamTrack):
        kind = "audio"

        def __init__(self):
            super().__init__()
            self.buf = np.zeros(0, np.float32)
            self.pts = 0
            self.t0: float | None = None
            self.source_done = asyncio.Event()

        async def recv(self):
            loop = asyncio.get_running_loop()
            if self.t0 is None:
                self.t0 = loop.time()
            while self.buf.size < OPUS_FRAME_SAMPLES:
                piece = None if self.source_done.is_set() else await pieces.__anext__()
                if piece is None:
                    self.source_done.set()
                    piece = np.zeros(OPUS_FRAME_SAMPLES, np.float32)
                self.buf = np.concatenate([self.buf, piece])
            due = self.t0 + self.pts / OPUS_RATE / speed
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            pcm = np.clip(np.round(self.buf[:OPUS_FRAME_SAMPLES] * 32767), -32768, 32767).astype(np.int16)
            self.buf = self.buf[OPUS_FRAME_SAMPLES:]
            frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = OPUS_RATE
            frame.pts = self.pts
            frame.time_base = Fraction(1, OPUS_RATE)
            self.pts += OPUS_FRAME_SAMPLES
            return frame

    return PcmTrack()


async def _pieces_48k(source):
    """Any `stream()` source as float32 48 kHz pieces, then `None` forever (the end)."""
    import soxr

    rs = soxr.ResampleStream(16_000, OPUS_RATE, 1, dtype="float32")
    async for piece in as_async_pieces(source):
        yield rs.resample_chunk(np.asarray(piece, np.float32).reshape(-1))
    yield rs.resample_chunk(np.zeros(0, np.float32), last=True)
    yield np.zeros(int(OPUS_RATE * TRAILING_SILENCE_S), np.float32)
    while True:
        yield None


async def stream_opus(url: str, source, api_key: str | None = None, language: str = "",
                      context: str = "", connect_timeout_s: float = 10.0, speed: float = 1.0):
    """Send `source` (as `TranscriptionClient.stream` takes it) as an Opus audio track, the way a
    browser does; the server runs VAD + features on the decoded audio. Yields `TranscriptEvent`s.
    Live media: audio lost with a dropped connection is not resent (use the data channel client
    for that guarantee)."""
    if "://" not in url:
        url = "http://" + url
    track = _pcm_track(_pieces_48k(source), speed)
    peer = PeerConnectionChannel(url, api_key, connect_timeout_s, tracks=(track,))
    async with peer:
        channel = peer.channel
        assert channel is not None  # open once entered
        call = peer.call()
        await call.write(Start(language=language, context=context))

        async def end_after_source():
            await track.source_done.wait()
            await asyncio.sleep(TRAILING_SILENCE_S / speed + 0.2)
            channel.send(json.dumps({"flush_audio": True}))
            await call.write(End())

        ender = asyncio.create_task(end_after_source())
        try:
            while (reply := await call.read()) is not EOF:
                if isinstance(reply, Transcript):
                    yield reply.event
        except CallFailed as e:
            raise ServerRejectedError(e.code, e.details) from None
        finally:
            ender.cancel()
            await asyncio.gather(ender, return_exceptions=True)
