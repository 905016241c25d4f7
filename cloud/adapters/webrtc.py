"""WebRTC access to the same sessions as gRPC: HTTP signaling, a data channel per stream, and an
incoming Opus track for browsers.

    POST /v1/webrtc/offer  {sdp, type} + `Authorization: Bearer <key>` -> {sdp, type}
        one RTCPeerConnection per offer (aiortc); the key is checked here and again per stream
    data channel (reliable, ordered; any label) = one `harken.v1.Transcription/Stream` call:
        binary messages: serialized `ClientMessage` in, serialized `ServerMessage` out
        text messages: the call's framing. Client -> server `{"half_close": true}` (no more
        requests); server -> client `{"status": "OK"|CODE, "message": ...}`, the call's status,
        always the last message (a channel that closes without it is a dropped connection)
    audio track (Opus, 48 kHz): decoded by aiortc, mixed to mono and fed to the stream as thin-
        client `Audio` messages (seq after the `Ready`'s resume point); the session's own front
        end resamples to 16 kHz and runs the edge's VAD + features, exactly as for gRPC `Audio`

The HTTP application that mounts the offer route beside the page and the other APIs, and its CORS
rules, is cloud/adapters/http_app.py.

Each data channel runs the stream handler (cloud/hosting/stream_handler.py) that gRPC runs: the session
table, the resume and replay rules, the error codes are one implementation. The channel's binary
messages go to the stream's `RequestQueue`, its close is the stream's cancellation, and the
handler's final status becomes the status frame.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..base.auth import ApiKeys, check_http
from ..base.errors import Unauthenticated
from ..hosting.stream_handler import RequestQueue, StreamFailed, StreamHandler
from ...shared import wire
from ...shared.datachannel import send_when_drained
from ...shared.protocol import Audio
from ..model.prompt import LANGUAGE_CODES, SUPPORTED_LANGUAGES

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("harken.webrtc")

OFFER_PATH = "/v1/webrtc/offer"
CONFIG_PATH = "/v1/config"
MAX_OFFER_BYTES = 64 << 10
AUDIO_PIECE_S = 0.1  # track audio per `Audio` message
STATUS_CLOSE_AFTER_S = 5.0  # the client closes the channel after the status; else the server does
MAX_PENDING_AUDIO_S = 10.0  # track audio held before the stream's Ready; older pieces are dropped
CONNECT_TIMEOUT_S = 30.0  # a peer connection that opens no data channel in this time is closed


@dataclass
class _TrackFeed:
    """An incoming audio track of one peer connection -> `Audio` messages of its current stream."""

    requests: RequestQueue | None = None
    next_seq: int | None = None  # set once the stream's Ready says where to resume
    pending: list[bytes] = field(default_factory=list)  # pieces before Ready
    piece: list[np.ndarray] = field(default_factory=list)
    piece_samples: int = 0
    sample_rate: int = 48_000

    def add(self, mono16: np.ndarray, rate: int) -> None:
        self.sample_rate = rate
        self.piece.append(mono16)
        self.piece_samples += mono16.size
        if self.piece_samples >= int(rate * AUDIO_PIECE_S):
            self.flush()

    def flush(self) -> None:
        if not self.piece_samples:
            return
        pcm = np.concatenate(self.piece).astype("<i2").tobytes()
        self.piece, self.piece_samples = [], 0
        self.pending.append(pcm)
        while len(self.pending) > MAX_PENDING_AUDIO_S / AUDIO_PIECE_S:
            self.pending.pop(0)  # no stream takes the audio (yet): live media is not kept forever
        self.drain()

    def drain(self) -> None:
        if self.requests is None or self.next_seq is None:
            return
        for pcm in self.pending:
            msg = wire.client_message_to_proto(Audio(self.next_seq, pcm, self.sample_rate))
            self.next_seq += 1
            self.requests.put(msg.SerializeToString())
        self.pending.clear()


class _Channel:
    """A data channel's request iterator and close event, wired up when the channel appears."""

    def __init__(self, channel, feed: _TrackFeed):
        self.channel = channel
        self.requests = requests = RequestQueue()
        self.closed = asyncio.Event()
        feed.requests, feed.next_seq = requests, None  # the newest stream gets the track's audio
        feed.pending.clear()

        @channel.on("message")
        def on_message(data):
            if isinstance(data, bytes):
                requests.put(data)
                return
            try:
                control = json.loads(data)
            except (ValueError, RecursionError):  # not JSON; or nested past the parser's recursion limit
                control = {}
            if not isinstance(control, dict):
                control = {}
            if control.get("half_close"):
                if feed.requests is requests:
                    feed.flush()
                requests.end()
            elif control.get("flush_audio") and feed.requests is requests:
                feed.flush()  # the browser's End follows: the last audio piece goes first

        channel.on("close", self.closed.set)


class WebRTCSignaling:
    """The offer route and every peer connection it made (mounted by `HttpApp`)."""

    def __init__(self, handler: StreamHandler, keys: ApiKeys | None, max_peer_connections: int = 64):
        self.handler = handler
        self.keys = keys
        self.max_peer_connections = max_peer_connections
        self._pcs: set = set()
        self._tasks: set[asyncio.Task] = set()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(OFFER_PATH, self._offer)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        for pc in list(self._pcs):
            await pc.close()
        self._pcs.clear()

    async def _offer(self, request):
        from aiohttp import web
        from aiortc import RTCPeerConnection

        try:
            metadata = check_http(self.keys, request.headers)
        except Unauthenticated as e:
            return web.json_response({"code": "UNAUTHENTICATED", "message": str(e)}, status=401)
        if len(self._pcs) >= self.max_peer_connections:
            return web.json_response({"code": "RESOURCE_EXHAUSTED", "message": "the server holds its maximum of "
                                      f"{self.max_peer_connections} WebRTC connections"}, status=429)
        try:
            offer = _parse_offer(await request.read())
        except ValueError as e:
            return web.json_response({"code": "INVALID_ARGUMENT", "message": f"bad offer: {e}"}, status=400)

        pc = RTCPeerConnection()
        self._pcs.add(pc)
        feed = _TrackFeed()

        @pc.on("connectionstatechange")
        async def on_state():
            if pc.connectionState in ("failed", "closed"):
                self._pcs.discard(pc)
                await pc.close()

        @pc.on("datachannel")
        def on_channel(channel):
            # the channel's handlers are in place before it can deliver its first message
            self._spawn(self._serve_channel(_Channel(channel, feed), metadata, feed), "webrtc-stream")

        @pc.on("track")
        def on_track(track):
            if track.kind == "audio":
                self._spawn(_pump_track(track, feed), "webrtc-track")

        try:
            await pc.setRemoteDescription(offer)
            if pc.sctp is None:
                raise ValueError("it offers no data channel (the stream's messages go over one)")
            await pc.setLocalDescription(await pc.createAnswer())
        except Exception as e:  # aiortc raises plain ValueError/InvalidStateError on bad SDP
            self._pcs.discard(pc)
            await pc.close()
            return web.json_response({"code": "INVALID_ARGUMENT", "message": f"bad offer: {e}"}, status=400)
        self._spawn(self._expire_unused(pc), "webrtc-expire")
        return web.json_response({"sdp": pc.localDescription.sdp, "type": pc.localDescription.type})

    async def _expire_unused(self, pc) -> None:
        await asyncio.sleep(CONNECT_TIMEOUT_S)
        if pc.sctp is None or pc.connectionState != "connected":
            self._pcs.discard(pc)
            await pc.close()

    def _spawn(self, coro, name: str) -> None:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ---- one stream per data channel -----------------------------------------------------------

    async def _serve_channel(self, ch: "_Channel", metadata, feed: _TrackFeed) -> None:
        channel, requests, closed = ch.channel, ch.requests, ch.closed
        if channel.readyState != "open":
            opened = asyncio.Event()
            channel.on("open", opened.set)
            waits = [asyncio.ensure_future(e.wait()) for e in (opened, closed)]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if not opened.is_set():
                return
        stream = asyncio.get_running_loop().create_task(self._run_stream(channel, requests, metadata, feed))
        closer = asyncio.get_running_loop().create_task(closed.wait())
        try:
            await asyncio.wait([stream, closer], return_when=asyncio.FIRST_COMPLETED)
        finally:
            # the channel closing is the stream's cancellation: the handler detaches it
            for t in (stream, closer):
                t.cancel()
            await asyncio.wait([stream, closer])
            if feed.requests is requests:
                feed.requests = None
            requests.end()
        if not stream.cancelled() and stream.exception() is None and channel.readyState == "open":
            try:
                await asyncio.wait_for(closed.wait(), STATUS_CLOSE_AFTER_S)
            except asyncio.TimeoutError:
                channel.close()

    async def _run_stream(self, channel, requests: RequestQueue, metadata, feed: _TrackFeed) -> None:
        status = {"status": "OK", "message": ""}
        try:
            async with aclosing(self.handler.run_proto(metadata, requests)) as messages:
                async for msg in messages:
                    if msg.WhichOneof("kind") == "ready" and feed.requests is requests:
                        feed.next_seq = msg.ready.resume_after_seq + 1
                        feed.drain()
                    # waits while the channel's queue is long: a slow network backs up to the stream
                    await send_when_drained(channel, msg.SerializeToString())
        except StreamFailed as e:
            status = {"status": e.code, "message": e.message}
        if channel.readyState == "open":
            channel.send(json.dumps(status))


async def _pump_track(track, feed: _TrackFeed) -> None:
    """Decoded track frames (aiortc: packed s16, 48 kHz) -> mono int16 -> the feed."""
    from aiortc.mediastreams import MediaStreamError

    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            feed.flush()
            return
        channels = len(frame.layout.channels)
        x = frame.to_ndarray().reshape(-1, channels).astype(np.int32)
        mono = (x.sum(axis=1) // channels).astype(np.int16) if channels > 1 else x[:, 0].astype(np.int16)
        feed.add(mono, frame.sample_rate)


__all__ = ["WebRTCSignaling", "page_config", "OFFER_PATH", "CONFIG_PATH"]


def page_config(handler) -> dict:
    """`GET /v1/config`: the served model (`Qwen3ASR.describe()` of the engine's model) and the
    languages a stream can be forced to, by name and ISO 639 code."""

    asr = getattr(getattr(getattr(getattr(handler, "table", None), "scheduler", None), "engine", None), "asr", None)
    describe = getattr(asr, "describe", None)
    model = describe() if callable(describe) else {"model": "", "kind": "unknown", "test_model": False, "note": ""}
    codes: dict[str, str] = {}
    for code, name in LANGUAGE_CODES.items():
        codes.setdefault(name, code)  # the first code prompt.LANGUAGE_CODES lists for it
    return {"model": model["model"], "model_kind": model["kind"], "test_model": model["test_model"],
            "model_note": model["note"],
            "languages": [{"name": name, "code": codes.get(name, "")} for name in SUPPORTED_LANGUAGES]}


def _parse_offer(body: bytes):
    """The request body -> an RTCSessionDescription of type "offer"; ValueError saying what is wrong."""
    from aiortc import RTCSessionDescription

    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError('the body is not JSON (expected {"sdp": "...", "type": "offer"})') from None
    if not isinstance(doc, dict):
        raise ValueError('the body must be a JSON object {"sdp": "...", "type": "offer"}')
    missing = [k for k in ("sdp", "type") if k not in doc]
    if missing:
        raise ValueError(f"missing field{'s' if len(missing) > 1 else ''} {' and '.join(repr(k) for k in missing)}"
                         ' (expected {"sdp": "...", "type": "offer"})')
    if not isinstance(doc["sdp"], str) or not isinstance(doc["type"], str):
        raise ValueError("'sdp' and 'type' must be strings")
    if doc["type"] != "offer":
        raise ValueError(f"'type' must be 'offer', not {doc['type']!r}")
    return RTCSessionDescription(sdp=doc["sdp"], type="offer")
