"""The file APIs and admission under `harken serve --workers 2` (cloud/hosting/file_link.py,
engine_link.py): the engine in this test's process on a tiny model that writes words, two front-end
processes on one HTTP port.

- OpenAI's client gets `harken transcribe`'s text for json / text / stream, and the engine's cues
  for srt, as in one process; Deepgram's pre-recorded POST likewise;
- `--max-files 1 --file-queue 0` holds across front ends: a request stalled on one front end holds
  the server's one place, and the other front end answers 429 with Retry-After (OpenAI's and
  Deepgram's); a front end killed while its file waits in the engine: its client gets an error, the
  engine frees the file's place;
- a session the engine has no room for is refused before its Ready (RESOURCE_EXHAUSTED, no message)
  on a front end that holds fewer sessions than the limit: its mirror counts every front end's.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import numpy as np
import openai
import psutil
import pytest
from srt import parse as parse_srt

from harken.cloud.server import ServerOptions
from harken.cloud.workers import start_workers
from harken.edge.audio import load_audio, peak_normalize
from harken.shared.subtitles import cues_of, srt
from signals import concat, silence, speech

MODEL = "tiny-untied"  # a random model that writes words


@pytest.fixture(scope="module")
def words_asr():
    import torch

    from harken.cloud.model.asr import Qwen3ASR

    torch.set_num_threads(1)
    return Qwen3ASR.load(MODEL, dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def wav(tmp_path_factory):
    import soundfile as sf

    audio = peak_normalize(concat(silence(0.3), speech("Hello there, this is a test of the system."), silence(0.8),
                                  speech("A second sentence follows now."), silence(0.5)))
    path = tmp_path_factory.mktemp("files") / "two.wav"
    sf.write(str(path), (np.clip(audio, -1, 1) * 32767).astype("<i2"), 16000, subtype="PCM_16")
    return path


@pytest.fixture(scope="module")
def expected(words_asr, wav):
    """In one process: `harken transcribe`'s offline text, and the streaming engine's events (srt)."""
    from harken.cloud.embedded import stream_audio
    from harken.cloud.inference.decoder_stream import SessionOptions
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.inference.offline import transcribe_audio

    audio = peak_normalize(load_audio(str(wav)))
    text = transcribe_audio(words_asr, audio, "English").text
    options = SessionOptions(language="English")
    engine = Engine(words_asr, EngineConfig(max_sessions=1, max_batch=1, slot_policy=options.policy))
    events = list(stream_audio(audio, engine, options))
    return text, events


def _front_end_of(workers, local_port: int) -> int | None:
    """The front end (index) holding the client connection from `local_port`."""
    for i, pid in workers.front_end_pids().items():
        for c in psutil.Process(pid).net_connections(kind="tcp"):
            if c.raddr and c.raddr.port == local_port and c.laddr.port == workers.http_port:
                return i
    return None


async def _connect(workers, front_end: int | None = None, other_than: int | None = None):
    """A connection to the HTTP port held by `front_end` (or by any but `other_than`): the kernel
    spreads connections over the front ends, so connect until one lands there."""
    for _ in range(200):
        reader, writer = await asyncio.open_connection("127.0.0.1", workers.http_port)
        port = writer.get_extra_info("sockname")[1]
        held = None
        for _ in range(100):
            if (held := _front_end_of(workers, port)) is not None:
                break
            await asyncio.sleep(0.02)
        if held is not None and (front_end is None or held == front_end) and held != other_than:
            return reader, writer, held
        writer.close()
    raise AssertionError("no connection landed on the front end asked for")


def _multipart(wav) -> bytes:
    return (b"--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            b"Content-Type: audio/wav\r\n\r\n" + wav.read_bytes() + b"\r\n--xyz\r\n"
            b"Content-Disposition: form-data; name=\"model\"\r\n\r\nx\r\n--xyz--\r\n")


async def _exchange(reader, writer, head: str, body: bytes) -> tuple[int, dict, bytes]:
    writer.write(head.encode() + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    top, _, payload = raw.partition(b"\r\n\r\n")
    lines = top.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, payload


def test_openai_and_deepgram_files_through_workers_are_the_one_process_ones(words_asr, wav, expected):
    import aiohttp

    text, events = expected
    cues = cues_of(events)
    assert text and cues

    def with_openai(port: int):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=300)
        out = {}
        for fmt in ("json", "text", "srt"):
            with wav.open("rb") as f:
                out[fmt] = client.audio.transcriptions.create(model=MODEL, file=f, language="en",
                                                              response_format=fmt)  # type: ignore[call-overload]
        with wav.open("rb") as f:
            out["stream"] = [e for e in client.audio.transcriptions.create(model=MODEL, file=f, language="en",
                                                                           stream=True)]
        out["models"] = [m.id for m in client.models.list().data]
        return out

    async def main():
        workers = await start_workers(words_asr, ServerOptions(host="127.0.0.1", port=0, http_port=0, workers=2))
        try:
            got = await asyncio.to_thread(with_openai, workers.http_port)
            async with aiohttp.ClientSession() as http:
                async with http.post(f"http://127.0.0.1:{workers.http_port}/v1/listen?language=en",
                                     data=wav.read_bytes(), headers={"Content-Type": "audio/wav"}) as r:
                    got["deepgram"] = (r.status, await r.json())
            return got
        finally:
            await workers.stop(1)

    got = asyncio.run(main())
    assert got["models"] == [MODEL]
    assert got["json"].text == text
    assert got["text"].strip() == text
    assert got["srt"] == srt(cues) and len(list(parse_srt(got["srt"]))) == len(cues)  # as one process writes it
    assert got["stream"][-1].type == "transcript.text.done" and got["stream"][-1].text == text
    assert "".join(e.delta for e in got["stream"][:-1]) == text
    status, body = got["deepgram"]
    assert status == 200 and body["results"]["channels"][0]["alternatives"][0]["transcript"] == text


def test_the_file_limit_holds_across_front_ends_and_a_killed_front_end_frees_its_place(words_asr, wav):
    async def main():
        workers = await start_workers(words_asr, ServerOptions(host="127.0.0.1", port=0, http_port=0, workers=2,
                                                               max_files=1, file_queue=0))
        files = workers.scheduler.files
        try:
            # a request stalled in its upload holds the server's one place (taken as it arrives)
            _, stalled, first = await _connect(workers)
            stalled.write(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: multipart/form-data; boundary=xyz\r\nContent-Length: 100000\r\n\r\n--xyz\r\n")
            await stalled.drain()
            for _ in range(600):
                if files._admitted == 1:
                    break
                await asyncio.sleep(0.05)
            assert files._admitted == 1
            refusals = []
            for head, body in ((
                    "POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n"
                    "Content-Type: multipart/form-data; boundary=xyz\r\n", _multipart(wav)), (
                    "POST /v1/listen HTTP/1.1\r\nHost: x\r\nContent-Type: audio/wav\r\n", wav.read_bytes())):
                reader, writer, where = await _connect(workers, other_than=first)
                refusals.append((where, *await _exchange(reader, writer, head, body)))
            stalled.close()
            for _ in range(600):  # its place comes back as the stalled request ends
                if files._admitted == 0:
                    break
                await asyncio.sleep(0.05)
            freed_by_client = files._admitted

            # a front end killed while its file waits in the engine (the engine's thread held)
            await workers.scheduler.stop()
            reader, writer, victim = await _connect(workers)
            body = _multipart(wav)
            writer.write(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: multipart/form-data; boundary=xyz\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            for _ in range(600):
                if files.pending() == 1:
                    break
                await asyncio.sleep(0.05)
            waiting = files.pending(), files._admitted
            os.kill(workers.front_end_pids()[victim], signal.SIGKILL)
            try:
                answer = await asyncio.wait_for(reader.read(), 60)
            except ConnectionError as e:
                answer = repr(e).encode()
            for _ in range(600):
                if files._admitted == 0 and files.pending() == 0:
                    break
                await asyncio.sleep(0.05)
            after_kill = files.pending(), files._admitted
            await workers.scheduler.start()
            return first, refusals, freed_by_client, waiting, answer, after_kill
        finally:
            await workers.stop(1)

    first, refusals, freed_by_client, waiting, answer, after_kill = asyncio.run(main())
    (where_openai, status, headers, payload), (where_dg, dg_status, dg_headers, dg_payload) = refusals
    assert where_openai != first and where_dg != first  # refused by the other front end
    assert status == 429 and int(headers["retry-after"]) > 0
    assert json.loads(payload)["error"]["code"] == "rate_limit_exceeded"
    assert "1 file(s) at once and holds 0 more waiting" in json.loads(payload)["error"]["message"]
    assert dg_status == 429 and json.loads(dg_payload)["err_code"] == "TOO_MANY_REQUESTS"
    assert freed_by_client == 0
    assert waiting == (1, 1)
    assert not answer.startswith(b"HTTP/1.1 200")  # the client got an error (the connection closed), no text
    assert after_kill == (0, 0)  # the engine freed the file's place


def test_a_session_the_engine_has_no_room_for_is_refused_before_ready(asr):
    """`--max-sessions 2`, one session held on each front end: a third, wherever it lands, is
    refused as in one process (RESOURCE_EXHAUSTED before any message), though its front end holds
    one session only; once one ends, sessions are admitted again."""
    import grpc

    from harken.proto import harken_pb2_grpc
    from server_helpers import END, start_msg

    class Stream:
        """One stream on a connection of its own (gRPC shares connections between channels unless
        told not to): its first message ("ready", or an Error's code), then held open until `end`."""

        def __init__(self, target: str):
            self.channel = grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
            self.call = harken_pb2_grpc.TranscriptionStub(self.channel).Stream(timeout=120)

        async def first(self):
            await self.call.write(start_msg())
            try:
                m = await self.call.read()
                if m is grpc.aio.EOF:
                    return await self.call.code()
                return m.error.code if m.WhichOneof("kind") == "error" else m.WhichOneof("kind")
            except grpc.aio.AioRpcError as e:
                return e.code()

        async def end(self):
            try:
                await self.call.write(END)
                await self.call.done_writing()
                while await self.call.read() is not grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError:
                pass
            await self.channel.close()

    def held_by(workers) -> dict[int, int]:
        return {i: sum(1 for c in psutil.Process(pid).net_connections(kind="tcp")
                       if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == workers.port)
                for i, pid in workers.front_end_pids().items()}

    async def settled(workers, sessions: int):
        """Until the engine holds `sessions` and two status rounds have gone to the front ends."""
        for _ in range(600):
            if len(workers.engine.sessions) == sessions:
                break
            await asyncio.sleep(0.05)
        start = workers.links.statuses
        while workers.links.statuses < start + 2:
            await asyncio.sleep(0.02)

    async def main():
        workers = await start_workers(asr, ServerOptions(host="127.0.0.1", port=0, workers=2, max_sessions=2))
        held: list[Stream] = []
        try:
            s = Stream(workers.address)
            assert await s.first() == "ready"
            held.append(s)
            for _ in range(100):  # the second on the other front end
                s = Stream(workers.address)
                assert await s.first() == "ready"
                await settled(workers, 2)
                if sorted(held_by(workers).values()) == [1, 1]:
                    held.append(s)
                    break
                await s.end()
                await settled(workers, 1)
            assert len(held) == 2, held_by(workers)
            refused = []
            for _ in range(4):
                s = Stream(workers.address)
                refused.append(await s.first())
                await s.end()
            await held.pop().end()
            await settled(workers, 1)
            s = Stream(workers.address)
            admitted = await s.first()
            await s.end()
            return refused, admitted
        finally:
            for s in held:
                await s.end()
            await workers.stop(1)

    refused, admitted = asyncio.run(main())
    assert refused == ["RESOURCE_EXHAUSTED"] * 4  # its Error first, no Ready
    assert admitted == "ready"
