"""OpenAI's Realtime transcription session over WebSocket (`GET /v1/realtime` on `harken serve
--http-port`), as the `openai` Python package speaks it, on harken's engine as a thin client.

The client's audio (`input_audio_buffer.append`: base64 PCM16 at the session's rate, 24 kHz unless
`session.update` says otherwise) becomes the `Audio` messages of one harken stream, run by the same
stream handler as gRPC and WebRTC (the server's VAD, features and codec; the serving engine's
batches), so the text is harken's committed text. How harken's model maps onto the events:

    a VAD segment opens        input_audio_buffer.speech_started (item_id: one item per segment), as
                               soon as the server's VAD knows (harken's turn event, not waiting for text)
    the segment's speech ends  input_audio_buffer.speech_stopped, input_audio_buffer.committed (the
                               turn event utterance_end, before the text is final)
    committed text             conversation.item.input_audio_transcription.delta: committed text is
                               never retracted, so the deltas of an item add up to its transcript;
                               partial text, which may still change, is not sent
    the segment is final       conversation.item.input_audio_transcription.completed (the segment's text)
    input_audio_buffer.commit  harken's Finalize: the open segment ends at the audio appended so far,
                               and its text follows at once
    input_audio_buffer.clear   input_audio_buffer.cleared; audio already taken is not unsaid (harken
                               commits as it hears)
    the socket closes          harken's End (half-close): open segments are finalised

`session.update` is taken before the first audio (format rate, transcription language and prompt,
the prompt being Qwen3-ASR's context); after it only the prompt may change (harken's Configure:
from the next item on); turn detection is always harken's own VAD. API keys as on
every entry point: `Authorization: Bearer KEY`.

vLLM's `/v1/realtime` (its Qwen3-ASR and Voxtral servers) speaks a dialect of this, which is taken
too, so a client written for it works unchanged: a `session.update` with a top-level `model` (or a
`commit` before any audio) marks it; its audio is 16 kHz by default; it gets `transcription.delta`
events (committed text) and, after `input_audio_buffer.commit` with `"final": true` (the end of its
audio: harken's End), one `transcription.done` with the whole text.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import json
import uuid
from contextlib import aclosing
from typing import Any

from ..base.auth import ApiKeys, check_http
from ..base.errors import Unauthenticated
from ..hosting.stream_handler import RequestQueue, StreamFailed, StreamHandler
from ...shared import wire
from ...shared.codec import CODEC_NAME
from ...shared.protocol import Audio, ClientMessage, Configure, End, Finalize, ServerError, Start, Transcript, Turn
from ...shared.transcript import SPEECH_STARTED
from ...shared.text import transcript_text

REALTIME_PATH = "/v1/realtime"
SERVER_CODES = ("INTERNAL", "UNAVAILABLE", "UNKNOWN", "DATA_LOSS")  # the server's fault; the others are the client's
DEFAULT_RATE = 24_000  # OpenAI's audio/pcm
MAX_EVENT_BYTES = 4 << 20  # one client event (base64 audio: ~80 s at 24 kHz)
MAX_QUEUED_MESSAGES = 16  # appends read from the socket and not yet taken by the stream


class RealtimeTranscription:
    def __init__(self, handler: StreamHandler, keys: ApiKeys | None, model_id: str):
        self.handler, self.keys, self.model_id = handler, keys, model_id

    def add_routes(self, app) -> None:
        app.router.add_get(REALTIME_PATH, self.handle)

    async def handle(self, request):
        from aiohttp import WSMsgType, web

        try:
            metadata = check_http(self.keys, request.headers)
        except Unauthenticated as e:
            return web.json_response({"error": {"message": str(e), "type": "invalid_request_error",
                                                 "param": None, "code": "invalid_api_key"}}, status=401)
        ws = web.WebSocketResponse(max_msg_size=MAX_EVENT_BYTES)
        if not ws.can_prepare(request).ok:
            return web.json_response({"error": {"message": "/v1/realtime is a WebSocket: connect with "
                                                           "'Upgrade: websocket'", "type": "invalid_request_error",
                                                "param": None, "code": "websocket_required"}}, status=400)
        await ws.prepare(request)
        session = _Session(self, ws, metadata)
        await session.send({"type": "session.created", "session": session.describe()})
        try:
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    if msg.type == WSMsgType.BINARY:
                        await session.error("events are JSON text frames", "invalid_event")
                    continue
                await session.on_event(msg.data)
        finally:
            await session.close()
        return ws


class _Session:
    """One WebSocket: its session settings, its harken stream once audio comes, the event mapping."""

    def __init__(self, api: RealtimeTranscription, ws, metadata):
        self.api, self.ws, self.metadata = api, ws, metadata
        self.id = "sess_" + uuid.uuid4().hex[:20]
        self.rate, self.language, self.prompt = DEFAULT_RATE, "", ""
        self.vllm = False  # vLLM's dialect (see the module docstring)
        self.ended = False  # End sent: the client said its audio is over
        self.requests = RequestQueue()  # serialized, as a data channel's: the handler checks them alike
        self.stream: asyncio.Task | None = None
        self.start: bytes | None = None  # the stream's Start message
        self.seq = itertools.count(1)
        self.items: dict[int, str] = {}  # segment id -> item id
        self.texts: dict[int, str] = {}
        self.last_item: str | None = None
        self.stopped: set[int] = set()  # segments whose speech_stopped / committed are out
        self.ids = itertools.count(1)

    def describe(self) -> dict:
        return {"type": "transcription", "id": self.id, "object": "realtime.transcription_session",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": self.rate},
                                    "transcription": {"model": self.api.model_id, "language": self.language,
                                                      "prompt": self.prompt},
                                    "turn_detection": {"type": "server_vad"}}}}

    def put(self, msg: ClientMessage) -> None:
        self.requests.put(wire.client_message_to_proto(msg).SerializeToString())

    async def send(self, event: dict) -> None:
        if not self.ws.closed:
            try:
                await self.ws.send_str(json.dumps({"event_id": f"event_{next(self.ids)}", **event}, ensure_ascii=False))
            except ConnectionError:  # the client went away while it was written: nobody to tell
                pass

    async def error(self, message: str, code: str, event_id: Any = None) -> None:
        await self.send({"type": "error", "error": {"type": "invalid_request_error", "code": code,
                                                    "message": message, "param": None, "event_id": event_id}})

    # ---- client events ---------------------------------------------------------------------------

    async def on_event(self, data: str) -> None:
        try:
            event = json.loads(data)
        except (ValueError, RecursionError):  # RecursionError: nested past Python's recursion limit
            await self.error("not a JSON event", "invalid_event")
            return
        if not isinstance(event, dict):
            await self.error("an event is a JSON object", "invalid_event")
            return
        kind, event_id = event.get("type"), event.get("event_id")
        if kind in ("session.update", "transcription_session.update"):
            if "model" in event and "session" not in event and self.stream is None:  # vLLM's session.update
                self.vllm, self.rate = True, 16_000
                await self.send({"type": "session.updated", "session": self.describe()})
                return
            await self._update(event.get("session") or {}, event_id)
        elif kind == "input_audio_buffer.append":
            await self._append(event.get("audio"), event_id)
        elif kind == "input_audio_buffer.commit":
            if self.ended:
                await self.error("the session's audio has ended (a final commit); open a new session",
                                 "session_ended", event_id)
            elif self.stream is None and not self.vllm and not event.get("final"):
                self.vllm, self.rate = True, 16_000  # vLLM's client commits before its audio: "ready"
            elif event.get("final") and self.stream is None:  # the end of no audio: nothing was said
                self.ended = True
                await self.vllm_done()
            elif event.get("final") and self.stream is not None and not self.ended:
                self.ended = True
                self.put(End())
                self.requests.end()
            elif self.stream is not None and not self.stream.done():
                self.put(Finalize())
        elif kind == "input_audio_buffer.clear":
            await self.send({"type": "input_audio_buffer.cleared"})
        else:
            await self.error(f"harken's transcription session does not take {str(kind)[:60]!r} events",
                             "unknown_event", event_id)

    async def _update(self, session: dict, event_id: Any) -> None:
        started = self.stream is not None

        def part(where: dict, key: str) -> dict | None:  # absent: {}; not an object: None
            value = where.get(key)
            return {} if value is None else value if isinstance(value, dict) else None

        audio = part(session, "audio") if isinstance(session, dict) else None
        audio_in = part(audio, "input") if audio is not None else None
        fmt = part(audio_in, "format") if audio_in is not None else None
        transcription = part(audio_in, "transcription") if audio_in is not None else None
        if transcription == {} and audio is not None:  # the beta API's place for it
            transcription = part(session, "input_audio_transcription")
        if fmt is None or transcription is None:
            await self.error("session, session.audio, .input, .format and .transcription must be JSON objects",
                             "invalid_value", event_id)
            return
        rate = fmt.get("rate", self.rate)
        if type(rate) is not int or not 8_000 <= rate <= 48_000:
            await self.error("audio.input.format.rate must be an integer from 8000 to 48000", "invalid_value",
                             event_id)
            return
        language = str(transcription.get("language", self.language) or "")
        prompt = str(transcription.get("prompt", self.prompt) or "")
        if started and (rate != self.rate or language != self.language):
            await self.error("the audio format and language are fixed once the audio has started (the prompt "
                             "may change)", "session_started", event_id)
            return
        if started and prompt != self.prompt:  # from the next item on: harken's Configure
            self.put(Configure(context=prompt))
        self.rate, self.language, self.prompt = rate, language, prompt
        await self.send({"type": "session.updated", "session": self.describe()})

    async def _append(self, audio: Any, event_id: Any) -> None:
        try:
            pcm = base64.b64decode(audio or "", validate=True)
        except (binascii.Error, TypeError, ValueError):
            await self.error("audio must be base64 PCM16", "invalid_value", event_id)
            return
        if len(pcm) % 2 or not pcm:
            await self.error("audio must be whole 16-bit samples", "invalid_value", event_id)
            return
        if self.ended or (self.stream is not None and self.stream.done()):
            await self.error("the session's audio has ended (a final commit, or its stream ended with an error); "
                             "open a new session", "session_ended", event_id)
            return
        if self.stream is None:
            start = Start(language=self.language, context=self.prompt, codec=CODEC_NAME, turn_events=not self.vllm)
            self.start = wire.client_message_to_proto(start).SerializeToString()
            self.requests.put(self.start)
            self.stream = asyncio.get_running_loop().create_task(self._run())
        self.put(Audio(next(self.seq), pcm, self.rate))
        # the stream takes audio at its pace: while more than MAX_QUEUED_MESSAGES wait for it, the socket
        # is not read (TCP pushes back on the client), until the stream has taken some or has ended
        while self.requests.queue.qsize() > MAX_QUEUED_MESSAGES and not self.stream.done():
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        """The socket closed: End, and the stream's last finals go nowhere (the client has gone)."""
        if self.stream is None:
            return
        if not self.ended:
            waiting = [self.requests.queue.get_nowait() for _ in range(self.requests.queue.qsize())]
            if waiting and waiting[0] is self.start:  # the stream has not begun: it still needs its Start
                self.requests.put(self.start)
            # the rest, audio not taken yet, goes: the client has gone, nobody would hear it
            self.put(End())
            self.requests.end()
        try:
            await asyncio.wait_for(asyncio.shield(self.stream), 30)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 (the stream reports its own errors)
            self.stream.cancel()

    # ---- harken's events -> the session's events ------------------------------------------------

    async def _run(self) -> None:
        handler = self.api.handler
        try:
            async with aclosing(handler.run(self.metadata, handler.parse(self.requests))) as messages:
                async for out in messages:
                    if isinstance(out, Transcript):
                        await (self._vllm_transcript(out) if self.vllm else self._transcript(out))
                    elif isinstance(out, Turn):
                        await (self._speech_started(out.segment_id, out.turn.audio_s) if out.turn.kind == SPEECH_STARTED
                               else self._speech_stopped(out.segment_id, out.turn.audio_s))
                    elif isinstance(out, ServerError):
                        kind = "server_error" if out.code in SERVER_CODES else "invalid_request_error"
                        await self.send({"type": "error", "error": {"type": kind, "code": out.code,
                                                                    "message": out.message, "param": None}})
        except StreamFailed as e:
            await self.send({"type": "error", "error": {"type": "server_error" if e.code in SERVER_CODES
                                                        else "invalid_request_error", "code": e.code,
                                                        "message": e.message, "param": None}})
            return
        if self.vllm and self.ended:
            await self.vllm_done()

    async def _speech_started(self, segment_id: int, audio_s: float) -> str:
        """The segment's item (speech_started goes out once, with its first event)."""
        item = self.items.get(segment_id)
        if item is None:
            item = self.items[segment_id] = f"item_{self.id[5:13]}_{segment_id}"
            await self.send({"type": "input_audio_buffer.speech_started", "item_id": item,
                             "audio_start_ms": int(round(audio_s * 1000))})
        return item

    async def _speech_stopped(self, segment_id: int, audio_s: float) -> None:
        if segment_id in self.stopped:
            return
        item = await self._speech_started(segment_id, audio_s)
        self.stopped.add(segment_id)
        await self.send({"type": "input_audio_buffer.speech_stopped", "item_id": item,
                         "audio_end_ms": int(round(audio_s * 1000))})
        await self.send({"type": "input_audio_buffer.committed", "item_id": item,
                         "previous_item_id": self.last_item})
        self.last_item = item

    async def _transcript(self, t: Transcript) -> None:
        e = t.event
        item = await self._speech_started(e.segment_id, e.start_s)
        if e.committed_delta:
            self.texts[e.segment_id] = self.texts.get(e.segment_id, "") + e.committed_delta
            await self.send({"type": "conversation.item.input_audio_transcription.delta", "item_id": item,
                             "content_index": 0, "delta": e.committed_delta})
        if e.is_final:
            await self._speech_stopped(e.segment_id, e.end_s)  # (said already by the turn event)
            self.stopped.discard(e.segment_id)
            await self.send({"type": "conversation.item.input_audio_transcription.completed", "item_id": item,
                             "content_index": 0, "transcript": self.texts.get(e.segment_id, "").strip(),
                             "usage": {"type": "duration", "seconds": round(max(0.0, e.end_s - e.start_s), 3)}})

    async def _vllm_transcript(self, t: Transcript) -> None:
        e = t.event
        if e.committed_delta:  # as a delta of the whole text: segments joined as transcript_text joins them
            before = transcript_text(self.texts)
            self.texts[e.segment_id] = self.texts.get(e.segment_id, "") + e.committed_delta
            after = transcript_text(self.texts)
            if after.startswith(before) and len(after) > len(before):
                await self.send({"type": "transcription.delta", "delta": after[len(before):]})

    async def vllm_done(self) -> None:
        """vLLM's end of a session: the whole text once the stream has ended after `final`."""

        await self.send({"type": "transcription.done", "text": transcript_text(self.texts),
                         "usage": {"type": "duration", "seconds": 0}})
