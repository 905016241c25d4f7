"""cloud/server: the gRPC service on real loopback sockets (port 0), the tiny random model.

A minimal client written from the stubs drives it (the SDK has its own tests). What is checked:
the transcript through the server equals the in-process engine's for the same audio; thin clients
(Audio) get one too; bad input of every kind gets the right status code while a good session on
the same server carries on to its correct transcript; admission control; resume after a cancelled
stream replays events and frames into an identical transcript; TLS + API keys; metrics; shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from harken.cloud import wire
from harken.cloud.commit import CommitPolicy
from harken.cloud.server import ServerOptions, start_server
from harken.proto import harken_pb2 as pb
from harken.proto import harken_pb2_grpc
from harken.shared.codec import encode_frames
from signals import concat, silence, speech

SR = 16_000


# ---- fixtures ------------------------------------------------------------------------------------

# Short budgets keep the tiny model quick; a forced language makes it write text (left to detect,
# the random weights answer "language None", i.e. silence, and every transcript would be empty).
POLICY = CommitPolicy(update_interval_s=0.5, rollback_tokens=2, max_new_tokens_per_update=6, max_item_tokens=24)
LANGUAGE = "English"


@pytest.fixture(scope="module")
def asr():
    import torch

    from harken.cloud.model.asr import Qwen3ASR

    torch.set_num_threads(1)  # the test machine is shared: one thread is several times faster here
    return Qwen3ASR.load("tiny")


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    """Two utterances with a pause: two VAD segments, the second one long enough to be cut into.
    On the PCM16 grid, so a thin client sends exactly these samples."""
    x = concat(silence(0.3), speech("Hello there."), silence(0.8),
               speech("Good morning, how are you doing today?"), silence(0.5))
    return (np.clip(np.round(x * 32768), -32768, 32767) / 32768).astype(np.float32)


@pytest.fixture(scope="module")
def packets(audio):
    """The edge's feature packets for `audio`, pushed in 100 ms pieces (as the embedded engine does)."""
    from harken.edge.feature_stream import FeatureStream

    fs = FeatureStream()
    out = []
    for i in range(0, len(audio), SR // 10):
        out += fs.push(audio[i:i + SR // 10])
    return out + fs.flush()


@pytest.fixture(scope="module")
def reference(asr, audio):
    """The in-process engine's events for `audio` (cloud/embedded.py)."""
    from harken.cloud.embedded import stream_audio
    from harken.cloud.scheduler import Engine, EngineConfig
    from harken.cloud.session import SessionOptions

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


# ---- a minimal client ----------------------------------------------------------------------------

@dataclass
class Outcome:
    messages: list = field(default_factory=list)  # ServerMessage, in order
    code: grpc.StatusCode | None = None
    details: str = ""

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
                     hold_open: asyncio.Event | None = None) -> Outcome:
    """Send `messages`, collect every server message until the stream ends (or, with
    `stop_after(outcome)` true, cancel it there, as a dropped connection would)."""
    out = Outcome()
    channel = grpc.aio.secure_channel(target, credentials) if credentials else grpc.aio.insecure_channel(target)
    async with channel:
        async def requests():
            for m in messages:
                yield m
            if hold_open is not None:
                await hold_open.wait()

        call = harken_pb2_grpc.TranscriptionStub(channel).Stream(requests(), metadata=metadata)
        try:
            async for m in call:
                out.messages.append(m)
                if stop_after is not None and stop_after(out):
                    call.cancel()
                    out.code = grpc.StatusCode.CANCELLED
                    return out
            out.code = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            out.code, out.details = e.code(), e.details() or ""
    return out


@contextlib.asynccontextmanager
async def serving(asr, **kw):
    kw.setdefault("port", 0)
    kw.setdefault("policy", POLICY)
    server = await start_server(asr, ServerOptions(**kw))
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


# ---- end to end ----------------------------------------------------------------------------------

def test_features_client_gets_the_embedded_engines_transcript(asr, packets, reference):
    async def main():
        async with serving(asr) as server:
            return await run_stream(server.address, [start_msg(codec=wire.CODEC_NAME)]
                                    + features_msgs(packets) + [END])

    out = asyncio.run(main())
    assert out.code == grpc.StatusCode.OK, out.details
    assert out.ready.session_id and out.ready.resume_after_seq == 0 and out.ready.last_final_segment == -1
    assert transcript_of(out.events) == transcript_of(reference)
    assert [t.event_seq for t in out.transcripts] == list(range(1, len(out.transcripts) + 1))
    finals = [t for t in out.transcripts if t.is_final]
    assert all(t.seed.present and t.seed.next_segment_id == t.segment_id + 1 for t in finals)
    assert finals[-1].seed.running_max_log10 == pytest.approx(packets[-1].running_max_log10)
    assert out.acks[-1].seq == len(packets) and out.acks[-1].last_final_segment == finals[-1].segment_id


def test_thin_client_audio_gets_the_same_transcript(asr, audio, reference):
    """PCM16 in 100 ms pieces: the server's FeatureStream makes the packets the edge would."""
    async def main():
        async with serving(asr) as server:
            return await run_stream(server.address, [start_msg()] + audio_msgs(audio) + [END])

    out = asyncio.run(main())
    assert out.code == grpc.StatusCode.OK, out.details
    assert transcript_of(out.events) == transcript_of(reference)
    assert out.acks[-1].seq == len(audio_msgs(audio))


def test_thin_client_at_48k_is_resampled(asr, audio):
    import soxr

    audio48 = soxr.resample(audio, SR, 48_000).astype(np.float32)

    async def main():
        async with serving(asr) as server:
            return await run_stream(server.address, [start_msg()] + audio_msgs(audio48, rate=48_000) + [END])

    out = asyncio.run(main())
    assert out.code == grpc.StatusCode.OK, out.details
    finals = [t for t in out.transcripts if t.is_final]
    assert [t.segment_id for t in finals] == [0, 1]
    assert finals[0].start_s == pytest.approx(0.25, abs=0.05) and finals[1].end_s == pytest.approx(4.54, abs=0.1)


def committed_text(transcripts) -> dict[int, str]:
    out: dict[int, str] = {}
    for t in transcripts:
        out[t.segment_id] = out.get(t.segment_id, "") + t.committed_delta
    return out


