"""Deepgram's listen API on `harken serve --http-port`, as Deepgram's SDK, LiveKit's and Pipecat's
Deepgram plugins speak it, so a bot written for Deepgram points at harken by changing its base URL:

    GET  /v1/listen (WebSocket)   live: binary frames of audio in, JSON `Results` / `SpeechStarted` /
                                  `UtteranceEnd` / `Metadata` out; `KeepAlive`, `Finalize`,
                                  `CloseStream`, `Configure` in
    POST /v1/listen               pre-recorded: the audio file (or raw audio as the query names it) as
                                  the body, one JSON answer

A live connection is one harken stream per audio channel (`multichannel=true`; else the channels
are mixed to one), each a thin client of the one stream handler (the server's VAD, features and
batches, as gRPC, WebRTC and OpenAI realtime): the text is harken's committed text. How it maps:

    an interim Results     a segment's committed text + its partial (`interim_results=true`)
    a final Results        the segment's final event: all its text; `speech_final` when the VAD ended
                           the speech (`endpointing` not false), `from_finalize` when a Finalize did
    SpeechStarted          the VAD opened a segment (`vad_events=true`): harken's turn event, at once
    UtteranceEnd           the segment's speech is over (`utterance_end_ms` set), after its final
    Finalize               harken's Finalize: the open segment ends at the audio sent so far and its
                           final comes at once, `from_finalize`; nothing open: an empty such final
    CloseStream            End: the remaining finals, then Metadata, then close 1000
    Configure              its keyterms replace the connection's from the next segment on (harken's
                           Configure); ConfigureSuccess

Words: `word` / `punctuated_word` as harken writes them; `start` / `end` spread over the segment's
span by their length (harken's own times need the aligner); `confidence` on finals the mean
probability the model gave the word's tokens (harken's `word_confidence`), the alternative's their
mean; interim words 1.0 (not scored before the final pass).
Parameters harken has no use for are accepted and ignored; `docs/deepgram.md` has the table. The
request side (parameters, credentials, audio decoding) is cloud/adapters/deepgram_request.py.
Pre-recorded audio is read as `harken transcribe` reads a file: its offline pass.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import re
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

import numpy as np

from .deepgram_request import (AudioDecoder, ListenParams, ParamError, decode_file,
                                                   deepgram_metadata)
from ..base.auth import ApiKeys
from ..base.errors import Unauthenticated
from ..hosting.stream_handler import RequestQueue, StreamFailed, StreamHandler
from ...shared import wire
from ...shared.errors import HarkenError, Overloaded
from ...shared.features_spec import SAMPLE_RATE
from ...shared.protocol import (Ack, Audio, ClientMessage, Configure, End, Finalize, ServerError, Start,
                                    Transcript, Turn)
from ...shared.transcript import SPEECH_STARTED
from ..model.prompt import LANGUAGE_CODES
from ...shared.wire import MAX_KEYTERM_CHARS, MAX_KEYTERMS

log = logging.getLogger("harken.deepgram")

LISTEN_PATH = "/v1/listen"
IDLE_CLOSE_S = 10.0  # no frame at all for this long: close 1011 NET-0001, as Deepgram does
PIECE_S = 0.1  # audio per harken Audio message
MAX_FRAME_BYTES = 4 << 20
MAX_QUEUED_MESSAGES = 16  # per channel: past it the socket is not read (TCP pushes back)
_WORD_EDGES = re.compile(r"^[^\w]+|[^\w]+$")


# ---- the JSON messages --------------------------------------------------------------------------

def words_of(transcript: str, start_s: float, end_s: float, confidence: tuple[float, ...] = ()) -> list[dict]:
    """Deepgram's word objects for `transcript` spread over [start_s, end_s] by character count,
    each with its confidence (harken's per-word confidence where it has one for every word, else 1.0)."""
    tokens = transcript.split()
    if len(confidence) != len(tokens):
        confidence = (1.0,) * len(tokens)
    total = sum(len(t) for t in tokens) or 1
    span, at, out = max(0.0, end_s - start_s), start_s, []
    for t, c in zip(tokens, confidence):
        end = at + span * len(t) / total
        out.append({"word": _WORD_EDGES.sub("", t).lower() or t.lower(), "start": round(at, 3), "end": round(end, 3),
                    "confidence": c, "punctuated_word": t})
        at = end
    return out


def speaker_number(speaker: str) -> int:
    """harken's S1, S2, ... as Deepgram numbers speakers: 0, 1, ..."""
    return int(speaker[1:]) - 1 if speaker[1:].isdigit() else 0


def label_words(words: list[dict], audio: np.ndarray) -> None:
    """Pre-recorded `diarize=true`: each word's `speaker`, the one speaking at its middle (the file's
    VAD segments labelled as a live session's are: `speaker_turns`)."""
    from ..embedded import speaker_at, speaker_turns

    turns = speaker_turns(audio)
    for w in words:
        w["speaker"] = speaker_number(speaker_at(turns, (w["start"] + w["end"]) / 2) or "S1")


def model_info(model_id: str) -> tuple[str, dict]:
    model_uuid = str(uuid.uuid5(uuid.NAMESPACE_URL, "harken:" + model_id))
    return model_uuid, {"name": model_id, "version": "1", "arch": "harken"}


# ---- live ---------------------------------------------------------------------------------------

@dataclass
class _Segment:
    text: str = ""  # committed so far
    confidence: tuple[float, ...] = ()  # its words' confidence, from its items' final passes
    finalize_asked: bool = False  # a Finalize came while it was open: its final says from_finalize
    ended_at_s: float | None = None  # the VAD's utterance end (an UtteranceEnd follows the final)


@dataclass
class _Channel:
    """One harken stream: one audio channel of the connection."""

    index: int
    requests: RequestQueue = field(default_factory=RequestQueue)
    seq: itertools.count = field(default_factory=lambda: itertools.count(1))
    buffered: list[np.ndarray] = field(default_factory=list)
    buffered_samples: int = 0
    segments: dict[int, _Segment] = field(default_factory=dict)  # open: started, not yet final
    last_seq: int = 0  # the last Audio message's seq
    finalizes: list[int] = field(default_factory=list)  # Finalize requests not yet settled: the seq before each
    task: asyncio.Task | None = None


class DeepgramListen:
    """The /v1/listen routes on the stream handler (live) and the served model (pre-recorded)."""

    def __init__(self, handler: StreamHandler, keys: ApiKeys | None, model_id: str, files=None):
        self.handler, self.keys, self.model_id = handler, keys, model_id
        self.files = files  # the OpenAI file API (the scheduler, the upload limits), for pre-recorded audio

    def add_routes(self, app) -> None:
        app.router.add_get(LISTEN_PATH, self.live)
        app.router.add_post(LISTEN_PATH, self.prerecorded)

    def _refusal(self, status: int, message: str, request_id: str, code: str):
        from aiohttp import web

        return web.json_response({"err_code": code, "err_msg": message, "request_id": request_id}, status=status,
                                 headers={"dg-error": message[:500], "dg-request-id": request_id})

    def _check(self, request, request_id: str) -> tuple[tuple, bool, ListenParams]:
        metadata, as_protocol = deepgram_metadata(request.headers)
        if self.keys is not None:
            try:
                self.keys.authenticate(metadata)
            except Unauthenticated as e:
                raise _Refused(401, f"invalid credentials: {e}", "INVALID_AUTH") from None
        try:
            params = ListenParams.parse(request.query)
        except ParamError as e:
            raise _Refused(400, str(e), "Bad Request") from None
        return metadata, as_protocol, params

    async def live(self, request):
        from aiohttp import web

        request_id = str(uuid.uuid4())
        try:
            metadata, as_protocol, params = self._check(request, request_id)
        except _Refused as e:
            return self._refusal(e.status, e.message, request_id, e.code)
        ws = web.WebSocketResponse(protocols=("token",) if as_protocol else (), max_msg_size=MAX_FRAME_BYTES,
                                   autoping=True)
        if not ws.can_prepare(request).ok:
            return self._refusal(400, "/v1/listen with GET is a WebSocket: connect with 'Upgrade: websocket', "
                                      "or POST the audio", request_id, "Bad Request")
        ws.headers["dg-request-id"] = request_id
        await ws.prepare(request)
        await _Live(self, ws, metadata, params, request_id).run()
        return ws

    async def prerecorded(self, request):
        from aiohttp import web

        request_id = str(uuid.uuid4())
        try:
            _, _, params = self._check(request, request_id)
            if self.files is None:
                raise _Refused(503, "this server has no model for pre-recorded audio", "UNAVAILABLE")
            files = self.files
            try:  # a place for the file as the request arrives (each channel is a file in the engine)
                ticket = await files.scheduler.file_place()
            except Overloaded as e:
                raise _Refused(429, str(e), "TOO_MANY_REQUESTS") from None
        except _Refused as e:
            return self._refusal(e.status, e.message, request_id, e.code)
        try:
            body = await self._body(request, files.limits.max_upload_bytes, request_id)
            loop = asyncio.get_running_loop()
            try:
                channels = await loop.run_in_executor(None, lambda: decode_file(body, params))
            except HarkenError as e:
                raise _Refused(400, str(e), "Bad Request") from None
            if max(c.size for c in channels) / SAMPLE_RATE > files.limits.max_audio_s:
                raise _Refused(400, f"the audio is longer than this server takes ({files.limits.max_audio_s:.0f} s)",
                               "Bad Request")
            # `harken transcribe`'s passes in the serving engine, the channels batched together
            tasks = [asyncio.ensure_future(files.scheduler.transcribe(a, params.language, params.context,
                                                                      ticket=ticket if i == 0 else None))
                     for i, a in enumerate(channels)]
            try:
                outs = await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                raise
        except Overloaded as e:
            return self._refusal(429, str(e), request_id, "TOO_MANY_REQUESTS")
        except _Refused as e:
            return self._refusal(e.status, e.message, request_id, e.code)
        except Exception as e:  # noqa: BLE001 - the model failed on it: said, never a traceback
            log.warning("pre-recorded transcription failed", exc_info=True)
            return self._refusal(500, f"transcription failed ({type(e).__name__})", request_id, "INTERNAL")
        finally:
            ticket.release()
        model_uuid, info = model_info(self.model_id)
        duration = round(max(c.size for c in channels) / SAMPLE_RATE, 3)
        results = []
        for out, audio in zip(outs, channels):
            words = [w for p in out.pieces for w in words_of(p.text, p.start_s, p.end_s)]
            if params.diarize:
                await asyncio.get_running_loop().run_in_executor(None, label_words, words, audio)
            alternative = {"transcript": out.text, "confidence": 1.0, "words": words}
            channel: dict[str, Any] = {"alternatives": [alternative]}
            if out.language:
                channel["detected_language"] = _language_code(out.language)
            results.append(channel)
        return web.json_response({
            "metadata": {"transaction_key": "deprecated", "request_id": request_id,
                         "sha256": hashlib.sha256(body).hexdigest(), "created": _now_iso(), "duration": duration,
                         "channels": len(results), "models": [model_uuid], "model_info": {model_uuid: info}},
            "results": {"channels": results}}, headers={"dg-request-id": request_id})

    async def _body(self, request, limit: int, request_id: str) -> bytes:
        if request.content_type == "application/json":
            raise _Refused(400, "harken takes the audio as the request body; a URL to fetch it from is not taken",
                           "Bad Request")
        if request.content_length is not None and request.content_length > limit:
            raise _Refused(413, f"the audio is larger than this server's limit of {limit // (1 << 20)} MiB",
                           "Payload Too Large")
        body = bytearray()
        async for chunk in request.content.iter_chunked(1 << 16):
            body += chunk
            if len(body) > limit:
                raise _Refused(413, f"the audio is larger than this server's limit of {limit // (1 << 20)} MiB",
                               "Payload Too Large")
        if not body:
            raise _Refused(400, "the request has no audio", "Bad Request")
        return bytes(body)


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _language_code(name: str) -> str:
    return next((code for code, n in LANGUAGE_CODES.items() if n == name), name.lower())


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _Live:
    """One live WebSocket: its channels' harken streams and the event mapping."""

    def __init__(self, api: DeepgramListen, ws, metadata: tuple, params: ListenParams, request_id: str):
        self.api, self.ws, self.metadata, self.params, self.request_id = api, ws, metadata, params, request_id
        self.decoder = AudioDecoder(params)
        self.channels = [_Channel(c) for c in range(params.streams)]
        self.sha = hashlib.sha256()
        self.closing = False  # CloseStream (or the socket) ended the input
        self.last_frame = time.monotonic()
        self.model_uuid, self.model_info = model_info(api.model_id)

    async def send(self, message: dict) -> None:
        if not self.ws.closed:
            try:
                await self.ws.send_str(json.dumps(message, ensure_ascii=False))
            except ConnectionError:  # the client went away mid-write (Pipecat closes right after CloseStream)
                pass

    async def error(self, description: str, message: str = "") -> None:
        await self.send({"type": "Error", "variant": "SchemaError", "description": description,
                         "message": message[:200]})

    async def run(self) -> None:
        from aiohttp import WSMsgType

        watchdog = asyncio.get_running_loop().create_task(self._watch_idle())
        try:
            async for msg in self.ws:
                self.last_frame = time.monotonic()
                if msg.type == WSMsgType.BINARY:
                    if not msg.data:  # an empty frame: the legacy CloseStream
                        await self._close_stream()
                        break
                    if not await self._audio(msg.data):
                        break
                elif msg.type == WSMsgType.TEXT:
                    if await self._control(msg.data):
                        break
        finally:
            watchdog.cancel()
            await self._end_streams(wait=not self.ws.closed)

    async def _watch_idle(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if time.monotonic() - self.last_frame > IDLE_CLOSE_S and not self.closing:
                await self.error("no audio or message for 10 s", "NET-0001")
                await self.ws.close(code=1011, message=b"NET-0001")
                return

    async def _audio(self, data: bytes) -> bool:
        if self.closing:
            await self.error("audio after CloseStream is not taken")
            return True
        self.sha.update(data)
        try:
            parts = self.decoder.feed(data)
        except HarkenError as e:
            await self.error(str(e), "DATA-0000")
            await self.ws.close(code=1008, message=b"DATA-0000")
            return False
        rate = self.decoder.rate or SAMPLE_RATE
        for ch, samples in zip(self.channels, parts):
            task = self._started(ch)
            if samples.size:
                ch.buffered.append(samples)
                ch.buffered_samples += samples.size
            if ch.buffered_samples >= rate * PIECE_S:
                self._flush(ch)
            while ch.requests.queue.qsize() > MAX_QUEUED_MESSAGES and not task.done():
                await asyncio.sleep(0.02)
        return True

    def _started(self, ch: _Channel) -> asyncio.Task:
        """The channel's harken stream, its Start first in line (begun with the channel's first audio)."""
        if ch.task is None:
            start = Start(language=self.params.language or "", keyterms=self.params.keyterms, turn_events=True,
                          diarize=self.params.diarize)
            ch.requests.put(wire.client_message_to_proto(start).SerializeToString())
            ch.task = asyncio.get_running_loop().create_task(self._stream(ch))
        return ch.task

    def _flush(self, ch: _Channel) -> None:
        if ch.buffered_samples:
            pcm = np.concatenate(ch.buffered).astype("<i2").tobytes()
            ch.last_seq = next(ch.seq)
            self._put(ch, Audio(ch.last_seq, pcm, self.decoder.rate or SAMPLE_RATE))
            ch.buffered, ch.buffered_samples = [], 0

    def _put(self, ch: _Channel, msg: ClientMessage) -> None:
        ch.requests.put(wire.client_message_to_proto(msg).SerializeToString())

    async def _control(self, text: str) -> bool:
        """A JSON control message; True when the connection is done."""
        try:
            message = json.loads(text)
        except (ValueError, RecursionError):
            await self.error("text frames are JSON control messages", text)
            return False
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "KeepAlive":
            return False
        if kind == "Finalize":
            await self._finalize()
            return False
        if kind == "CloseStream":
            await self._close_stream()
            return True
        if kind == "Configure":
            await self._configure(message, text)
            return False
        await self.error(f"unknown control message type {str(kind)[:60]!r}", text)
        return False

    async def _configure(self, message: dict, text: str) -> None:
        """Deepgram's Configure: its keyterms (a list of strings) from the next segment on."""

        keyterms = message.get("keyterms", [])
        if not isinstance(keyterms, list) or not all(isinstance(k, str) for k in keyterms) \
                or len(keyterms) > MAX_KEYTERMS or any(len(k) > MAX_KEYTERM_CHARS for k in keyterms):
            await self.send({"type": "ConfigureFailure", "request_id": self.request_id, "code": "INVALID_KEYTERMS",
                             "description": f"keyterms: a list of at most {MAX_KEYTERMS} strings of at most "
                                            f"{MAX_KEYTERM_CHARS} characters"})
            return
        self.params = replace(self.params, keyterms=tuple(keyterms))
        for ch in self.channels:
            if ch.task is not None and not ch.task.done():
                self._flush(ch)
                self._put(ch, Configure(tuple(keyterms)))
        await self.send({"type": "ConfigureSuccess", "request_id": self.request_id, "keyterms": keyterms})

    async def _finalize(self) -> None:
        """harken's Finalize after the audio sent so far. Its Ack says the server has applied the
        audio before it, so every segment that audio opened is known then (`_settle`)."""
        for ch in self.channels:
            if ch.task is not None and not ch.task.done():
                self._flush(ch)
                ch.finalizes.append(ch.last_seq)
                self._put(ch, Finalize())
            else:
                await self._empty_final(ch)

    async def _settle(self, ch: _Channel, ack: Ack) -> None:
        """Finalize requests the Ack covers: the segments still open then end with it (their finals
        say from_finalize); none open: Deepgram still answers with an empty finalized final."""
        while ch.finalizes and ack.seq >= ch.finalizes[0]:
            ch.finalizes.pop(0)
            for seg in ch.segments.values():
                seg.finalize_asked = True
            if not ch.segments:
                await self._empty_final(ch)

    async def _empty_final(self, ch: _Channel) -> None:
        await self.send(self._results(ch, 0.0, 0.0, "", is_final=True, speech_final=False, from_finalize=True))

    async def _close_stream(self) -> None:
        await self._end_streams(wait=True)
        await self.send({"type": "Metadata", "transaction_key": "deprecated", "request_id": self.request_id,
                         "sha256": self.sha.hexdigest(), "created": _now_iso(),
                         "duration": round(self.decoder.samples / (self.decoder.rate or SAMPLE_RATE), 3),
                         "channels": len(self.channels)})
        await self.ws.close(code=1000)

    async def _end_streams(self, wait: bool) -> None:
        if not self.closing:
            self.closing = True
            for ch in self.channels:
                if ch.task is not None:
                    self._flush(ch)
                    self._put(ch, End())
                    ch.requests.end()
        tasks = [ch.task for ch in self.channels if ch.task is not None]
        if not tasks:
            return
        if wait:
            await asyncio.wait(tasks, timeout=60)
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- harken's events -> Deepgram's ---------------------------------------------------------

    async def _stream(self, ch: _Channel) -> None:
        handler = self.api.handler
        try:
            async with aclosing(handler.run(self.metadata, handler.parse(ch.requests))) as messages:
                async for out in messages:
                    if isinstance(out, Transcript):
                        await self._transcript(ch, out)
                    elif isinstance(out, Turn):
                        await self._turn(ch, out)
                    elif isinstance(out, Ack):
                        await self._settle(ch, out)
                    elif isinstance(out, ServerError):
                        await self.error(out.message, out.code)
        except StreamFailed as e:
            await self.error(e.message, e.code)
            if not self.ws.closed:  # the server's fault: 1011; the client's (bad input, its limits): 1008
                server = e.code in ("INTERNAL", "UNAVAILABLE", "UNKNOWN", "DATA_LOSS")
                await self.ws.close(code=1011 if server else 1008, message=e.code.encode()[:120])

    async def _turn(self, ch: _Channel, t: Turn) -> None:
        e = t.turn
        if e.kind == SPEECH_STARTED:
            ch.segments.setdefault(e.segment_id, _Segment())
            if self.params.vad_events:
                await self.send({"type": "SpeechStarted", "channel": [ch.index], "timestamp": round(e.audio_s, 3)})
        else:
            ch.segments.setdefault(e.segment_id, _Segment()).ended_at_s = e.audio_s

    async def _transcript(self, ch: _Channel, t: Transcript) -> None:
        e = t.event
        seg = ch.segments.setdefault(e.segment_id, _Segment())
        seg.text += e.committed_delta
        seg.confidence += e.word_confidence
        if not e.is_final:
            text = (seg.text + e.partial).strip()
            if self.params.interim_results and text:
                await self.send(self._results(ch, e.start_s, e.end_s, text, is_final=False, speech_final=False,
                                              from_finalize=False))
            return
        del ch.segments[e.segment_id]
        # speech_final: the VAD heard the speech end (a Finalize that came after that does not change
        # it); from_finalize: a Finalize cut the segment, or came while its final was due
        await self.send(self._results(ch, e.start_s, e.end_s, seg.text.strip(), is_final=True,
                                      speech_final=self.params.endpointing and not e.from_finalize,
                                      from_finalize=e.from_finalize or seg.finalize_asked, confidence=seg.confidence,
                                      speaker=e.speaker if self.params.diarize else ""))
        if self.params.utterance_end and seg.text.strip():
            last = seg.ended_at_s if seg.ended_at_s is not None else e.end_s
            await self.send({"type": "UtteranceEnd", "channel": [ch.index, len(self.channels)],
                             "last_word_end": round(min(last, e.end_s), 3)})

    def _results(self, ch: _Channel, start_s: float, end_s: float, transcript: str, is_final: bool,
                 speech_final: bool, from_finalize: bool, confidence: tuple[float, ...] = (),
                 speaker: str = "") -> dict:
        words = words_of(transcript, start_s, end_s, confidence)
        if speaker:  # Deepgram's speakers are integers from 0; its live API has no relabels (harken's are dropped)
            for w in words:
                w["speaker"] = speaker_number(speaker)
        overall = round(sum(w["confidence"] for w in words) / len(words), 4) if words else 0.0
        return {"type": "Results", "channel_index": [ch.index, len(self.channels)], "start": round(start_s, 3),
                "duration": round(max(0.0, end_s - start_s), 3), "is_final": is_final, "speech_final": speech_final,
                "from_finalize": from_finalize,
                "channel": {"alternatives": [{"transcript": transcript, "confidence": overall, "words": words}]},
                "metadata": {"request_id": self.request_id, "model_info": self.model_info,
                             "model_uuid": self.model_uuid}}


__all__ = ["DeepgramListen", "words_of", "model_info", "LISTEN_PATH"]
