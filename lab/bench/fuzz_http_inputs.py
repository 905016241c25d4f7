"""The inputs of the HTTP fuzzer (lab/bench/fuzz_http.py): raw HTTP/1.1 requests to the file API and
`/v1/models`, and scripts of Realtime and Deepgram-listen WebSocket sessions, drawn from a seeded `random.Random` and the
wire fuzzer's corpus (lab/bench/fuzz_inputs.py). What each target sends is described in fuzz_http.py's
docstring; this module only builds the bytes and frames.
"""

from __future__ import annotations

import base64
import io
import json
import random
import struct
import wave
from dataclasses import dataclass
from typing import Any

from harken.bench.fuzz_inputs import FuzzCorpus, random_json_text, random_text

HTTP_TARGETS = ("transcriptions", "models", "realtime", "listen")
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
        if rng.random() < 0.05:  # a nested multipart body as the part
            value = b"--inner\r\nContent-Disposition: form-data; name=\"x\"\r\n\r\n1\r\n--inner--\r\n"
        if r < 0.85:  # the server reads this part as the field `name` (the last one of a name counts)
            if name == "response_format":
                response_format = value.decode("utf-8", "replace").strip()
            if name == "stream":
                stream = value.strip().lower() in (b"true", b"1")
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


def realtime_event(kind: str, **fields) -> str:
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
            frames.append(("text", realtime_event("session.update", model=rng.choice(("tiny", "", None, 5)))))
            if rng.random() < 0.8:
                frames.append(("text", realtime_event("input_audio_buffer.commit")))
        else:
            frames.append(("text", realtime_event(rng.choice(("session.update", "transcription_session.update")),
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
            frames.append(("text", realtime_event("input_audio_buffer.clear")))
        elif r < 0.65:  # settings again, after audio perhaps
            frames.append(("text", realtime_event("session.update", session=_random_session(rng))
                           if rng.random() < 0.7 else realtime_event("session.update", model="tiny")))
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


# ---- Deepgram's /v1/listen -------------------------------------------------------------------------

@dataclass(frozen=True)
class ListenScript:
    """One /v1/listen WebSocket session: its query string, headers and frames (as `RealtimeScript`)."""

    query: str
    headers: tuple[tuple[str, str], ...]
    frames: tuple[tuple[str, Any], ...]
    good_key: bool = True
    good_query: bool = True  # parameters the server takes (else it refuses the upgrade with 400)
    drop: bool = False


LISTEN_GOOD = {"encoding": ("linear16", "mulaw", "alaw"), "sample_rate": ("8000", "16000", "44100"),
               "channels": ("1", "2"), "multichannel": ("true", "false"), "interim_results": ("true", "false"),
               "vad_events": ("true", "false"), "utterance_end_ms": ("1000",), "endpointing": ("false", "25", "300"),
               "language": ("en", "en-US", "multi"), "model": ("nova-3", "whatever"), "keyterm": ("harken", "Qwen")}
LISTEN_BAD = {"encoding": ("opus", "flac", "x" * 300), "sample_rate": ("0", "-1", "abc", "9" * 40, "1000000"),
              "channels": ("0", "9", "two"), "multichannel": ("maybe", "2"), "interim_results": ("yes!",),
              "language": ("klingon", "zz-ZZ"), "utterance_end_ms": ("-5", "forever")}


def random_listen_script(rng: random.Random, corpus: FuzzCorpus) -> ListenScript:
    """Parameters good, bad and unknown; audio good (the corpus in the encoding the query names),
    odd-sized, random or huge; every control message and some that are none; audio after CloseStream."""
    good_key, auth = _random_auth(rng)
    headers: tuple[tuple[str, str], ...] = ()
    if auth is not None:
        value = auth.decode("latin-1")
        if value.lower().startswith("bearer") and rng.random() < 0.5:
            value = "Token" + value[6:]  # Deepgram's own scheme
        headers = (("Authorization", value),)
    params: list[tuple[str, str]] = [("encoding", "linear16"), ("sample_rate", "16000")] if rng.random() < 0.7 else []
    good_query = True
    for _ in range(rng.randrange(0, 6)):
        r = rng.random()
        if r < 0.6:
            name = rng.choice(list(LISTEN_GOOD))
            params.append((name, rng.choice(LISTEN_GOOD[name])))
        elif r < 0.8:
            name = rng.choice(list(LISTEN_BAD))
            params.append((name, rng.choice(LISTEN_BAD[name])))
            good_query = False
        else:  # unknown parameters are accepted and ignored
            params.append((rng.choice(("no_delay", "filler_words", "tag", "x-y", "redact", random_text(rng, 8) or "q")),
                           random_text(rng, 12)))
    query = "&".join(f"{k}={v}" for k, v in params)
    frames: list[tuple[str, Any]] = []
    pcm = b"".join(corpus.pcm_pieces[:rng.randrange(1, min(len(corpus.pcm_pieces), 30) + 1)])
    for _ in range(rng.randrange(0, 20)):
        r = rng.random()
        if r < 0.4:
            i = rng.randrange(0, max(1, len(pcm)))
            frames.append(("binary", pcm[i:i + rng.choice((1, 3, 320, 1600, 6400))]))
        elif r < 0.45:
            frames.append(("binary", rng.randbytes(rng.randrange(1, 2000))))
        elif r < 0.47:
            frames.append(("binary", b"\0" * rng.choice((100_000, 1_000_000))))  # a huge frame
        elif r < 0.65:
            frames.append(("text", json.dumps({"type": rng.choice(("KeepAlive", "Finalize", "Finalize"))})))
        elif r < 0.72:
            keyterms = rng.choice((["harken"], [], "x", [1, 2], ["k" * 150], ["a"] * 150, None))
            frames.append(("text", json.dumps({"type": "Configure", "keyterms": keyterms})))
        elif r < 0.8:
            frames.append(("text", json.dumps({"type": rng.choice((None, 1, "", "Shout", "closestream", "x" * 3000))})))
        elif r < 0.9:
            frames.append(("text", random_json_text(rng)))
        elif r < 0.95:
            frames.append(("wait", rng.choice((0.01, 0.1, 0.5))))
        else:
            frames.append(("text", rng.choice(("", " ", "null", "[]", "{}", '{"type":'))))
    if rng.random() < 0.6:
        frames.append(("text", json.dumps({"type": "CloseStream"})) if rng.random() < 0.9 else ("binary", b""))
        if rng.random() < 0.3:
            frames.append(("binary", pcm[:640]))  # audio after CloseStream
    return ListenScript(query, headers, tuple(frames), good_key=good_key, good_query=good_query,
                        drop=rng.random() < 0.15)
