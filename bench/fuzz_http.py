"""Fuzzing the HTTP port's OpenAI-compatible endpoints (issue 28), against a real served port.

`harken bench fuzz --http-examples N` and tests/test_fuzz.py drive it. `ServedHTTP` starts an
in-process `harken serve` (cloud/server.py: the tiny model, API keys, a small upload limit, one file
lane) with its HTTP port open on loopback; each example is one of:

    transcriptions  a raw HTTP/1.1 request to `POST /v1/audio/transcriptions`, written byte by byte
                    on a socket: multipart bodies with bad, missing, duplicated, nested, non-UTF-8,
                    over-long fields; files that are audio, broken audio (WAV headers claiming any
                    rate or channel count), or not audio; boundaries missing or wrong, bodies cut
                    short, Content-Length lies, chunked bodies, other content types, bad tokens
    models          `GET /v1/models` with good, bad, missing or non-ASCII tokens (and `GET /v1/realtime`
                    with no WebSocket upgrade)
    realtime        a WebSocket session on `/v1/realtime`: session.update of every shape (both
                    dialects), base64 audio good and bad, commits, clears, unknown and missing types,
                    text that is not JSON, JSON that is not an object, deeply nested JSON, binary
                    frames, events out of order (audio after the final commit, settings after the
                    audio, commits twice), closes and dropped connections

Properties (a broken one is a `Crash`, bench/fuzz_targets.py's):
- HTTP: the server answers (unless the request was cut short: then it may just close), never with a
  5xx; on our routes every 4xx is OpenAI's shape `{"error": {"message", "type", "code"}}` (aiohttp's
  own 400 for a request that is not HTTP aside); a bad token is 401; a 200 is the response format
  asked for.
- Realtime: every server event is a JSON object with a `type`, an `error` event has OpenAI's error
  shape; the server never ends the socket abnormally (1011, or a dropped connection) while the
  client keeps it open, and always answers the client's close.
- Neither: the server logs no unhandled exception (aiohttp's "Error handling request", asyncio's
  "exception was never retrieved"): each such record is a crash.
- Beside the fuzzing, a well-behaved Realtime client of another key (vLLM's dialect) streams the
  corpus's audio again and again and must get the text it gets alone; once the fuzzing is over and
  the grace period has passed, no session is left in the server's table or engine.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import random
import struct
import wave
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from harken.bench.fuzz_inputs import FuzzCorpus, random_json_text, random_text
from harken.bench.fuzz_targets import Crash, describe

HTTP_TARGETS = ("transcriptions", "models", "realtime")
HTTP_KEY, HTTP_REFERENCE_KEY = "sk-fuzz-http-0123456789", "sk-fuzz-reference-0123456789"
MAX_UPLOAD_BYTES = 256 * 1024  # the fuzzed server's upload limit: 8 s of 16 kHz PCM16
MAX_FILE_S = 20.0
REQUEST_DEADLINE_S = 120.0
CUT = "CUT"  # the request was cut short and the server closed without an answer: allowed
FIELDS = ("model", "language", "prompt", "response_format", "stream", "temperature", "timestamp_granularities[]",
          "include[]", "chunking_strategy")
FORMATS = ("json", "text", "srt", "vtt", "verbose_json")


# ---- inputs --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HttpRequest:
    """One raw request: written to the socket as it is (`cut`: the body is cut short, `cut_sent`
    bytes of it written, then the write side closed)."""

    raw: bytes
    route: bool = True  # on our route with its method: errors must be OpenAI's shape
    http_malformed: bool = False  # not well-formed HTTP: aiohttp's own 400 is fine
    good_key: bool = True
    cut: bool = False
    response_format: str = "json"
    stream: bool = False


@dataclass(frozen=True)
class RealtimeScript:
    """One WebSocket session: `frames` ("text" | "binary", data) or ("wait", seconds), then a close
    (or, `drop`, the connection dropped)."""

    headers: tuple[tuple[str, str], ...]
    frames: tuple[tuple[str, Any], ...]
    good_key: bool = True
    drop: bool = False


def wav_bytes(pcm: bytes, rate: int = 16_000, channels: int = 1) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    return out.getvalue()


def random_audio_file(rng: random.Random, corpus: FuzzCorpus) -> bytes:
    """A file part's bytes: a short WAV of the corpus, one with a header that lies, or not audio."""
    n = rng.randrange(1, min(len(corpus.pcm_pieces), 20) + 1)
    pcm = b"".join(corpus.pcm_pieces[:n])
    r = rng.randrange(10)
    if r < 4:
        return wav_bytes(pcm)
    if r == 4:  # the header's rate / channels / byte rate / block align / bits: any value
        data = bytearray(wav_bytes(pcm))
        offset, fmt = rng.choice(((22, "<H"), (24, "<I"), (28, "<I"), (32, "<H"), (34, "<H"), (40, "<I")))
        value = rng.choice((0, 1, 2, 3, 7, 255, 65535, 2**31 - 1, 2**32 - 1, 8000, 44100, 192000))
        struct.pack_into(fmt, data, offset, value & (0xFFFF if fmt == "<H" else 0xFFFFFFFF))
        return bytes(data)
    if r == 5:  # a valid WAV at a very low or odd rate: long audio from few bytes
        return wav_bytes(pcm[:rng.choice((2, 20, 2000, len(pcm)))], rate=rng.choice((1, 2, 100, 999, 7919, 96000)))
    if r == 6:
        whole = wav_bytes(pcm)
        return whole[:rng.randrange(0, len(whole))]
    if r == 7:
        flipped = bytearray(wav_bytes(pcm))
        for _ in range(rng.randrange(1, 20)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        return bytes(flipped)
    if r == 8:
        return rng.choice((b"", b"RIFF", b"not audio at all", b"\x00" * 1000, b"fLaC\x00\x00\x00\x22",
                           b"OggS" + rng.randbytes(60), b"ID3\x04" + rng.randbytes(60)))
    return rng.randbytes(rng.randrange(0, 4000))


def _field_value(rng: random.Random, name: str) -> bytes:
    r = rng.randrange(10)
    if r < 4:
        good = {"model": ["tiny", "whisper-1", "gpt-4o-transcribe", ""],
                "language": ["en", "English", "de", "zh", "", "xx-nonsense", "EN", "en-US"],
                "prompt": ["", "harken", "earlier words"],
                "response_format": list(FORMATS) + ["", "JSON", "xml", "diarized_json"],
                "stream": ["true", "false", "1", "0", "True", "yes", ""],
                "temperature": ["0", "0.2", "-1", "nan", "inf", "x"]}
        return rng.choice(good.get(name, ["", "x", "0"])).encode()
    if r < 6:
        return random_text(rng, 200).encode("utf-8", "surrogatepass")
    if r == 6:
        return rng.randbytes(rng.randrange(0, 200))  # not UTF-8
    if r == 7:
        return rng.choice((b"a", b"\xff", "\u00e9".encode())) * rng.choice((63_999, 64_001, 200_000))  # over-long
    if r == 8:
        return b"\x00" * rng.randrange(0, 50)
    return json.dumps(random_json_text(rng)[:200]).encode()


def random_multipart(rng: random.Random, corpus: FuzzCorpus, boundary: bytes) -> tuple[bytes, str, bool]:
    """A multipart body: parts in any order, with good, bad or missing headers; (body, the
    response_format asked for, stream asked for)."""
    parts: list[bytes] = []
    names = ["file"] + [f for f in FIELDS if rng.random() < 0.3]
    if rng.random() < 0.15:
        names.remove("file")
    if rng.random() < 0.2:
        names.append(rng.choice(names + ["file"]))  # a duplicate
    if rng.random() < 0.2:
        names.append(random_text(rng, 20))
    rng.shuffle(names)
    response_format, stream = "json", False
    for name in names:
        headers = []
        r = rng.random()
        if r < 0.85:
            disposition = f'form-data; name="{name}"'
            if name == "file" or rng.random() < 0.05:
                disposition += rng.choice(('; filename="audio.wav"', '; filename=""', '; filename="../../x"',
                                           "; filename*=UTF-8''%e9%00.wav", ""))
            headers.append(b"Content-Disposition: " + disposition.encode("utf-8", "surrogatepass"))
        elif r < 0.9:
            headers.append(b"Content-Disposition: attachment")
        elif r < 0.95:
            headers.append(b"Content-Disposition: form-data; name=" + rng.randbytes(8))
        if rng.random() < 0.3:
            headers.append(b"Content-Type: " + rng.choice((b"audio/wav", b"application/octet-stream", b"text/plain",
                                                           b"text/plain; charset=utf-16", b"text/plain; charset=nope",
                                                           b'multipart/mixed; boundary="inner"', b"\xff\xfe")))
        if rng.random() < 0.05:
            headers.append(b"Content-Transfer-Encoding: " + rng.choice((b"base64", b"quoted-printable", b"x")))
        if rng.random() < 0.05:
            headers.append(b"Content-Encoding: " + rng.choice((b"gzip", b"deflate", b"br", b"x")))
        if name == "file":
            value = random_audio_file(rng, corpus)
            if rng.random() < 0.05:
                value = value * (MAX_UPLOAD_BYTES // max(1, len(value)) + 2)  # over the upload limit
        else:
            value = _field_value(rng, name)
            if name == "response_format":
                response_format = value.decode("utf-8", "replace").strip()
            if name == "stream":
                stream = value.strip().lower() in (b"true", b"1")
        if rng.random() < 0.05:  # a nested multipart body as the part
            value = b"--inner\r\nContent-Disposition: form-data; name=\"x\"\r\n\r\n1\r\n--inner--\r\n"
        parts.append(b"--" + boundary + b"\r\n" + b"\r\n".join(headers) + b"\r\n\r\n" + value + b"\r\n")
    body = b"".join(parts)
    r = rng.random()
    if r < 0.85:
        body += b"--" + boundary + b"--\r\n"
    elif r < 0.9:
        body += b"--" + boundary + b"\r\n"  # a part that never comes
    # else: no closing boundary at all
    if rng.random() < 0.05:
        body = b"preamble\r\n" + body
    return body, (response_format or "json"), stream


def random_http_request(rng: random.Random, corpus: FuzzCorpus) -> HttpRequest:
    if rng.random() < 0.12:
        return _models_request(rng)
    boundary = rng.choice((b"harkenfuzzboundary", b"----WebKitFormBoundary7MA4YWxkTrZu0gW", b"a", b"x" * 200,
                           b"b o u n d", b"=?weird?=", b'"quoted"'))
    body, response_format, stream = random_multipart(rng, corpus, boundary.strip(b'"'))
    good_key, auth = _random_auth(rng)
    headers = [b"Host: 127.0.0.1"]
    if auth is not None:
        headers.append(b"Authorization: " + auth)
    r = rng.random()
    if r < 0.75:
        headers.append(b"Content-Type: multipart/form-data; boundary=" + boundary)
    elif r < 0.8:
        headers.append(b"Content-Type: multipart/form-data")  # no boundary
    elif r < 0.85:
        headers.append(b"Content-Type: multipart/form-data; boundary=" + boundary + b"-other")
    elif r < 0.9:
        headers.append(b"Content-Type: " + rng.choice((b"application/json", b"text/plain", b"application/x-www-form-urlencoded",
                                                       b"multipart/mixed; boundary=" + boundary, b"multipart/", b"\xff")))
        if rng.random() < 0.5:
            body = json.dumps({"file": "x", "model": "tiny"}).encode()
    # else: no content type
    cut = False
    http_malformed = False
    r = rng.random()
    if r < 0.75:
        headers.append(b"Content-Length: " + str(len(body)).encode())
    elif r < 0.85:  # chunked
        headers.append(b"Transfer-Encoding: chunked")
        chunks, i = [], 0
        while i < len(body):
            n = rng.randrange(1, 70_000)
            chunks.append(f"{n if i + n <= len(body) else len(body) - i:x}".encode() + b"\r\n" + body[i:i + n] + b"\r\n")
            i += n
        body = b"".join(chunks) + b"0\r\n\r\n"
    elif r < 0.9:  # a body longer than it says: the rest is read as the next request
        headers.append(b"Content-Length: " + str(rng.randrange(0, len(body) + 1)).encode())
        http_malformed = True
    elif r < 0.95:  # a body shorter than it says: cut
        headers.append(b"Content-Length: " + str(len(body) + rng.choice((1, 1000, MAX_UPLOAD_BYTES * 8))).encode())
        cut = True
    else:
        headers.append(b"Content-Length: " + rng.choice((b"-1", b"abc", b"99999999999999999999", b"1, 2")))
        http_malformed = True
    if rng.random() < 0.05:
        headers.append(b"Expect: 100-continue")
    raw = b"POST /v1/audio/transcriptions HTTP/1.1\r\n" + b"\r\n".join(headers) + b"\r\nConnection: close\r\n\r\n" + body
    if rng.random() < 0.05:  # the whole request cut anywhere
        raw, cut = raw[:rng.randrange(0, len(raw))], True
    return HttpRequest(raw, route=True, http_malformed=http_malformed, good_key=good_key, cut=cut,
                       response_format=response_format, stream=stream)


def _models_request(rng: random.Random) -> HttpRequest:
    good_key, auth = _random_auth(rng)
    path = rng.choice((b"/v1/models", b"/v1/models", b"/v1/models?x=1", b"/v1/models/", b"/v1/models/tiny",
                       b"/v1/realtime", b"/v1/realtime?model=tiny"))  # the socket's path without an upgrade
    raw = b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if auth is not None:
        raw += b"Authorization: " + auth + b"\r\n"
    raw += b"Connection: close\r\n\r\n"
    return HttpRequest(raw, route=path in (b"/v1/models", b"/v1/models?x=1", b"/v1/realtime", b"/v1/realtime?model=tiny"),
                       good_key=good_key)


def _random_auth(rng: random.Random) -> tuple[bool, bytes | None]:
    """(whether the key is good, the Authorization header's value or None). No control characters:
    aiohttp's HTTP parser refuses those itself (a plain-text 400) before any route sees them."""
    r = rng.random()
    if r < 0.7:
        return True, b"Bearer " + HTTP_KEY.encode()
    if r < 0.75:
        return True, b"bearer   " + HTTP_KEY.encode() + b"  "
    if r < 0.8:
        return False, None
    return False, rng.choice((b"Bearer", b"Bearer ", b"Basic dXNlcjpwYXNz", b"Bearer sk-wrong",
                              b"Bearer " + "\u00e9t\u00e9".encode(), b"Bearer \xff\xfe\x80",
                              b"Bearer " + b"k" * 8000, b"Bearer " + HTTP_KEY.encode() + b"x"))


def _event(kind: str, **fields) -> str:
    return json.dumps({"type": kind, **fields})


def _random_session(rng: random.Random) -> Any:
    """`session.update`'s session: OpenAI's shape with any part of any type."""
    def anything():
        return rng.choice((None, 0, 1, -1, True, "x", "", [], {}, [1, 2], {"a": 1}, 1.5, 2**70, "16000"))
    rate = rng.choice((16_000, 24_000, 8_000, 48_000, 7_999, 48_001, 0, -16_000, 16_000.0, "24000", None, True,
                       2**63, [16_000], {"rate": 1}))
    transcription = {"model": rng.choice(("tiny", "", None, 3)),
                     "language": rng.choice(("en", "English", "", "xx-nonsense", None, 7, ["en"], random_text(rng, 20))),
                     "prompt": rng.choice(("", "earlier words", None, 3, {"a": 1}, "p" * rng.choice((10, 70_000))))}
    session: Any = {"type": "transcription", "audio": {"input": {"format": {"type": "audio/pcm", "rate": rate},
                                                                 "transcription": transcription,
                                                                 "turn_detection": anything()}}}
    r = rng.random()
    if r < 0.1:
        session = anything()
    elif r < 0.2:
        session["audio"] = anything()
    elif r < 0.3:
        session["audio"]["input"] = anything()
    elif r < 0.4:
        session["audio"]["input"]["format"] = anything()
    elif r < 0.5:
        session["audio"]["input"]["transcription"] = anything()
    elif r < 0.55:
        session = {"input_audio_transcription": rng.choice((anything(), transcription))}
    return session


def _random_audio_event(rng: random.Random, corpus: FuzzCorpus) -> str:
    r = rng.random()
    if r < 0.6:
        i = rng.randrange(len(corpus.pcm_pieces))
        audio: Any = base64.b64encode(b"".join(corpus.pcm_pieces[i:i + rng.randrange(1, 6)])).decode()
    elif r < 0.7:
        audio = base64.b64encode(rng.randbytes(rng.randrange(0, 500))).decode()  # odd lengths, noise
    elif r < 0.8:
        audio = rng.choice(("", "not base64!", "AAA", "=", "A" * 3, "\u00e9", "AAAA====", "AA AA"))
    elif r < 0.9:
        audio = rng.choice((None, 7, [], {}, ["AAAA"], True, 1.5))
    else:  # a lot at once: up to ~40 s of 16 kHz audio in one event
        audio = base64.b64encode(b"".join(corpus.pcm_pieces) * rng.randrange(1, 11)).decode()
    event: dict[str, Any] = {"type": "input_audio_buffer.append", "audio": audio}
    if rng.random() < 0.1:
        event["event_id"] = rng.choice((None, 1, [], {"a": [1]}, "e" * 1000, random_text(rng, 10)))
    if rng.random() < 0.05:
        del event["audio"]
    return json.dumps(event)


def random_realtime_script(rng: random.Random, corpus: FuzzCorpus) -> RealtimeScript:
    good_key, auth = _random_auth(rng)
    headers: tuple[tuple[str, str], ...] = ()
    if auth is not None:
        headers = (("Authorization", auth.decode("latin-1")),)
    frames: list[tuple[str, Any]] = []
    vllm = rng.random() < 0.3
    if rng.random() < 0.7:
        if vllm:
            frames.append(("text", _event("session.update", model=rng.choice(("tiny", "", None, 5)))))
            if rng.random() < 0.8:
                frames.append(("text", _event("input_audio_buffer.commit")))
        else:
            frames.append(("text", _event(rng.choice(("session.update", "transcription_session.update")),
                                          session=_random_session(rng))))
    for _ in range(rng.randrange(0, 25)):
        r = rng.random()
        if r < 0.45:
            frames.append(("text", _random_audio_event(rng, corpus)))
        elif r < 0.55:
            event: dict[str, Any] = {"type": "input_audio_buffer.commit"}
            if rng.random() < 0.5:
                event["final"] = rng.choice((True, False, 1, "yes", None, [], {}))
            frames.append(("text", json.dumps(event)))
        elif r < 0.6:
            frames.append(("text", _event("input_audio_buffer.clear")))
        elif r < 0.65:  # settings again, after audio perhaps
            frames.append(("text", _event("session.update", session=_random_session(rng))
                           if rng.random() < 0.7 else _event("session.update", model="tiny")))
        elif r < 0.7:
            frames.append(("text", json.dumps({"type": rng.choice((None, 1, [], {}, "", "response.create",
                                                                   "conversation.item.create", "session.update " * 5,
                                                                   "x" * 5000, random_text(rng, 30)))})))
        elif r < 0.73:
            frames.append(("text", json.dumps({"no_type": 1})))
        elif r < 0.85:
            frames.append(("text", random_json_text(rng)))  # not JSON, not an object, deeply nested, ...
        elif r < 0.88:
            frames.append(("text", rng.choice(("[" * 50_000, '{"a":' * 5_000, "{" * 100_000,
                                               '{"type":"input_audio_buffer.append","audio":' + "[" * 20_000))))
        elif r < 0.92:
            frames.append(("binary", rng.randbytes(rng.randrange(0, 100))))
        elif r < 0.95:
            frames.append(("wait", rng.choice((0.01, 0.1, 0.5))))
        else:
            frames.append(("text", rng.choice(("", " ", "\x00", "null", "1e999", "1" * 5000, '"str"', "[]", "{}"))))
    if rng.random() < 0.4:  # the end of the audio
        frames.append(("text", json.dumps({"type": "input_audio_buffer.commit", "final": True})))
        if rng.random() < 0.3:
            frames.append(("text", _random_audio_event(rng, corpus)))  # audio after the end
        if rng.random() < 0.2:
            frames.append(("text", json.dumps({"type": "input_audio_buffer.commit", "final": True})))
        frames.append(("wait", rng.choice((0.0, 0.2, 1.0))))
    return RealtimeScript(headers, tuple(frames), good_key=good_key, drop=rng.random() < 0.15)


# ---- the served port -----------------------------------------------------------------------------

class _ErrorLog(logging.Handler):
    """Unhandled exceptions the server logs (each one a crash), kept with their text."""

    WATCHED = ("aiohttp.server", "aiohttp.web", "aiohttp.websocket", "asyncio")

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []
        self.client_gone = 0

    def emit(self, record: logging.LogRecord) -> None:
        from aiohttp.http_exceptions import HttpProcessingError

        if record.exc_info and isinstance(record.exc_info[1], HttpProcessingError):
            return  # aiohttp's HTTP parser on a request that is not HTTP: it answers 400 itself
        if record.exc_info and isinstance(record.exc_info[1], ConnectionResetError):
            self.client_gone += 1  # aiohttp writing to a client that went away (a request cut short)
            return
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f": {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"[:300]
        self.records.append(f"{record.name}: {text}")

    def install(self) -> None:
        for name in self.WATCHED:
            logging.getLogger(name).addHandler(self)

    def remove(self) -> None:
        for name in self.WATCHED:
            logging.getLogger(name).removeHandler(self)


@dataclass
class HttpOutcome:
    status: int | None  # None: no answer
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


class ServedHTTP:
    """`harken serve` in-process with its HTTP port on loopback: the fuzzed endpoints."""

    def __init__(self, running, corpus: FuzzCorpus, grace_s: float, log: _ErrorLog):
        self.running, self.corpus, self.grace_s, self.log = running, corpus, grace_s, log
        self.port = running.http_port
        self.differences: list[dict] = []
        self.logged = 0  # error-log records already reported
        self.error_codes: Counter = Counter()  # the Realtime error events' codes

    @classmethod
    async def start(cls, asr, corpus: FuzzCorpus, grace_s: float = 0.3, keys_path: str | None = None) -> "ServedHTTP":
        import tempfile
        from pathlib import Path

        from harken.cloud.inference.commit import CommitPolicy
        from harken.cloud.server import ServerOptions, start_server

        if keys_path is None:
            keys_path = str(Path(tempfile.mkdtemp(prefix="harken-fuzz-http-")) / "keys.txt")
            Path(keys_path).write_text(f"{HTTP_KEY} fuzz\n{HTTP_REFERENCE_KEY} reference\n")
        policy = CommitPolicy(update_interval_s=1.0, rollback_tokens=2, max_new_tokens_per_update=6, max_item_tokens=24)
        options = ServerOptions(port=0, http_port=0, api_keys=keys_path, max_sessions=64, max_sessions_per_key=64,
                                grace_s=grace_s, policy=policy, max_upload_bytes=MAX_UPLOAD_BYTES,
                                max_file_s=MAX_FILE_S, file_lanes=1, shutdown_grace_s=2.0)
        log = _ErrorLog()
        log.install()
        running = await start_server(asr, options)
        return cls(running, corpus, grace_s, log)

    async def close(self) -> None:
        try:
            await self.running.stop()
        finally:
            self.log.remove()

    # ---- HTTP ------------------------------------------------------------------------------------

    async def send(self, req: HttpRequest, deadline_s: float = REQUEST_DEADLINE_S) -> HttpOutcome:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            async def exchange() -> bytes:
                try:
                    writer.write(req.raw)
                    await writer.drain()
                    if req.cut and writer.can_write_eof():  # the server sees the end of a short body
                        writer.write_eof()
                except (ConnectionError, OSError):
                    pass  # the server answered (413) and closed before the whole body was written
                chunks = []
                try:
                    while chunk := await reader.read(1 << 16):
                        chunks.append(chunk)
                except (ConnectionError, OSError):
                    pass
                return b"".join(chunks)

            data = await asyncio.wait_for(exchange(), deadline_s)
        finally:
            writer.close()
        return _parse_response(data)

    async def check_http(self, req: HttpRequest) -> str:
        """One request and its properties; its outcome ("200", "400", ..., or CUT)."""
        try:
            out = await self.send(req)
        except asyncio.TimeoutError:
            raise Crash("http", f"no answer within {REQUEST_DEADLINE_S:.0f} s", req.raw[:4000]) from None
        self._check_log("http", req.raw[:4000])
        if out.status is None:
            if req.cut or req.http_malformed:
                return CUT
            raise Crash("http", "the server closed the connection without an answer", req.raw[:4000])
        if out.status >= 500:
            raise Crash("http", f"answered {out.status}: {out.body[:300]!r}", req.raw[:4000])
        if req.route and not req.http_malformed and out.status >= 400:
            try:
                error = json.loads(out.body)["error"]
                assert isinstance(error["message"], str) and isinstance(error["type"], str) and "code" in error
            except Exception:
                raise Crash("http", f"a {out.status} not in OpenAI's error shape: {out.body[:300]!r}",
                            req.raw[:4000]) from None
        if not req.good_key and req.route and not req.http_malformed and out.status not in (401, 400):
            raise Crash("http", f"a bad token got {out.status}, not 401", req.raw[:4000])
        if out.status == 429 and "retry-after" not in out.headers:
            raise Crash("http", "a 429 without Retry-After", req.raw[:4000])
        if out.status == 200 and req.raw.startswith(b"POST") and not req.http_malformed:
            _check_transcription(out, req)
        return str(out.status)

    # ---- the Realtime WebSocket ------------------------------------------------------------------

    async def run_realtime(self, script: RealtimeScript, deadline_s: float = REQUEST_DEADLINE_S) -> tuple[str, list]:
        """Play one script; (its outcome, the server's events)."""
        import aiohttp

        url = f"http://127.0.0.1:{self.port}/v1/realtime"
        events: list = []
        async with aiohttp.ClientSession() as http:
            try:
                ws = await http.ws_connect(url, headers=dict(script.headers), max_msg_size=0)
            except aiohttp.WSServerHandshakeError as e:
                return f"HTTP {e.status}", events
            reading = asyncio.ensure_future(_read_events(ws, events))
            closed_early = None
            for kind, data in script.frames:
                if reading.done():
                    closed_early = reading.result()
                    break
                try:
                    if kind == "wait":
                        await asyncio.sleep(data)
                    elif kind == "text":
                        await ws.send_str(data)
                    else:
                        await ws.send_bytes(data)
                except (ConnectionError, RuntimeError) as e:  # the server closed the socket
                    closed_early = f"send failed: {type(e).__name__}"
                    break
            if script.drop:  # no close frame: the session's connector closes the connection
                reading.cancel()
                await asyncio.gather(reading, return_exceptions=True)
                return "DROPPED", events
            if closed_early is None and not reading.done():
                await ws.close()
            await asyncio.wait_for(reading, deadline_s)
            return (closed_early or f"closed {ws.close_code}"), events

    async def check_realtime(self, script: RealtimeScript) -> str:
        try:
            outcome, events = await self.run_realtime(script)
        except asyncio.TimeoutError:
            raise Crash("realtime", f"no close within {REQUEST_DEADLINE_S:.0f} s", script) from None
        self._check_log("realtime", script)
        if outcome.startswith("HTTP "):
            if int(outcome[5:]) >= 500:
                raise Crash("realtime", f"the handshake got {outcome}", script)
            if script.good_key:
                raise Crash("realtime", f"a good key's handshake got {outcome}", script)
            return outcome
        if not script.good_key:
            raise Crash("realtime", "a bad token was let in", script)
        for e in events:
            if not isinstance(e, dict) or not isinstance(e.get("type"), str):
                raise Crash("realtime", f"a server event that is no typed JSON object: {describe(e)}", script)
            if e["type"] == "error":
                error = e.get("error")
                if not (isinstance(error, dict) and isinstance(error.get("message"), str)
                        and isinstance(error.get("type"), str) and "code" in error):
                    raise Crash("realtime", f"an error event not in OpenAI's shape: {describe(e)}", script)
        if outcome not in ("closed 1000", "closed 1009", "DROPPED"):  # 1009: an event over the size limit
            raise Crash("realtime", f"the socket ended {outcome}", script)
        errors = Counter(str(e["error"].get("code")) for e in events if e["type"] == "error")
        self.error_codes.update(errors)
        return f"{outcome}, error events" if errors else outcome

    def _check_log(self, target: str, data: Any) -> None:
        if len(self.log.records) > self.logged:
            new = self.log.records[self.logged:]
            self.logged = len(self.log.records)
            raise Crash(target, f"the server logged {new[0]}", data)

    # ---- the reference session and leaks ---------------------------------------------------------

    async def run_reference(self) -> str:
        """A well-behaved vLLM-dialect client of another key: the corpus's audio, a final commit,
        transcription.done's text."""
        import aiohttp

        url = f"http://127.0.0.1:{self.port}/v1/realtime"
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(url, headers={"Authorization": f"Bearer {HTTP_REFERENCE_KEY}"}) as ws:
                await ws.send_str(_event("session.update", model="tiny"))
                await ws.send_str(_event("input_audio_buffer.commit"))
                pcm = b"".join(self.corpus.pcm_pieces)
                for i in range(0, len(pcm), 6400):
                    await ws.send_str(_event("input_audio_buffer.append", audio=base64.b64encode(pcm[i:i + 6400]).decode()))
                await ws.send_str(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
                async for msg in ws:
                    event = json.loads(msg.data)
                    if event["type"] == "error":
                        raise Crash("reference", f"the reference session got {event}", "reference")
                    if event["type"] == "transcription.done":
                        return event["text"]
        raise Crash("reference", "the reference session ended without transcription.done", "reference")

    async def reference_runs(self, alone: str, stop: asyncio.Event) -> tuple[int, int]:
        runs = affected = 0
        while not stop.is_set():
            try:
                got = await asyncio.wait_for(self.run_reference(), REQUEST_DEADLINE_S)
            except (Crash, asyncio.TimeoutError, OSError) as e:
                got = f"{type(e).__name__}: {e}"
            runs += 1
            if got != alone:
                affected += 1
                if len(self.differences) < 5:
                    self.differences.append({"alone": alone, "beside": got})
        return runs, affected

    async def leaked_sessions(self, drain_s: float = 40.0) -> int:
        """Sessions still in the table (or the engine) once the grace period is over. A socket's
        handler ends its stream when the socket closes, and waits up to 30 s for its last finals
        (cloud/adapters/realtime_api.py): sessions may take that long to go."""
        table = self.running._table  # noqa: SLF001
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_s
        while (table.sessions or self.running.engine.sessions) and loop.time() < deadline:
            await asyncio.sleep(0.25)
        await asyncio.sleep(self.grace_s + 1.2)
        return len(table.sessions) + len(self.running.engine.sessions)


async def _read_events(ws, events: list) -> str:
    """The server's events until the socket ends; how it ended."""
    from aiohttp import WSMsgType

    async for msg in ws:
        if msg.type == WSMsgType.TEXT:
            try:
                events.append(json.loads(msg.data))
            except ValueError:
                events.append(msg.data)
        elif msg.type == WSMsgType.BINARY:
            events.append(msg.data)
    return f"closed {ws.close_code}"


def _parse_response(data: bytes) -> HttpOutcome:
    while data.startswith(b"HTTP/1.1 1"):  # 100 Continue (the client sent Expect): the answer follows
        data = data.partition(b"\r\n\r\n")[2]
    head, sep, body = data.partition(b"\r\n\r\n")
    if not data or not sep:
        return HttpOutcome(None)
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    try:
        status = int(parts[1])
    except (IndexError, ValueError):
        return HttpOutcome(None)
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out, rest = [], body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            try:
                n = int(size_line.split(b";")[0], 16)
            except ValueError:
                break
            if n == 0:
                break
            out.append(rest[:n])
            rest = rest[n + 2:]
        body = b"".join(out)
    return HttpOutcome(status, headers, body)


def _check_transcription(out: HttpOutcome, req: HttpRequest) -> None:
    """A 200 is the response format asked for."""
    text = out.body.decode("utf-8")
    if req.stream:
        events = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]
        if not events or events[-1].get("type") != "transcript.text.done":
            raise Crash("http", f"a streamed answer that does not end with transcript.text.done: {text[:300]!r}",
                        req.raw[:4000])
        deltas = "".join(e.get("delta", "") for e in events[:-1])
        if deltas != events[-1]["text"]:
            raise Crash("http", "streamed deltas do not add up to the text", req.raw[:4000])
        return
    fmt = req.response_format if req.response_format in FORMATS else "json"
    if fmt in ("json", "verbose_json"):
        doc = json.loads(text)
        if not isinstance(doc.get("text"), str):
            raise Crash("http", f"a {fmt} answer without text: {text[:300]!r}", req.raw[:4000])
    elif fmt == "vtt" and not text.startswith("WEBVTT"):
        raise Crash("http", f"a vtt answer that is not WebVTT: {text[:300]!r}", req.raw[:4000])


# ---- a run ---------------------------------------------------------------------------------------

@dataclass
class HttpTally:
    by_target: dict[str, Counter] = field(default_factory=lambda: {t: Counter() for t in HTTP_TARGETS})
    crashes: int = 0
    crash_examples: list[dict] = field(default_factory=list)
    keep: int = 5

    def crash(self, e: Crash) -> None:
        self.crashes += 1
        if len(self.crash_examples) < self.keep:
            self.crash_examples.append({"target": e.target, "reason": e.reason, "input": describe(e.data, limit=2000)})


def random_example(rng: random.Random, corpus: FuzzCorpus) -> tuple[str, Any]:
    """(target, input): 45% uploads, 45% realtime sessions, the rest /v1/models."""
    r = rng.random()
    if r < 0.45:
        return "realtime", random_realtime_script(rng, corpus)
    req = random_http_request(rng, corpus)
    return ("models" if req.raw.startswith(b"GET") else "transcriptions"), req


async def check_example(harness: ServedHTTP, target: str, example: Any) -> str:
    if target == "realtime":
        return await harness.check_realtime(example)
    return await harness.check_http(example)


async def run_http_fuzz(n: int, rng: random.Random, harness: ServedHTTP, concurrency: int = 4,
                        keep: int = 5) -> dict:
    """`n` examples, `concurrency` at a time, beside back-to-back reference sessions."""
    tally = HttpTally(keep=keep)
    alone = await harness.run_reference()
    examples = [random_example(rng, harness.corpus) for _ in range(n)]
    queue = list(reversed(examples))

    async def worker() -> None:
        while queue:
            target, example = queue.pop()
            try:
                tally.by_target[target][await check_example(harness, target, example)] += 1
            except Crash as e:
                tally.by_target[target]["CRASH"] += 1
                tally.crash(e)

    stop = asyncio.Event()
    beside = asyncio.ensure_future(harness.reference_runs(alone, stop))
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    stop.set()
    runs, affected = await beside
    for d in harness.differences[:max(0, keep - len(tally.crash_examples))]:
        tally.crash_examples.append({"target": "reference", "reason": "text beside the fuzzing differs from alone",
                                     "input": describe(d, limit=2000)})
    leaked = await harness.leaked_sessions()
    return {"tried": n, "crashes": tally.crashes,
            "by_target": {t: {"tried": sum(c.values()), **dict(sorted(c.items()))} for t, c in tally.by_target.items()},
            "reference_runs": runs, "others_affected": affected, "leaked_sessions": leaked,
            "client_gone_logged": harness.log.client_gone,
            "realtime_error_codes": dict(sorted(harness.error_codes.items())),
            "ok": tally.crashes == 0 and affected == 0 and leaked == 0,
            "crash_examples": tally.crash_examples}
