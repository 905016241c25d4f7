"""Shared pieces of the cloud/server tests (tests/test_server_*.py): the gRPC service on real
loopback sockets (port 0) with the tiny random model, driven by a minimal client written from the
stubs (the SDK has its own tests, tests/test_transport_*.py).

The module fixtures `audio` (two utterances on the PCM16 grid) and `reference` (the in-process
engine's events for it, under this module's short commit policy) are imported by each test module
that needs them; conftest.py's `packets` follows the requesting module's `audio`.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harken.cloud.inference.commit import CommitPolicy
from harken.cloud.server import ServerOptions, start_server
from harken.proto import harken_pb2 as pb
from harken.proto import harken_pb2_grpc
from signals import concat, silence, speech


SR = 16_000
TIMEOUT = 60  # seconds a test stream may take: a hang fails instead of blocking the run

# Short budgets keep the tiny model quick; a forced language makes it write text (left to detect,
# the random weights answer "language None", i.e. silence, and every transcript would be empty).
POLICY = CommitPolicy(update_interval_s=0.5, rollback_tokens=2, max_new_tokens_per_update=6, max_item_tokens=24)
LANGUAGE = "English"


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    """Two utterances with a pause: two VAD segments, the second one long enough to be cut into.
    On the PCM16 grid, so a thin client sends exactly these samples."""
    x = concat(silence(0.3), speech("Hello there."), silence(0.8),
               speech("Good morning, how are you doing today?"), silence(0.5))
    return (np.clip(np.round(x * 32768), -32768, 32767) / 32768).astype(np.float32)


@pytest.fixture(scope="module")
def reference(asr, audio):
    """The in-process engine's events for `audio` (cloud/embedded.py)."""
    from harken.cloud.embedded import stream_audio
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.inference.decoder_stream import SessionOptions

    engine = Engine(asr, EngineConfig(max_sessions=1, max_batch=1, slot_policy=POLICY))
    events = [_domain(e) for e in stream_audio(audio, engine, SessionOptions(language=LANGUAGE, policy=POLICY))]
    assert any(e[1] for e in events), "the reference should hold committed text"
    return events


def _domain(e) -> tuple:
    """An engine event as the wire carries it (stability is a float32 there)."""
    return (e.segment_id, e.committed_delta, e.partial, float(np.float32(e.stability)), e.start_s, e.end_s,
            e.language, e.is_final)


def _wire_event(t: pb.Transcript) -> tuple:
    return (t.segment_id, t.committed_delta, t.partial, t.stability, t.start_s, t.end_s, t.language, t.is_final)


@dataclass
class Outcome:
    messages: list = field(default_factory=list)  # ServerMessage, in order
    code: grpc.StatusCode | None = None
    details: str = ""
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # set on every message (async client)

    @property
    def ready(self) -> pb.Ready:
        assert self.messages and self.messages[0].WhichOneof("kind") == "ready", self.messages[:1]
        return self.messages[0].ready

    @property
    def transcripts(self) -> list[pb.Transcript]:
        return [m.transcript for m in self.messages if m.WhichOneof("kind") == "transcript"]

    @property
    def events(self) -> list[tuple]:
        return [_wire_event(t) for t in self.transcripts]

    @property
    def acks(self) -> list[pb.Ack]:
        return [m.ack for m in self.messages if m.WhichOneof("kind") == "ack"]


def start_msg(**kw) -> pb.ClientMessage:
    kw.setdefault("language", LANGUAGE)
    return pb.ClientMessage(start=pb.Start(**kw))


def features_msgs(packets, first_seq: int = 1) -> list[pb.ClientMessage]:
    return [pb.ClientMessage(features=pb.Features(
        seq=first_seq + i, segment_id=p.segment_id, first_frame=p.first_frame, frame_count=p.frame_count,
        segment_start=p.segment_start, segment_end=p.segment_end, payload=p.payload,
        running_max_log10=p.running_max_log10)) for i, p in enumerate(packets)]


def audio_msgs(audio: np.ndarray, rate: int = SR, piece_s: float = 0.1) -> list[pb.ClientMessage]:
    pcm = np.clip(np.round(audio * 32768), -32768, 32767).astype("<i2")
    step = int(rate * piece_s)
    return [pb.ClientMessage(audio=pb.Audio(seq=i + 1, pcm16=pcm[j:j + step].tobytes(), sample_rate=rate))
            for i, j in enumerate(range(0, len(pcm), step))]


END = pb.ClientMessage(end=pb.End())


async def run_stream(target: str, messages, metadata=(), credentials=None, stop_after=None,
                     hold_open: asyncio.Event | None = None, then=(), out: Outcome | None = None) -> Outcome:
    """Send `messages`, collect every server message until the stream ends (or, with
    `stop_after(outcome)` true, cancel it there, as a dropped connection would). With `hold_open`
    the request side stays open after `messages` until it is set, then sends `then`."""
    out = out if out is not None else Outcome()
    channel = grpc.aio.secure_channel(target, credentials) if credentials else grpc.aio.insecure_channel(target)
    async with channel:
        async def requests():
            for m in messages:
                yield m
            if hold_open is not None:
                await hold_open.wait()
            for m in then:
                yield m

        call = harken_pb2_grpc.TranscriptionStub(channel).Stream(requests(), metadata=metadata, timeout=120)
        try:
            async for m in call:
                out.messages.append(m)
                out.progress.set()
                if stop_after is not None and stop_after(out):
                    call.cancel()
                    out.code = grpc.StatusCode.CANCELLED
                    return out
            out.code = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            out.code, out.details = e.code(), e.details() or ""
            last = out.messages[-1] if out.messages else None
            if out.code == grpc.StatusCode.INTERNAL and last is not None and last.WhichOneof("kind") == "error":
                # grpc.aio reports INTERNAL when the stream ends while the client still writes
                # (grpc#36066); the server's last message carries the real status
                out.code, out.details = grpc.StatusCode[last.error.code], last.error.message
    return out


async def resume_to_end(target: str, session_id: str, last_event_seq: int, msgs: list[pb.ClientMessage],
                        end: pb.ClientMessage) -> Outcome:
    """Resume a session on a new call: Start with its id, resend what Ready says the server has
    not applied, End, half-close; every message until the call ends (Ready first)."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = harken_pb2_grpc.TranscriptionStub(channel).Stream()
        await call.write(start_msg(session_id=session_id, last_event_seq=last_event_seq))
        ready = (await call.read()).ready
        for m in msgs[ready.resume_after_seq:]:
            await call.write(m)
        await call.write(end)
        await call.done_writing()
        out = Outcome(messages=[pb.ServerMessage(ready=ready)])
        while (m := await call.read()) != grpc.aio.EOF:
            out.messages.append(m)
        out.code = await call.code()
    return out


@contextlib.asynccontextmanager
async def serving(asr, clock=None, **kw):
    kw.setdefault("port", 0)
    kw.setdefault("policy", POLICY)
    server = await start_server(asr, ServerOptions(**kw), **({"clock": clock} if clock else {}))
    try:
        yield server
    finally:
        await server.stop(grace_s=2.0)


def transcript_of(events: list[tuple]) -> list[tuple]:
    """Per segment: (segment id, all its committed text, start_s, end_s, language) of its final.
    This is what does not depend on arrival timing: the engine commits at fixed audio-time
    boundaries, but whether an update runs at a segment's very end depends on whether the end
    arrived before the engine got to that boundary, so partial events may differ."""
    text: dict[int, str] = {}
    finals = []
    for seg, delta, partial, _, start_s, end_s, language, is_final in events:
        text[seg] = text.get(seg, "") + delta
        if is_final:
            assert partial == ""
            finals.append((seg, start_s, end_s, language))
    assert [f[0] for f in finals] == sorted(text), "one final per segment, in order"
    return [(seg, text[seg], start_s, end_s, language) for seg, start_s, end_s, language in finals]


def committed_text(transcripts) -> dict[int, str]:
    out: dict[int, str] = {}
    for t in transcripts:
        out[t.segment_id] = out.get(t.segment_id, "") + t.committed_delta
    return out


KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"
OK = grpc.StatusCode.OK
INVALID, ORDER = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


def bearer(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


def _scrape(port: int) -> dict:
    """The server's /metrics over HTTP: {(name, sorted labels): value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}
