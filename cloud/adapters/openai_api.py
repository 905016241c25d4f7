"""OpenAI-compatible transcription on `harken serve`'s HTTP port (`--http-port`), beside the WebRTC
endpoints, so that code written for OpenAI's API (or for vLLM's Qwen3-ASR server, which speaks the
same) works against harken unchanged:

    POST /v1/audio/transcriptions   multipart: file, model, language, prompt, response_format
                                    (json | text | srt | vtt | verbose_json | diarized_json), stream (true: server-sent
                                    `transcript.text.delta` / `transcript.text.done` events)
    GET  /v1/models                 the served model

Every request goes through the serving engine, beside the live streams (no engine of its own):
`json`, `text` and `stream=true` are `harken transcribe`'s offline passes (cut at quiet points like
the official package), batched with every other file in flight (`Scheduler.transcribe` / `.pieces`,
cloud/inference/file_passes.py), streamed a piece at a time; `srt`, `vtt` and `verbose_json` are a
session of the engine fed ahead of real time (cloud/hosting/file_stream.py), their segments and cues
those of `harken transcribe --format srt`. `prompt` is Qwen3-ASR's context, `language` a name or ISO
639 code. The server transcribes `--max-files` files together and holds `--file-queue` more waiting;
past that a request gets 429 with Retry-After. Errors have OpenAI's shape,
`{"error": {"message", "type", "code"}}`, with the HTTP status OpenAI uses: 400 (bad request, audio
too long), 401 (API keys as Bearer tokens, as on gRPC), 413 (upload too large), 429 (files full),
500 (the model failed on the file).

`diarized_json` (OpenAI's speaker-labelled form): `verbose_json`'s segments, each labelled as a live
harken session labels its finals (cloud/inference/diarization.py), after every relabel: the file's VAD
segments, which are the engine's segments, labelled from their features (`speaker_turns`, in the
executor). The speakers are named as OpenAI names speakers it was not told about: "A", "B", ... for
harken's S1, S2, ...; `{"task", "duration", "text", "segments": [{"type": "transcript.text.segment", "id",
"start", "end", "text", "speaker"}], "usage"}`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base.auth import ApiKeys, check_http
from ..base.errors import Unauthenticated
from ...shared.errors import HarkenError, Overloaded
from ...shared.subtitles import cues_of, srt, vtt
from ...shared.text import TranscriptText, join_texts
from ...shared.features_spec import SAMPLE_RATE
from ..inference.decoder_stream import SessionOptions, check_context
from ..inference.file_passes import FileTicket
from ..inference.offline import OfflineTranscript
from ..inference.scheduler import Scheduler
from ..hosting.file_stream import stream_file_events
from ..embedded import speaker_at, speaker_turns
from ..model.prompt import forced_language
from ..model.tokenizer import ASR_TEXT
from ...edge.audio import load_audio, peak_normalize

log = logging.getLogger(__name__)

TRANSCRIPTIONS_PATH = "/v1/audio/transcriptions"
MODELS_PATH = "/v1/models"
FORMATS = ("json", "text", "srt", "vtt", "verbose_json", "diarized_json")
RETRY_AFTER_S = 5  # the hint a 429 carries
DISCONNECT_POLL_S = 0.25  # how often a request in work looks whether its client is still there
MAX_FIELD_BYTES = 64_000  # a form field other than the file
MAX_FORM_FIELD_BYTES = 1 << 20  # all of them
MAX_PARTS = 64


@dataclass(frozen=True)
class ApiLimits:
    max_upload_bytes: int = 25 * 1024 * 1024  # OpenAI's own limit for this endpoint
    max_audio_s: float = 3 * 3600.0


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
    logprobs: bool = False  # `include[]=logprobs` (json): each token with its log probability


class TranscriptionAPI:
    """The routes, bound to the serving engine's scheduler (its model: the served one) and the
    server's API keys."""

    def __init__(self, scheduler: Scheduler, model_id: str, keys: ApiKeys | None, limits: ApiLimits = ApiLimits()):
        self.scheduler, self.model_id, self.keys, self.limits = scheduler, model_id, keys, limits
        self.asr = scheduler.engine.asr

    def add_routes(self, app) -> None:
        app.router.add_post(TRANSCRIPTIONS_PATH, self.transcriptions)
        app.router.add_get(MODELS_PATH, self.models)

    def close(self) -> None:
        """Nothing of its own to release: files are the scheduler's."""

    async def admit(self) -> FileTicket:
        """A place for one file (taken as the request arrives), or 429 with Retry-After."""
        try:
            return await self.scheduler.file_place()
        except Overloaded as e:
            raise ApiError(429, str(e), "rate_limit_exceeded", "rate_limit_exceeded",
                           retry_after_s=RETRY_AFTER_S) from None

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
            ticket = await self.admit()
        except ApiError as e:
            return web.json_response(e.body(), status=e.status, headers=e.headers)
        try:
            req = await self._read(request)
            if req.stream:
                return await self._stream(request, req, ticket)
            if req.response_format in ("json", "text"):
                out = await _while_connected(request, self.scheduler.transcribe(
                    req.audio, req.language, req.prompt, ticket=ticket))
                return _offline_response(req, out, self.asr.tokenizer)
            try:
                events = await _while_connected(request, stream_file_events(self.scheduler, 
                    req.audio, SessionOptions(language=req.language, context=req.prompt)))
            except Overloaded as e:  # the engine's sessions are all taken
                raise ApiError(429, str(e), "rate_limit_exceeded", "rate_limit_exceeded",
                               retry_after_s=RETRY_AFTER_S) from None
            if req.response_format == "diarized_json":
                turns = await asyncio.get_running_loop().run_in_executor(None, speaker_turns, req.audio)
                return _diarized_response(req, events, turns)
            return _response(req, events)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status, headers=e.headers)
        except Exception as e:  # noqa: BLE001 - the model failed on it: OpenAI's shape, never a traceback
            log.warning("file transcription failed", exc_info=True)
            e2 = ApiError(500, f"transcription failed ({type(e).__name__})", "server_error", "transcription_failed")
            return web.json_response(e2.body(), status=e2.status)
        finally:
            ticket.release()

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

    async def _stream(self, request, req: Request, ticket: FileTicket):
        """Server-sent events as the file is decoded: a `transcript.text.delta` per piece (pass) of
        the offline transcript, then `transcript.text.done` with the whole text."""
        from aiohttp import web

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        text = ""
        try:
            async for piece in self.scheduler.pieces(req.audio, req.language, req.prompt, ticket=ticket):
                delta = join_texts(text, piece.text) + piece.text
                text += delta
                if delta:
                    await _sse(response, {"type": "transcript.text.delta", "delta": delta})
            await _sse(response, {"type": "transcript.text.done", "text": text})
        except Exception:  # noqa: BLE001 - the model failed on it: an error event, never a traceback
            log.warning("streamed file transcription failed", exc_info=True)
            await _sse(response, {"type": "error", "error": {"message": "transcription failed",
                                                             "type": "server_error", "code": None}})
        await response.write_eof()
        return response


async def _while_connected(request, work):
    """Await `work` (a coroutine), cancelled if the client goes away meanwhile (aiohttp lets a
    handler run on after a disconnect): a file whose client left frees its place."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            transport = request.transport
            if transport is None or transport.is_closing():
                task.cancel()
                raise ApiError(499, "the client went away", code="client_closed")
    finally:
        if not task.done():
            task.cancel()


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


def _offline_response(req: Request, out: OfflineTranscript, tokenizer):
    """json / text: the offline transcript (`harken transcribe`'s text)."""
    from aiohttp import web

    if req.response_format == "text":
        return web.Response(text=out.text + "\n", content_type="text/plain")
    body: dict[str, Any] = {"text": out.text}
    if req.logprobs:
        body["logprobs"] = token_logprobs(out, tokenizer)
    return web.json_response(body, dumps=_dumps)


def token_logprobs(out: OfflineTranscript, tokenizer) -> list[dict]:
    """OpenAI's `logprobs`, one entry per token of the transcript text as OpenAI gives them: the
    token, its log probability as the model gave it in the pass, and its bytes. The answer's
    `language X<asr_text>` header is not text: its tokens are left out."""
    marker = tokenizer.token_id(ASR_TEXT)
    entries = []
    for piece in out.pieces:
        ids, probs = piece.token_ids, piece.token_probs
        start = ids.index(marker) + 1 if marker in ids else 0
        for t, p in zip(ids[start:], probs[start:]):
            raw = tokenizer.token_bytes(t)
            entries.append({"token": raw.decode("utf-8", errors="replace"),
                            "logprob": math.log(max(p, 1e-300)), "bytes": list(raw)})
    return entries


def _response(req: Request, events: list):
    """srt / vtt / verbose_json: the engine's segments, as `harken transcribe --format srt` has them."""
    from aiohttp import web

    text = TranscriptText()
    for e in events:
        text.add(e)
    if req.response_format in ("srt", "vtt"):
        cues = cues_of(events)
        return web.Response(text=srt(cues) if req.response_format == "srt" else vtt(cues),
                            content_type="application/x-subrip" if req.response_format == "srt" else "text/vtt")
    language = next((e.language for e in events if e.language), req.language or "")
    segments = [{"id": i, "seek": 0, "start": c.start_s, "end": c.end_s, "text": c.text, "tokens": [],
                 "temperature": 0.0, "avg_logprob": 0.0, "compression_ratio": 0.0, "no_speech_prob": 0.0}
                for i, c in enumerate(cues_of(events))]
    return web.json_response({"task": "transcribe", "language": language.lower(),
                              "duration": round(len(req.audio) / SAMPLE_RATE, 3), "text": text.text,
                              "segments": segments}, dumps=_dumps)


def _diarized_response(req: Request, events: list, turns: list[tuple[float, float, str]]):
    """diarized_json: the engine's segments, each with the speaker of the VAD segment it is."""
    from aiohttp import web

    duration = round(len(req.audio) / SAMPLE_RATE, 3)
    segments = [{"type": "transcript.text.segment", "id": f"seg_{i}", "start": round(c.start_s, 3),
                 "end": round(c.end_s, 3), "text": c.text,
                 "speaker": _letter(speaker_at(turns, (c.start_s + c.end_s) / 2) or "S1")}
                for i, c in enumerate(cues_of(events))]
    return web.json_response({"task": "transcribe", "duration": duration, "text": _text(events), "segments": segments,
                              "usage": {"type": "duration", "seconds": duration}}, dumps=_dumps)


def _text(events: list) -> str:
    text = TranscriptText()
    for e in events:
        text.add(e)
    return text.text


def _letter(speaker: str) -> str:
    """harken's S1, S2, ... as OpenAI names speakers it was not told about: A, B, ..., Z, AA, AB, ..."""
    n = int(speaker[1:]) if speaker[1:].isdigit() else 1
    out = ""
    while n > 0:
        n, r = divmod(n - 1, 26)
        out = chr(ord("A") + r) + out
    return out


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def api_for(handler, keys: ApiKeys | None, limits: ApiLimits) -> TranscriptionAPI | None:
    """The API on the serving engine (its model under the id `Qwen3ASR.describe()` gives), or None
    where there is none."""
    scheduler = getattr(getattr(handler, "table", None), "scheduler", None)
    asr = getattr(getattr(scheduler, "engine", None), "asr", None)
    if scheduler is None or asr is None:
        return None
    describe = getattr(asr, "describe", None)
    model_id = describe()["model"] if callable(describe) else "harken"
    return TranscriptionAPI(scheduler, model_id, keys, limits)

