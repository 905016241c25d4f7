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
    listen          a WebSocket session on Deepgram's `/v1/listen`: query strings good, bad and unknown,
                    Token/Bearer keys good and bad, audio good, odd-sized, random and huge, every
                    control message (KeepAlive, Finalize, Configure with odd keyterms, CloseStream)
                    and some that are none, text that is not JSON, audio after CloseStream

The requests and sessions are drawn by lab/bench/fuzz_http_inputs.py.

Properties (a broken one is a `Crash`, lab/bench/fuzz_targets.py's):
- HTTP: the server answers (unless the request was cut short: then it may just close), never with a
  5xx; on our routes every 4xx is OpenAI's shape `{"error": {"message", "type", "code"}}` (aiohttp's
  own 400 for a request that is not HTTP aside); a bad token is 401; a 200 is the response format
  asked for.
- Realtime: every server event is a JSON object with a `type`, an `error` event has OpenAI's error
  shape; the server never ends the socket abnormally (1011, or a dropped connection) while the
  client keeps it open, and always answers the client's close.
- Listen: a bad key is 401 and bad parameters 400 before the upgrade, each with a `dg-error` header;
  every message is a JSON object whose `type` Deepgram's clients know; the socket ends 1000, 1008
  (the client's fault: undecodable audio, a refused Configure) or 1009 (a frame over the size limit),
  never 1011 or a dropped connection while the client keeps it open.
- None: the server logs no unhandled exception (aiohttp's "Error handling request", asyncio's
  "exception was never retrieved"): each such record is a crash.
- Beside the fuzzing, a well-behaved Realtime client of another key (vLLM's dialect) streams the
  corpus's audio again and again and must get the text it gets alone; once the fuzzing is over and
  the grace period has passed, no session is left in the server's table or engine.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from harken.bench.fuzz_http_inputs import (CUT, FORMATS, HTTP_KEY, HTTP_REFERENCE_KEY, HTTP_TARGETS, MAX_FILE_S,
                                          MAX_UPLOAD_BYTES, REQUEST_DEADLINE_S, HttpRequest, ListenScript, RealtimeScript,
                                          random_http_request, random_listen_script, random_realtime_script,
                                          realtime_event)
from harken.bench.fuzz_inputs import FuzzCorpus
from harken.bench.fuzz_targets import Crash, describe

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
                                max_file_s=MAX_FILE_S, max_files=1, shutdown_grace_s=2.0)
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
        return await self._play(f"http://127.0.0.1:{self.port}/v1/realtime", script.headers, script.frames,
                                script.drop, deadline_s)

    async def _play(self, url: str, headers, frames, drop: bool, deadline_s: float) -> tuple[str, list]:
        """One WebSocket session: connect, send `frames` while reading, then close (or drop the
        connection); (how it ended, the server's messages). A refused upgrade: "HTTP <status>" (with
        " without dg-error" on /v1/listen when the header is missing)."""
        import aiohttp

        events: list = []
        async with aiohttp.ClientSession() as http:
            try:
                ws = await http.ws_connect(url, headers=dict(headers), max_msg_size=0)
            except aiohttp.WSServerHandshakeError as e:
                missing = "/v1/listen" in url and not (e.headers and e.headers.get("dg-error"))
                return f"HTTP {e.status}{' without dg-error' if missing else ''}", events
            reading = asyncio.ensure_future(_read_events(ws, events))
            closed_early = None
            for kind, data in frames:
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
            if drop:  # no close frame: the session's connector closes the connection
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

    # ---- Deepgram's listen WebSocket ---------------------------------------------------------------

    async def run_listen(self, script: ListenScript, deadline_s: float = REQUEST_DEADLINE_S) -> tuple[str, list]:
        return await self._play(f"http://127.0.0.1:{self.port}/v1/listen?{script.query}", script.headers,
                                script.frames, script.drop, deadline_s)

    async def check_listen(self, script: ListenScript) -> str:
        try:
            outcome, events = await self.run_listen(script)
        except asyncio.TimeoutError:
            raise Crash("listen", f"no close within {REQUEST_DEADLINE_S:.0f} s", script) from None
        self._check_log("listen", script)
        if outcome.startswith("HTTP "):
            if "without dg-error" in outcome or int(outcome[5:8]) >= 500:
                raise Crash("listen", f"the handshake got {outcome}", script)
            if int(outcome[5:8]) == 401 and script.good_key:
                raise Crash("listen", "a good key was refused", script)
            if int(outcome[5:8]) == 400 and script.good_query and script.good_key:
                raise Crash("listen", "parameters the server takes were refused", script)
            return outcome[:8]
        if not script.good_key:
            raise Crash("listen", "a bad key was let in", script)
        known = {"Results", "SpeechStarted", "UtteranceEnd", "Metadata", "Error", "ConfigureSuccess",
                 "ConfigureFailure"}
        for e in events:
            if not isinstance(e, dict) or e.get("type") not in known:
                raise Crash("listen", f"a message Deepgram's clients do not know: {describe(e)}", script)
        if outcome not in ("closed 1000", "closed 1008", "closed 1009", "DROPPED"):
            raise Crash("listen", f"the socket ended {outcome}", script)
        errors = sum(1 for e in events if e["type"] == "Error")
        return f"{outcome}, Error messages" if errors else outcome

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
                await ws.send_str(realtime_event("session.update", model="tiny"))
                await ws.send_str(realtime_event("input_audio_buffer.commit"))
                pcm = b"".join(self.corpus.pcm_pieces)
                for i in range(0, len(pcm), 6400):
                    await ws.send_str(realtime_event("input_audio_buffer.append", audio=base64.b64encode(pcm[i:i + 6400]).decode()))
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
    """(target, input): 30% realtime sessions, 25% listen sessions, the rest uploads and /v1/models."""
    r = rng.random()
    if r < 0.3:
        return "realtime", random_realtime_script(rng, corpus)
    if r < 0.55:
        return "listen", random_listen_script(rng, corpus)
    req = random_http_request(rng, corpus)
    return ("models" if req.raw.startswith(b"GET") else "transcriptions"), req


async def check_example(harness: ServedHTTP, target: str, example: Any) -> str:
    if target == "realtime":
        return await harness.check_realtime(example)
    if target == "listen":
        return await harness.check_listen(example)
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
