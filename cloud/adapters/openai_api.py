"""OpenAI-compatible transcription on `harken serve`'s HTTP port (`--http-port`), beside the WebRTC
endpoints, so that code written for OpenAI's API (or for vLLM's Qwen3-ASR server, which speaks the
same) works against harken unchanged:

    POST /v1/audio/transcriptions   multipart: file, model, language, prompt, response_format
                                    (json | text | srt | vtt | verbose_json), stream (true: server-sent
                                    `transcript.text.delta` / `transcript.text.done` events)
    GET  /v1/models                 the served model

A file is transcribed as a live stream would be: through the edge pipeline (VAD, log-mel, codec)
and harken's streaming engine, on audio time, so its text is harken's committed text and its
segments (verbose_json, srt, vtt) are the engine's segments; `prompt` is Qwen3-ASR's context,
`language` a name or ISO 639 code. Whole-file requests run in a lane of their own (`lanes` worker
threads, each with its own one-session engine on the served model's weights, and at most
`queue` requests waiting), so a large upload never takes a live stream's place in the serving
engine; past that a request gets 429. Errors have OpenAI's shape,
`{"error": {"message", "type", "code"}}`, with the HTTP status OpenAI uses: 400 (bad request, audio
too long), 401 (API keys as Bearer tokens, as on gRPC), 413 (upload too large), 429 (lane full).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base.auth import ApiKeys, check_http
from ..base.errors import Unauthenticated
from ...shared.errors import HarkenError
from ...shared.subtitles import cues_of, srt, vtt
from ...shared.text import TranscriptText
from ...shared.features_spec import SAMPLE_RATE
from ..inference.decoder_stream import check_context
from ..model.prompt import forced_language
from ...edge.audio import load_audio, peak_normalize
from ..embedded import stream_audio
from ..inference.engine import Engine, EngineConfig
from ..inference.decoder_stream import SessionOptions

TRANSCRIPTIONS_PATH = "/v1/audio/transcriptions"
MODELS_PATH = "/v1/models"
FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
RETRY_AFTER_S = 5  # the hint a 429 carries
MAX_FIELD_BYTES = 64_000  # a form field other than the file
MAX_FORM_FIELD_BYTES = 1 << 20  # all of them
MAX_PARTS = 64


@dataclass(frozen=True)
class ApiLimits:
    max_upload_bytes: int = 25 * 1024 * 1024  # OpenAI's own limit for this endpoint
    max_audio_s: float = 3 * 3600.0
    lanes: int = 1  # whole-file requests transcribed at once
    queue: int = 4  # and waiting for a lane; more: 429


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Request:
    audio: Any  # 16 kHz mono float32
    language: str | None
    prompt: str
    response_format: str
    stream: bool
    logprobs: bool = False  # `include[]=logprobs` (json): each word with its log probability


class TranscriptionAPI:
    """The routes, bound to the served model (`asr`: a loaded Qwen3ASR) and the server's API keys."""

    def __init__(self, asr, model_id: str, keys: ApiKeys | None, limits: ApiLimits = ApiLimits()):
        self.asr, self.model_id, self.keys, self.limits = asr, model_id, keys, limits
        self.lane = ThreadPoolExecutor(max(1, limits.lanes), thread_name_prefix="harken-files")
        self.admitted = 0  # requests in the lane or waiting for it (event loop only)

    def add_routes(self, app) -> None:
        app.router.add_post(TRANSCRIPTIONS_PATH, self.transcriptions)
        app.router.add_get(MODELS_PATH, self.models)

    def close(self) -> None:
        self.lane.shutdown(wait=False, cancel_futures=True)

    # ---- handlers --------------------------------------------------------------------------------

    async def models(self, request):
        from aiohttp import web

        try:
            self._authenticate(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        return web.json_response({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": 0, "owned_by": "harken"}]})

    async def transcriptions(self, request):
        from aiohttp import web

        try:
            self._authenticate(request)
            if self.admitted >= self.limits.lanes + self.limits.queue:
                raise ApiError(429, f"the server transcribes {self.limits.lanes} file(s) at once and holds "
                                    f"{self.limits.queue} more waiting; try again later",
                               "rate_limit_exceeded", "rate_limit_exceeded", retry_after_s=RETRY_AFTER_S)
            self.admitted += 1
        except ApiError as e:
            return web.json_response(e.body(), status=e.status, headers=e.headers)
        try:
            req = await self._read(request)
            if req.stream:
                return await self._stream(request, req)
            try:
                events = await asyncio.get_running_loop().run_in_executor(self.lane, lambda: list(self._events(req)))
            except HarkenError as e:  # the model could not run it: said in OpenAI's shape, never a traceback
                raise ApiError(500, f"transcription failed: {e}", "server_error", "transcription_failed") from e
            return _response(req, events)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status, headers=e.headers)
        finally:
            self.admitted -= 1

    # ---- the request -----------------------------------------------------------------------------

    def _authenticate(self, request) -> None:
        try:
            check_http(self.keys, request.headers)
        except Unauthenticated as e:
            raise ApiError(401, str(e), "invalid_request_error", "invalid_api_key") from e

    async def _read(self, request) -> Request:
        """The multipart form, the file streamed to a temporary file under the upload limit."""
        from aiohttp import ClientPayloadError
        from aiohttp.http_exceptions import HttpProcessingError


        if request.content_length is not None and request.content_length > self.limits.max_upload_bytes + (1 << 16):
            raise ApiError(413, f"the upload is larger than this server's limit of "
                                f"{self.limits.max_upload_bytes // (1 << 20)} MiB", code="file_too_large", param="file")
        if not request.content_type.startswith("multipart/"):
            raise ApiError(400, "send multipart/form-data with a `file` part (as OpenAI's API takes it)")
        fields: dict[str, str] = {}
        with tempfile.TemporaryDirectory(prefix="harken-upload-") as tmp:
            path: Path | None = None
            try:
                path = await self._parts(request, Path(tmp) / "audio", fields)
            except ApiError:
                raise
            except (ValueError, LookupError, RuntimeError, AssertionError, ConnectionError, ClientPayloadError,
                    HttpProcessingError) as e:
                # aiohttp's multipart reader on a body that is not multipart as the headers say
                # (no or another boundary, a part cut short, part headers that are not HTTP headers)
                raise ApiError(400, f"the multipart body cannot be read ({type(e).__name__}: {str(e)[:120]})",
                               code="invalid_multipart") from None
            if path is None:
                raise ApiError(400, "no `file` part in the form", param="file")
            seconds = _duration_s(path)  # from the header, before any sample is read or resampled
            if seconds is not None and seconds > self.limits.max_audio_s:
                raise ApiError(400, f"the audio is {seconds:.0f} s long; this server takes at most "
                                    f"{self.limits.max_audio_s:.0f} s", code="audio_too_long", param="file")
            try:
                audio = await asyncio.get_running_loop().run_in_executor(None, lambda: peak_normalize(load_audio(path)))
            except HarkenError as e:
                raise ApiError(400, str(e).replace(str(path), "file"), code="invalid_file", param="file") from e
        if len(audio) / SAMPLE_RATE > self.limits.max_audio_s:
            raise ApiError(400, f"the audio is {len(audio) / SAMPLE_RATE:.0f} s long; this server takes at most "
                                f"{self.limits.max_audio_s:.0f} s", code="audio_too_long", param="file")
        response_format = fields.get("response_format", "json") or "json"
        if response_format not in FORMATS:
            raise ApiError(400, f"response_format must be one of {', '.join(FORMATS)}", param="response_format")
        try:
            language = forced_language(fields.get("language") or None)
        except HarkenError as e:
            raise ApiError(400, str(e), param="language") from e
        prompt = fields.get("prompt", "")
        try:
            check_context(self.asr.tokenizer, prompt)  # before any event: a streamed reply starts with 200
        except HarkenError as e:
            raise ApiError(400, str(e).replace("context", "the prompt"), param="prompt") from e
        stream = fields.get("stream", "false").strip().lower() in ("true", "1")
        logprobs = "logprobs" in fields.get("include[]", "") or "logprobs" in fields.get("include", "")
        return Request(audio, language, prompt, response_format, stream, logprobs)

    async def _parts(self, request, file_path: Path, fields: dict[str, str]) -> Path | None:
        """The form's parts: the file (to `file_path`, at most the upload limit) and the fields (as
        UTF-8, each at most MAX_FIELD_BYTES), as their bytes came: no part is decoded by its headers."""
        from aiohttp import BodyPartReader

        path = None
        field_bytes = 0  # all fields together: a chunked body has no Content-Length to refuse up front
        reader = await request.multipart()
        for n in itertools.count():
            if (part := await reader.next()) is None:
                break
            if n >= MAX_PARTS:
                raise ApiError(400, f"the form has more than {MAX_PARTS} parts", code="invalid_multipart")
            if not isinstance(part, BodyPartReader):
                raise ApiError(400, "a nested multipart part is not taken; send the fields and the file as "
                                    "parts of one multipart/form-data body", code="invalid_multipart")
            name = part.name
            if name == "file":
                path = file_path
                size = 0
                with path.open("wb") as f:
                    while chunk := await part.read_chunk(1 << 16):
                        size += len(chunk)
                        if size > self.limits.max_upload_bytes:
                            raise ApiError(413, f"the file is larger than this server's limit of "
                                                f"{self.limits.max_upload_bytes // (1 << 20)} MiB",
                                           code="file_too_large", param="file")
                        f.write(chunk)
            else:
                value = bytearray()
                while chunk := await part.read_chunk(1 << 16):
                    value += chunk
                    field_bytes += len(chunk)
                    if field_bytes > MAX_FORM_FIELD_BYTES:
                        raise ApiError(413, "the form's fields are larger than this server takes "
                                            f"({MAX_FORM_FIELD_BYTES // (1 << 20)} MiB)", code="fields_too_large")
                    if len(value) > MAX_FIELD_BYTES:
                        raise ApiError(400, f"the form field {str(name)[:60]!r} is too long", param=name and str(name)[:60])
                if name:
                    try:
                        fields[name] = value.decode("utf-8")
                    except UnicodeDecodeError:
                        raise ApiError(400, f"the form field {name[:60]!r} is not UTF-8 text", param=name[:60]) from None
        return path

    def _events(self, req: Request) -> Iterator:
        """The file through the edge pipeline and a one-session engine on the served weights (in the lane)."""

        options = SessionOptions(language=req.language, context=req.prompt)
        engine = Engine(self.asr, EngineConfig(max_sessions=1, max_batch=1, slot_policy=options.policy))
        yield from stream_audio(req.audio, engine, options)

    async def _stream(self, request, req: Request):
        """Server-sent events as the file is decoded: a `transcript.text.delta` per piece of committed
        text, then `transcript.text.done` with the whole text."""
        from aiohttp import web

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()

        def produce() -> None:
            try:
                for event in self._events(req):
                    if stop.is_set():
                        return
                    loop.call_soon_threadsafe(queue.put_nowait, ("event", event))
                loop.call_soon_threadsafe(queue.put_nowait, ("done", None))
            except Exception as e:  # noqa: BLE001 (reported to the client as an error event)
                loop.call_soon_threadsafe(queue.put_nowait, ("error", e))

        work = loop.run_in_executor(self.lane, produce)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        text = TranscriptText()
        try:
            while True:
                kind, item = await queue.get()
                if kind == "event":
                    before = text.text
                    text.add(item)
                    after = text.text
                    if len(after) > len(before):
                        await _sse(response, {"type": "transcript.text.delta", "delta": after[len(before):]})
                elif kind == "done":
                    await _sse(response, {"type": "transcript.text.done", "text": text.text})
                    break
                else:
                    await _sse(response, {"type": "error", "error": {"message": "transcription failed",
                                                                     "type": "server_error", "code": None}})
                    break
        finally:
            stop.set()
            await work
        await response.write_eof()
        return response


def _duration_s(path: Path) -> float | None:
    """The file's duration as its header says (None where soundfile cannot tell): a WAV of a few
    bytes at 1 Hz is hours of audio once resampled to 16 kHz."""
    import soundfile as sf

    try:
        info = sf.info(str(path))
        return info.frames / info.samplerate if info.samplerate > 0 else None
    except Exception:  # noqa: BLE001 (load_audio says what is wrong with the file)
        return None


async def _sse(response, data: dict) -> None:
    await response.write(f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode())


def _response(req: Request, events: list):
    from aiohttp import web


    text = TranscriptText()
    for e in events:
        text.add(e)
    if req.response_format == "text":
        return web.Response(text=text.text + "\n", content_type="text/plain")
    if req.response_format in ("srt", "vtt"):
        cues = cues_of(events)
        return web.Response(text=srt(cues) if req.response_format == "srt" else vtt(cues),
                            content_type="application/x-subrip" if req.response_format == "srt" else "text/vtt")
    if req.response_format == "json":
        body: dict[str, Any] = {"text": text.text}
        if req.logprobs:  # per word, from the engine's word confidence (OpenAI gives them per token)
            body["logprobs"] = _word_logprobs(events)
        return web.json_response(body, dumps=_dumps)
    language = next((e.language for e in events if e.language), req.language or "")
    segments = [{"id": i, "seek": 0, "start": c.start_s, "end": c.end_s, "text": c.text, "tokens": [],
                 "temperature": 0.0, "avg_logprob": 0.0, "compression_ratio": 0.0, "no_speech_prob": 0.0}
                for i, c in enumerate(cues_of(events))]
    return web.json_response({"task": "transcribe", "language": language.lower(),
                              "duration": round(len(req.audio) / SAMPLE_RATE, 3), "text": text.text,
                              "segments": segments}, dumps=_dumps)


def _word_logprobs(events: list) -> list[dict]:
    """OpenAI's `logprobs` entries, a word each: an item's final event scores the item's words, the
    last ones of its segment's text so far (`TranscriptEvent.word_confidence`)."""
    texts: dict[int, str] = {}
    out = []
    for e in events:
        texts[e.segment_id] = texts.get(e.segment_id, "") + e.committed_delta
        if e.word_confidence:
            words = texts[e.segment_id].split()[-len(e.word_confidence):]
            out += [{"token": w, "logprob": round(math.log(max(c, 1e-12)), 4), "bytes": list(w.encode())}
                    for w, c in zip(words, e.word_confidence)]
    return out


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def api_for(handler, keys: ApiKeys | None, limits: ApiLimits) -> TranscriptionAPI | None:
    """The API on the served model (the serving engine's weights, under the id `Qwen3ASR.describe()`
    gives), or None where there is none."""
    asr = getattr(getattr(getattr(getattr(handler, "table", None), "scheduler", None), "engine", None), "asr", None)
    if asr is None:
        return None
    describe = getattr(asr, "describe", None)
    model_id = describe()["model"] if callable(describe) else "harken"
    return TranscriptionAPI(asr, model_id, keys, limits)

