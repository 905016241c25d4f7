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
import json
import logging
import signal
import struct
import subprocess
import sys
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from google.protobuf.message import DecodeError
from prometheus_client.parser import text_string_to_metric_families

from harken.shared.codec import CODEC_NAME
from harken.cloud.commit import CommitPolicy
from harken.cloud.server import ServerOptions, start_server
from harken.proto import harken_pb2 as pb
from harken.proto import harken_pb2_grpc
from signals import concat, silence, speech, write_wav
from tls_files import self_signed

SR = 16_000
TIMEOUT = 60  # seconds a test stream may take: a hang fails instead of blocking the run


# ---- fixtures ------------------------------------------------------------------------------------

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
    from harken.cloud.engine import Engine, EngineConfig
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


@contextlib.asynccontextmanager
async def serving(asr, clock=None, **kw):
    kw.setdefault("port", 0)
    kw.setdefault("policy", POLICY)
    server = await start_server(asr, ServerOptions(**kw), **({"clock": clock} if clock else {}))
    try:
        yield server
    finally:
        await server.stop(grace_s=2.0)


class FakeClock:
    """The server's clock for grace periods and idle streams: time moves only when told."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


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
            return await run_stream(server.address, [start_msg(codec=CODEC_NAME)]
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


def test_thin_client_segments_do_not_depend_on_how_the_audio_is_cut(asr, audio, tmp_path):
    """The same PCM16 in 20 ms, 100 ms and 1000 ms `Audio` messages and in one: the server's VAD
    gives the same segments, so the same transcript, and they are `harken vad`'s segments of the
    same samples as a WAV file. `harken vad` reports samples (to the ms), a transcript reports
    frames (10 ms), so its segments are compared on the frame grid: the frames centred inside
    each, a start not before the previous end. Before, small pieces sent frames of the trailing
    pause past the VAD's end (the end frame depended on how much audio had come when the end was
    decided)."""
    pieces = {"20 ms": 0.02, "100 ms": 0.1, "1000 ms": 1.0, "whole": audio.size / SR}

    async def main():
        async with serving(asr) as server:
            return {label: await run_stream(server.address, [start_msg()] + audio_msgs(audio, piece_s=piece_s) + [END])
                    for label, piece_s in pieces.items()}

    outs = asyncio.run(main())
    wav = tmp_path / "audio.wav"
    write_wav(wav, audio)
    vad = json.loads(subprocess.run([sys.executable, "-m", "harken", "vad", str(wav), "--json"], check=True,
                                    capture_output=True, text=True, timeout=120).stdout)
    expected: list[tuple[float, float]] = []
    end_frame = 0
    for seg in vad["segments"]:
        start, end = round(seg["start_s"] * SR), round(seg["end_s"] * SR)  # whole ms: exact samples
        first = max(start // 160, end_frame)
        end_frame = -(-end // 160)
        expected.append((first / 100, end_frame / 100))
    assert len(expected) == 2
    whole = transcript_of(outs["whole"].events)
    for label, out in outs.items():
        assert out.code == OK, (label, out.details)
        got = transcript_of(out.events)
        assert [(start_s, end_s) for _, _, start_s, end_s, _ in got] == expected, label
        assert got == whole, label


def test_a_client_that_half_closes_without_end_gets_its_finals_and_ok(asr, packets, reference):
    """Half-close = End: the open segment is finalised, its final sent, the stream closed OK (it
    used to hang, the segment never final)."""
    msgs = [start_msg(codec=CODEC_NAME)] + features_msgs(packets)

    async def main():
        async with serving(asr) as server:
            return await asyncio.wait_for(run_stream(server.address, msgs), TIMEOUT)

    out = asyncio.run(main())
    assert out.code == OK, out.details
    assert transcript_of(out.events) == transcript_of(reference)


def test_a_half_close_in_an_open_segment_finalises_it(asr, packets):
    open_segment = [p for p in packets if p.segment_id == 0][:-1]
    assert not open_segment[-1].segment_end

    async def main():
        async with serving(asr) as server:
            return await asyncio.wait_for(
                run_stream(server.address, [start_msg(codec=CODEC_NAME)] + features_msgs(open_segment)), TIMEOUT)

    out = asyncio.run(main())
    assert out.code == OK, out.details
    assert [t.segment_id for t in out.transcripts if t.is_final] == [0]


def test_thin_client_with_a_few_samples_ends_ok_with_no_text(asr):
    """Fewer samples than one log-mel frame needs (201) is valid input: no events, a clean OK."""
    async def main():
        async with serving(asr) as server:
            return [await run_stream(server.address, [start_msg()] + audio_msgs(np.full(n, 0.2, np.float32))
                                     + [END]) for n in (1, 150, 200)]

    for out in asyncio.run(main()):
        assert out.code == grpc.StatusCode.OK, out.details
        assert out.transcripts == [] and out.acks[-1].seq == 1


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


# ---- bad input, next to a good session --------------------------------------------------------------

KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"
OK = grpc.StatusCode.OK
INVALID, ORDER = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


def bearer(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


class BackgroundServer:
    """A server on an event loop in its own thread, for synchronous clients (hypothesis examples)."""

    def __init__(self, asr, **kw):
        self.asr, self.kw = asr, kw
        self.ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self):
        self.loop = asyncio.get_running_loop()
        self.stop = asyncio.Event()
        async with serving(self.asr, **self.kw) as server:
            self.server = server
            self.ready.set()
            await self.stop.wait()

    def __enter__(self) -> "BackgroundServer":
        self.thread.start()
        assert self.ready.wait(60)
        self.channel = grpc.insecure_channel(self.server.address)
        self.call = self.channel.stream_stream("/harken.v1.Transcription/Stream", request_serializer=None,
                                               response_deserializer=pb.ServerMessage.FromString)
        return self

    def __exit__(self, *exc):
        self.channel.close()
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(60)

    def stream(self, messages, metadata=bearer(KEY_A)) -> Outcome:
        """Send raw bytes (or messages), half-close, collect the answer."""
        raw = [m if isinstance(m, bytes) else m.SerializeToString() for m in messages]
        out = Outcome()
        try:
            for m in self.call(iter(raw), metadata=metadata, timeout=TIMEOUT):
                out.messages.append(m)
            out.code = OK
        except grpc.RpcError as e:
            out.code, out.details = e.code(), e.details() or ""
        return out


class GoodSession(threading.Thread):
    """A well-behaved client (key B) that sends its packets, then holds the stream open until
    `release` is set, then ends: its transcript must come out right whatever else happens."""

    def __init__(self, background: BackgroundServer, packets):
        super().__init__(daemon=True)
        self.bg, self.packets = background, packets
        self.release = threading.Event()
        self.ready = threading.Event()
        self.outcome = Outcome()

    def run(self):
        def requests():
            yield start_msg(codec=CODEC_NAME).SerializeToString()
            for m in features_msgs(self.packets):
                yield m.SerializeToString()
            self.release.wait(600)
            yield END.SerializeToString()

        try:
            for m in self.bg.call(requests(), metadata=bearer(KEY_B)):
                self.outcome.messages.append(m)
                self.ready.set()
            self.outcome.code = OK
        except grpc.RpcError as e:
            self.outcome.code, self.outcome.details = e.code(), e.details() or ""
        self.ready.set()


@pytest.fixture(scope="module")
def busy_server(asr, packets, reference, tmp_path_factory):
    """One server for all bad-input cases, with a good session running through them; on teardown
    the good session ends and must have the reference transcript."""
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"# test keys\n{KEY_A} alice\n{KEY_B} bob\n")
    # the good session holds its stream open, sending nothing, through the whole module: not idle
    with BackgroundServer(asr, api_keys=str(keys), max_sessions=64, max_sessions_per_key=64, grace_s=0.5,
                          idle_timeout_s=3600) as bg:
        good = GoodSession(bg, packets)
        good.start()
        assert good.ready.wait(60)
        bg.good = good
        yield bg
        good.release.set()
        good.join(120)
    assert good.outcome.code == OK, good.outcome.details
    assert transcript_of(good.outcome.events) == transcript_of(reference)


def _probe(applied: int) -> bytes:
    """A message with a gap after `applied`: its error message says what the server applied."""
    return pb.ClientMessage(features=pb.Features(seq=applied + 2, payload=b"\xa7\x10\x00")).SerializeToString()


FEW = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
MANY = settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))


def test_garbage_first_messages(busy_server):
    """Bytes that are no ClientMessage -> INVALID_ARGUMENT; a ClientMessage other than start ->
    FAILED_PRECONDITION."""
    @MANY
    @given(st.binary(max_size=48))
    def check(data):
        try:
            kind = pb.ClientMessage.FromString(data).WhichOneof("kind")
        except DecodeError:
            kind = "garbage"
        if kind == "start":
            return  # covered with structured starts below
        out = busy_server.stream([data])
        if kind == "garbage":
            assert (out.code, out.details[:29]) == (INVALID, "not a harken.v1.ClientMessage")
        else:
            assert (out.code, out.details) == (ORDER, f"the first message must be start, got {kind or 'an empty message'}")
        assert [m.WhichOneof("kind") for m in out.messages] == ["error"]
        assert out.messages[0].error.code == out.code.name

    check()


def test_bad_starts(busy_server):
    """Every field of Start: each violation gives one of its codes; a valid start opens a session
    that ends cleanly when the client half-closes."""
    from harken.cloud.model.prompt import forced_language
    from harken.shared.errors import HarkenError

    def mostly(valid: list, other):
        """A valid value 4 times in 5, else anything: so all-valid starts come up often too."""
        return st.integers(0, 4).flatmap(lambda k: other if k == 0 else st.sampled_from(valid))

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(codec=mostly(["", CODEC_NAME], st.sampled_from(["opus", "harken-mel/2"]) | st.text(max_size=80)),
           language=mostly(["", "English", "en", "Chinese"], st.sampled_from(["Klingon"]) | st.text(max_size=80)),
           context=mostly(["", "harken"], st.integers(8001, 9000).map(lambda n: "é" * n)),
           session_id=mostly([""], st.text(max_size=70)),
           seed=mostly([None], st.tuples(st.floats(width=32), st.text(max_size=10), st.integers(0, 5))),
           last_event_seq=st.integers(0, 2**64 - 1))
    def check(codec, language, context, session_id, seed, last_event_seq):
        msg = start_msg(codec=codec, language=language, context=context, session_id=session_id,
                        last_event_seq=last_event_seq)
        if seed is not None:
            msg.start.seed.CopyFrom(pb.SessionSeed(present=True, running_max_log10=seed[0], context_tail=seed[1],
                                                   next_segment_id=seed[2]))
        expected = set()
        if codec not in ("", CODEC_NAME) or len(language) > 64 or len(context) > 8000 or len(session_id) > 64:
            expected.add(INVALID)
        if seed is not None:
            if session_id or not (abs(seed[0]) <= 100 or seed[0] == -np.inf):
                expected.add(INVALID)
        if session_id:
            expected.add(grpc.StatusCode.NOT_FOUND)
        elif language:
            try:
                forced_language(language)
            except HarkenError:
                expected.add(INVALID)
        out = busy_server.stream([msg, END])
        event(out.code.name)
        assert out.code in (expected or {OK}), (out.code, out.details)
        if out.code == OK:
            assert [m.WhichOneof("kind") for m in out.messages] == ["ready", "ack"]
            assert out.ready.last_final_segment == (seed[2] - 1 if seed else -1)

    check()


# what can be done to one Features message
MUTATIONS = ("none", "flip", "truncate", "count+1", "random", "nan_floor", "empty", "nan_running_max", "zero_seq")


def _mutate(f: pb.Features, mutation: str, rng) -> None:
    p = bytearray(f.payload)
    if mutation == "flip" and p:
        p[rng.randrange(len(p))] ^= 1 << rng.randrange(8)
    elif mutation == "truncate":
        p = p[:rng.randrange(len(p))] if p else p
    elif mutation == "count+1":
        f.frame_count += 1
    elif mutation == "random":
        p = bytearray(rng.randbytes(rng.randrange(1, 64)))
    elif mutation == "nan_floor" and len(p) >= 7:
        p[3:7] = struct.pack("<f", float("nan"))
    elif mutation == "nan_running_max":
        f.running_max_log10 = float("nan")
    elif mutation == "zero_seq":
        f.seq = 0
    f.payload = bytes(p)


def test_bad_feature_sequences(busy_server, packets):
    """Random sequences of real, replayed, reordered and corrupted Features messages against an
    independent model of the contract: the first violation gets its code, and until then the server
    applied exactly what the contract says (a probe with a gap makes it tell)."""
    from harken.shared.codec import decode_frames
    from harken.shared.errors import CodecError

    seg0 = [p for p in packets if p.segment_id == 0]
    seg1 = [p for p in packets if p.segment_id == 1][:2]
    pool = seg0[:3] + seg1  # few valid frames, so the model rarely runs

    # mostly the next packet, the next seq and no mutation: so sequences get some way in
    which = st.integers(0, 2 * len(pool)).map(lambda k: None if k >= len(pool) else k)
    how = st.sampled_from(["next"] * 4 + ["dup", "gap"])
    mutation = st.sampled_from(["none"] * len(MUTATIONS) + list(MUTATIONS))

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(ops=st.lists(st.tuples(which, how, mutation, st.randoms(use_true_random=False)), min_size=1, max_size=6))
    def check(ops):
        applied, open_seg, next_frame, last_seg = 0, None, 0, -1
        messages, expected, cursor = [start_msg(codec=CODEC_NAME)], None, 0
        for i, how, mutation, rng in ops:
            p = pool[cursor % len(pool) if i is None else i]
            seq = {"next": applied + 1, "dup": max(applied, 1), "gap": applied + 3}[how]
            f = features_msgs([p], first_seq=seq)[0].features
            _mutate(f, mutation, rng)
            messages.append(pb.ClientMessage(features=f))
            if f.seq == 0 or not f.payload or np.isnan(f.running_max_log10):
                expected = {INVALID}
                break
            if f.seq <= applied:
                continue  # a duplicate: ignored
            if f.seq > applied + 1:
                expected = {ORDER}
                break
            bad = set()
            if open_seg is None:
                if not f.segment_start or f.segment_id <= last_seg:
                    bad.add(ORDER)
            elif f.segment_start or f.segment_id != open_seg or f.first_frame != next_frame:
                bad.add(ORDER)
            try:
                if decode_frames(f.payload).shape[1] != f.frame_count:
                    bad.add(INVALID)
            except CodecError:
                bad.add(INVALID)
            if bad:
                expected = bad
                break
            applied += 1
            cursor = pool.index(p) + 1
            if f.segment_start:
                open_seg, last_seg = f.segment_id, f.segment_id
            next_frame = f.first_frame + f.frame_count
            if f.segment_end:
                open_seg = None
        if expected is None:
            messages.append(_probe(applied))
            expected = {ORDER}
        out = busy_server.stream(messages)
        event(f"{out.code.name} after {applied} applied")
        assert out.code in expected, (out.code, out.details)
        if messages[-1] == _probe(applied):
            assert out.details == f"seq {applied + 2} leaves a gap: the last applied was {applied}"

    check()


def test_bad_audio_messages(busy_server, audio):
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(rate=st.integers(0, 300_000) | st.sampled_from([8000, 16000, 44100]), n_bytes=st.integers(0, 801),
           seq=st.integers(0, 3))
    def check(rate, n_bytes, seq):
        pcm = (audio[:401] * 32767).astype("<i2").tobytes()[:n_bytes]
        msgs = [start_msg(), pb.ClientMessage(audio=pb.Audio(seq=seq, pcm16=pcm, sample_rate=rate))]
        if seq == 0 or len(pcm) % 2 or not 8000 <= rate <= 192_000:
            expected, applied = INVALID, None
        elif seq > 1:
            expected, applied = ORDER, None
        else:
            expected, applied = ORDER, 1
            msgs.append(_probe(1))
        out = busy_server.stream(msgs)
        assert out.code == expected, (out.code, out.details)
        if applied is not None:
            assert out.details == "seq 3 leaves a gap: the last applied was 1"

    check()


# a valid payload of a minute of frames at their floor, in 10 bytes: the codec allows it, the wire not
AT_FLOOR_6000 = bytes.fromhex("a7 12 f0 2e 00 00 40 c0 00 60")


@pytest.mark.parametrize("case", ["nan_features", "mixed", "second_start", "after_end", "oversized_message", "frame_count",
                                  "amplified", "long_audio", "rate_change", "segment_backwards", "frames_after_finalize"])
def test_order_and_size_violations(busy_server, packets, case):
    f = features_msgs(packets[:3])
    a = pb.ClientMessage(audio=pb.Audio(seq=2, pcm16=b"\0\0" * 160, sample_rate=16000))
    whole_segment_1 = pb.ClientMessage(features=pb.Features(
        seq=1, segment_id=1, first_frame=packets[0].first_frame, frame_count=packets[0].frame_count,
        segment_start=True, segment_end=True, payload=packets[0].payload))
    nan = features_msgs(packets[:1])[0]
    nan.features.payload = nan.features.payload[:3] + struct.pack("<f", float("nan")) + nan.features.payload[7:]
    cases = {
        "nan_features": ([nan], INVALID, "corrupt payload: floor value out of range"),
        "mixed": ([f[0], a], ORDER, "audio in a session that receives features: do not mix them"),
        "second_start": ([f[0], start_msg()], ORDER, "start may only be the first message of a stream"),
        "after_end": ([f[0], END, f[1]], ORDER, "the session has ended: no input after end"),
        "oversized_message": ([pb.ClientMessage(audio=pb.Audio(seq=1, pcm16=b"\0" * (1 << 20) * 2, sample_rate=8000))],
                              grpc.StatusCode.RESOURCE_EXHAUSTED, None),
        "frame_count": ([pb.ClientMessage(features=pb.Features(seq=1, frame_count=6001, payload=b"x"))],
                        INVALID, "features.frame_count 6001 exceeds 6000"),
        "amplified": ([pb.ClientMessage(features=pb.Features(seq=1, segment_start=True, frame_count=6000,
                                                              payload=AT_FLOOR_6000))],
                      INVALID, "features.frame_count 6000 is more than a payload of 10 bytes may carry "
                               "(8 frames per byte)"),
        "long_audio": ([pb.ClientMessage(audio=pb.Audio(seq=1, pcm16=b"\0\0" * 8000 * 31, sample_rate=8000))],
                       INVALID, "audio message longer than 30 s"),
        "rate_change": ([pb.ClientMessage(audio=pb.Audio(seq=1, pcm16=b"\0\0" * 160, sample_rate=16000)),
                         pb.ClientMessage(audio=pb.Audio(seq=2, pcm16=b"\0\0" * 160, sample_rate=8000))],
                        INVALID, "audio.sample_rate changed from 16000 to 8000"),
        "segment_backwards": ([whole_segment_1] + features_msgs(packets[:1], first_seq=2),
                              ORDER, "segment id 0 does not increase (last was 1)"),
        "frames_after_finalize": ([f[0], pb.ClientMessage(finalize=pb.Finalize()), f[1]], ORDER,
                                  "features for segment 0 without segment_start: no segment is open"),
    }
    msgs, code, details = cases[case]
    out = busy_server.stream([start_msg(codec=CODEC_NAME)] + msgs)
    assert out.code == code, out.details
    if details is not None:
        assert out.details == details


def test_keys_and_ownership(busy_server):
    good_id = busy_server.good.outcome.ready.session_id
    cases = [
        ((), grpc.StatusCode.UNAUTHENTICATED, "missing API key: send 'authorization: Bearer <key>' metadata"),
        (bearer("not-a-key-at-all"), grpc.StatusCode.UNAUTHENTICATED, "unknown API key"),
        ((("authorization", KEY_A),), grpc.StatusCode.UNAUTHENTICATED,
         "missing API key: send 'authorization: Bearer <key>' metadata"),
    ]
    for metadata, code, details in cases:
        out = busy_server.stream([start_msg()], metadata=metadata)
        assert (out.code, out.details) == (code, details)
    # key A may not touch key B's session, and learns nothing from trying
    out = busy_server.stream([start_msg(session_id=good_id)], metadata=bearer(KEY_A))
    assert (out.code, out.details) == (grpc.StatusCode.PERMISSION_DENIED, "this session belongs to another API key")
    assert out.messages[0].error.code == "PERMISSION_DENIED" and good_id not in out.messages[0].error.message


def test_a_missing_key_is_unauthenticated_every_time_even_for_a_client_still_writing(asr, tmp_path):
    """50 calls without a key from a client that streams on right after Start (as a live client
    does), read with plain grpc.aio: every status is UNAUTHENTICATED. Before the server read what
    such a client still sent, its write failed and grpc.aio showed INTERNAL about 1 time in 2."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n")

    async def main():
        codes = []
        async with serving(asr, api_keys=str(keys)) as server, grpc.aio.insecure_channel(server.address) as ch:
            stub = harken_pb2_grpc.TranscriptionStub(ch)
            for _ in range(50):
                async def requests():
                    yield start_msg(codec=CODEC_NAME)
                    for m in _at_floor_packets(20, frames=20):
                        yield m
                        await asyncio.sleep(0)

                try:
                    async for _ in stub.Stream(requests(), timeout=TIMEOUT):
                        pass
                    codes.append(OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
        return codes

    codes = asyncio.run(main())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 50, {c.name: codes.count(c) for c in set(codes)}


# ---- admission control ---------------------------------------------------------------------------

def test_overload_refuses_new_streams_at_once_while_admitted_ones_continue(asr, packets, reference, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")

    async def main():
        async with serving(asr, api_keys=str(keys), max_sessions=3, max_sessions_per_key=2) as server:
            release = asyncio.Event()
            msgs = [start_msg(codec=CODEC_NAME)] + features_msgs(packets) + [END]
            admitted = []

            async def admit(key):
                out = Outcome()
                admitted.append((out, asyncio.create_task(run_stream(
                    server.address, msgs[:-1], metadata=bearer(key), hold_open=release, then=[END], out=out))))
                await out.progress.wait()  # Ready: admitted
                assert out.ready.session_id

            await admit(KEY_A)
            await admit(KEY_A)
            per_key = await run_stream(server.address, msgs, metadata=bearer(KEY_A))
            await admit(KEY_B)
            server_full = await run_stream(server.address, msgs, metadata=bearer(KEY_B))
            # the refusals came while every admitted stream was still open (release is not set)
            assert not any(task.done() for _, task in admitted)
            release.set()
            return per_key, server_full, [await task for _, task in admitted]

    per_key, server_full, admitted = asyncio.run(main())
    assert (per_key.code, per_key.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                               "this key holds its maximum of 2 sessions")
    assert (server_full.code, server_full.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                       "the server holds its maximum of 3 sessions")
    for out in admitted:
        assert out.code == OK, out.details
        assert transcript_of(out.events) == transcript_of(reference)


def _at_floor_packets(n: int, frames: int = 72) -> list[pb.ClientMessage]:
    """One segment of `n` Features messages of `frames` frames at their floor: 9 bytes each, the
    most audio per byte the wire accepts."""
    from harken.shared.codec import encode_frames

    payload = encode_frames(np.full((128, frames), -3.0, np.float32), floor_log10=-3.0)
    return [pb.ClientMessage(features=pb.Features(seq=i + 1, segment_id=0, first_frame=i * frames,
                                                  frame_count=frames, segment_start=i == 0, payload=payload))
            for i in range(n)]


def test_a_client_flooding_queued_audio_waits_on_itself_and_others_are_admitted(asr, tmp_path):
    """The engine is stalled (the fault: a model that has fallen behind) while key A sends 14 s of
    frames as fast as it can, and opens a second session. Its sessions stop being read at their own
    limit and A gets no third one past its key's limit; key B, and a second session of key A, are
    still admitted: A cannot fill the server's queue alone and make it refuse everyone."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} alice\n{KEY_B} bob\n")  # sessions are bound to the names

    async def main():
        async with serving(asr, api_keys=str(keys), max_queued_frames=1000, max_queued_frames_per_session=300,
                           max_queued_frames_per_key=500, shutdown_grace_s=0.2) as server:
            await server._scheduler.stop()  # no more ticks: nothing queued is encoded
            flood = _at_floor_packets(20)  # 1440 frames: past every limit
            hold = asyncio.Event()
            first = Outcome()
            flooding = [asyncio.create_task(run_stream(server.address, [start_msg(codec=CODEC_NAME)] + flood,
                                                       metadata=bearer(KEY_A), hold_open=hold, out=first))]

            def queued(key):
                return server._table.queued_frames_of_key(key)

            while queued("alice") <= 300:  # A's first session reads until past its own limit ...
                await asyncio.sleep(0.02)
            second = Outcome()
            flooding.append(asyncio.create_task(run_stream(
                server.address, [start_msg(codec=CODEC_NAME)] + flood, metadata=bearer(KEY_A), hold_open=hold,
                out=second)))
            await second.progress.wait()  # ... so A still gets a second session
            while queued("alice") <= 500:
                await asyncio.sleep(0.02)
            third = await run_stream(server.address, [start_msg(codec=CODEC_NAME), END], metadata=bearer(KEY_A))
            other = await run_stream(server.address, [start_msg(codec=CODEC_NAME), END], metadata=bearer(KEY_B))
            per_session = [s.queued_frames() for s in server._table.sessions.values() if s.key_id == "alice"]
            for task in flooding:
                task.cancel()
            await asyncio.gather(*flooding, return_exceptions=True)
            return third, other, per_session

    third, other, per_session = asyncio.run(main())
    # the first session stopped one message (72 frames) past its own limit (360), the second one
    # past the key's (the key then holds 504: 5 s)
    assert per_session == [360, 144]
    assert (third.code, third.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           "this key has 5 s of audio waiting to be processed")
    assert other.code == OK, other.details


# ---- idle streams and detached sessions ----------------------------------------------------------

IDLE_S = 0.4  # the idle timeout of these servers, on their fake clock (the reaper looks every 0.1 s)
DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_silent_stream_is_reaped_and_its_slot_goes_to_the_next_client(asr, packets, reference):
    """A client sends Start and then nothing, on a server of one session. While the clock stands
    still it holds the slot (the next client is refused); once it has been idle past the timeout
    it is ended DEADLINE_EXCEEDED with a message saying so, its session is closed, and the next
    client gets the slot and its whole transcript."""
    clock = FakeClock()

    async def main():
        async with serving(asr, clock=clock, max_sessions=1, idle_timeout_s=IDLE_S, grace_s=600) as server:
            silent = Outcome()
            silent_task = asyncio.create_task(run_stream(server.address, [start_msg(codec=CODEC_NAME)],
                                                         hold_open=asyncio.Event(), out=silent))
            await silent.progress.wait()  # Ready: it holds the one slot
            msgs = [start_msg(codec=CODEC_NAME)] + features_msgs(packets) + [END]
            refused = await run_stream(server.address, msgs)
            await server._table.next_sweep()
            still_open = not silent_task.done()
            clock.advance(IDLE_S + 0.6)
            await asyncio.wait_for(silent_task, TIMEOUT)
            held = len(server._table.sessions)
            admitted = await run_stream(server.address, msgs)
            errors = server.metrics.registry.get_sample_value("harken_errors_total", {"code": "DEADLINE_EXCEEDED"})
            return refused, still_open, silent, held, admitted, errors

    refused, still_open, silent, held, admitted, errors = asyncio.run(main())
    assert (refused.code, refused.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                               "the server holds its maximum of 1 sessions")
    assert still_open
    assert silent.code == DEADLINE, silent.details
    assert silent.details == (f"the stream was idle for 1.0 s (limit {IDLE_S:g} s): no message while the server "
                              "had nothing to do for it; the session is closed")
    assert silent.messages[-1].error.code == "DEADLINE_EXCEEDED"
    assert held == 0 and errors == 1
    assert admitted.code == OK, admitted.details
    assert transcript_of(admitted.events) == transcript_of(reference)


def test_a_stream_whose_audio_is_pending_in_the_engine_is_not_reaped(asr, packets):
    """The engine is stalled with an update of this stream due: however long the clock runs, the
    stream is not idle (the server owes it work). Once the engine has done that work, the stream,
    still sending nothing, is idle from then on and is reaped."""
    clock = FakeClock()
    first = packets[:next(i for i, p in enumerate(packets) if p.segment_end)]  # the first segment but its end
    head = features_msgs(first)
    assert head[0].features.segment_start and sum(p.frame_count for p in first) >= 50  # past an update (50 frames)

    async def main():
        async with serving(asr, clock=clock, idle_timeout_s=IDLE_S, grace_s=600) as server:
            await server._scheduler.stop()  # the fault: the engine does not step
            out = Outcome()
            task = asyncio.create_task(run_stream(server.address, [start_msg(codec=CODEC_NAME)] + head,
                                                  hold_open=asyncio.Event(), out=out))
            applied = server.metrics.registry.get_sample_value
            for _ in range(6000):  # until all are applied, the update due (a hang guard, not a timing)
                if applied("harken_messages_in_total", {"kind": "features"}) == len(head):
                    break
                await asyncio.sleep(0.01)
            clock.advance(100.0)
            for _ in range(3):
                await server._table.next_sweep()
            pending_survived = not task.done()
            await server._scheduler.start()
            while not out.transcripts:  # the engine did the update: nothing more is due
                out.progress.clear()
                await out.progress.wait()
            await server._table.next_sweep()
            clock.advance(IDLE_S + 0.6)
            await asyncio.wait_for(task, TIMEOUT)
            return pending_survived, out

    pending_survived, out = asyncio.run(main())
    assert pending_survived
    assert out.code == DEADLINE and out.details.startswith("the stream was idle for 1.0 s"), out.details


def test_detached_sessions_count_against_their_key_not_against_other_keys(asr, packets, reference, tmp_path):
    """Key A opens two sessions and drops both (they wait in their grace period for A to resume):
    A's third session is refused at its key's limit of 2. The server's limit is 2 as well, but key
    B is admitted: the session detached longest gives way (A resuming it gets NOT_FOUND, and would
    replay into a new session), while A's other detached session can still be resumed."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    clock = FakeClock()

    async def main():
        async with serving(asr, clock=clock, api_keys=str(keys), max_sessions=2, max_sessions_per_key=2,
                           grace_s=600) as server:
            dropped = []
            for _ in range(2):
                out = await run_stream(server.address, [start_msg(codec=CODEC_NAME)], metadata=bearer(KEY_A),
                                       hold_open=asyncio.Event(), stop_after=lambda out: True)
                dropped.append(out.ready.session_id)
                session = server._table.sessions[out.ready.session_id]
                for _ in range(400):  # the handler's cleanup runs after the cancellation comes back
                    if session.detached_at is not None:
                        break
                    await asyncio.sleep(0.01)
                clock.advance(1.0)
            detached = [server._table.sessions[sid].detached_at is not None for sid in dropped]
            third = await run_stream(server.address, [start_msg(codec=CODEC_NAME), END], metadata=bearer(KEY_A))
            other = await run_stream(server.address, [start_msg(codec=CODEC_NAME)] + features_msgs(packets) + [END],
                                     metadata=bearer(KEY_B))
            first_again = await run_stream(server.address, [start_msg(session_id=dropped[0])], metadata=bearer(KEY_A))
            second_again = await run_stream(server.address, [start_msg(session_id=dropped[1]), END],
                                            metadata=bearer(KEY_A))
            return dropped, detached, third, other, first_again, second_again

    dropped, detached, third, other, first_again, second_again = asyncio.run(main())
    assert detached == [True, True]
    assert (third.code, third.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           "this key holds its maximum of 2 sessions")
    assert other.code == OK, other.details
    assert transcript_of(other.events) == transcript_of(reference)
    assert first_again.code == grpc.StatusCode.NOT_FOUND, first_again.details
    assert second_again.code == OK, second_again.details
    assert second_again.ready.session_id == dropped[1]


def test_keepalive_pings_find_a_dead_connection_and_detach_its_stream(asr):
    """The network under an attached stream goes silent (a proxy drops every byte, no reset): the
    server's keepalive ping goes unanswered, it closes the connection, and the stream is detached,
    so the session's grace period runs (without pings it stayed attached until the idle timeout,
    here far away)."""
    from faults import CuttingProxy

    async def main():
        async with serving(asr, keepalive_time_s=0.2, keepalive_timeout_s=0.3, idle_timeout_s=600,
                           grace_s=600) as server:
            proxy = await CuttingProxy("127.0.0.1", server.port, max_cuts=0).start()
            out = Outcome()
            task = asyncio.create_task(run_stream(proxy.target, [start_msg(codec=CODEC_NAME)],
                                                  hold_open=asyncio.Event(), out=out))
            await out.progress.wait()
            session = server._table.sessions[out.ready.session_id]
            proxy.stall()
            for _ in range(600):  # bounded: a few keepalive periods, generously
                if session.attachment is None:
                    break
                await asyncio.sleep(0.05)
            detached = session.attachment is None and session.detached_at is not None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await proxy.close()
            return detached

    assert asyncio.run(main())


# ---- resume ----------------------------------------------------------------------------------------

def test_resume_after_a_cancelled_stream_gives_the_identical_transcript(asr, packets, reference):
    msgs = features_msgs(packets)
    seg1 = [i for i, p in enumerate(packets) if p.segment_id == 1]
    cut = seg1[len(seg1) // 2] // 5 * 5  # Acks come every 5 messages: cancel after this one's
    assert packets[cut - 1].segment_id == 1 and not packets[cut - 1].segment_end, "mid-segment"
    sent = cut + 2  # the server may or may not have applied the last two when the stream drops

    async def main():
        async with serving(asr) as server:
            first = await run_stream(
                server.address, [start_msg(codec=CODEC_NAME)] + msgs[:sent], hold_open=asyncio.Event(),
                stop_after=lambda out: bool(out.acks) and out.acks[-1].seq >= cut and bool(out.transcripts))
            last_seen = first.transcripts[-1].event_seq
            async with grpc.aio.insecure_channel(server.address) as channel:
                call = harken_pb2_grpc.TranscriptionStub(channel).Stream()
                # ask for one event again: the server must replay it as it was
                await call.write(start_msg(session_id=first.ready.session_id, last_event_seq=last_seen - 1))
                ready = (await call.read()).ready
                for m in msgs[ready.resume_after_seq:]:
                    await call.write(m)
                await call.write(END)
                await call.done_writing()
                second = Outcome(messages=[pb.ServerMessage(ready=ready)])
                while (m := await call.read()) != grpc.aio.EOF:
                    second.messages.append(m)
                second.code = await call.code()
            return first, ready, second

    first, ready, second = asyncio.run(main())
    assert ready.session_id == first.ready.session_id
    assert cut <= ready.resume_after_seq <= sent
    assert ready.last_final_segment in (-1, 0)  # segment 0 is final once the engine got to it
    replayed = second.transcripts[0]
    assert replayed == first.transcripts[-1], "the event lost in flight is replayed as it was"
    events = first.transcripts[:-1] + second.transcripts
    assert [t.event_seq for t in events] == list(range(1, len(events) + 1))
    assert second.code == OK
    assert transcript_of([_wire_event(t) for t in events]) == transcript_of(reference)


def test_end_repeated_after_a_resume_is_a_replay_not_an_error(asr, packets, reference):
    """The connection drops after the client sent End but before the last finals: the client
    resumes the same session, resends what the server had not applied and repeats End (it cannot
    know whether the first End arrived). Either way it gets the rest of the events, nothing twice."""
    msgs = features_msgs(packets)

    async def main():
        async with serving(asr) as server:
            first = await run_stream(server.address, [start_msg(codec=CODEC_NAME)] + msgs + [END],
                                     stop_after=lambda out: bool(out.transcripts))
            seen = first.transcripts[-1].event_seq
            async with grpc.aio.insecure_channel(server.address) as channel:
                call = harken_pb2_grpc.TranscriptionStub(channel).Stream()
                await call.write(start_msg(session_id=first.ready.session_id, last_event_seq=seen))
                ready = (await call.read()).ready
                for m in msgs[ready.resume_after_seq:]:
                    await call.write(m)
                await call.write(END)
                await call.done_writing()
                second = Outcome(messages=[pb.ServerMessage(ready=ready)])
                while (m := await call.read()) != grpc.aio.EOF:
                    second.messages.append(m)
                second.code = await call.code()
            return first, second

    first, second = asyncio.run(main())
    assert second.code == OK, second.details
    assert second.ready.session_id == first.ready.session_id
    events = first.transcripts + second.transcripts
    assert [t.event_seq for t in events] == list(range(1, len(events) + 1))
    assert transcript_of([_wire_event(t) for t in events]) == transcript_of(reference)


def test_a_new_attach_detaches_the_old_stream_and_unknown_ids_are_not_found(asr, packets):
    async def main():
        async with serving(asr, grace_s=0.2) as server:
            old = Outcome()
            old_task = asyncio.create_task(run_stream(server.address, [start_msg(codec=CODEC_NAME)],
                                                      hold_open=asyncio.Event(), out=old))
            await old.progress.wait()
            sid = old.ready.session_id
            new = await run_stream(server.address, [start_msg(session_id=sid)] + features_msgs(packets[:2]),
                                   stop_after=lambda out: True)  # attached (Ready), then drops
            await old_task
            # nobody resumes: the grace period ends and the session is gone
            for _ in range(200):
                if not server._table.sessions:
                    break
                await asyncio.sleep(0.05)
            gone = await run_stream(server.address, [start_msg(session_id=sid)])
            return old, new, gone

    old, new, gone = asyncio.run(main())
    assert (old.code, old.details) == (grpc.StatusCode.ABORTED, "a newer stream attached to this session")
    assert new.ready.session_id == old.ready.session_id and new.ready.resume_after_seq == 0
    assert gone.code == grpc.StatusCode.NOT_FOUND and "open a new session with the last seed" in gone.details


# ---- TLS, metrics, health, reflection, shutdown -------------------------------------------------

def test_tls_and_api_key_round_trip(asr, packets, reference, tmp_path):
    cert, key = self_signed(tmp_path)
    cert_pem = Path(cert).read_bytes()
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} alice\n")
    credentials = grpc.ssl_channel_credentials(root_certificates=cert_pem)

    async def main():
        async with serving(asr, tls_cert=cert, tls_key=key, api_keys=str(keys)) as server:
            target = f"localhost:{server.port}"
            msgs = [start_msg(codec=CODEC_NAME)] + features_msgs(packets) + [END]
            good = await run_stream(target, msgs, metadata=bearer(KEY_A), credentials=credentials)
            wrong = await run_stream(target, msgs, metadata=bearer(KEY_B), credentials=credentials)
            plaintext = await run_stream(f"127.0.0.1:{server.port}", msgs, metadata=bearer(KEY_A))
            return server.tls, good, wrong, plaintext

    tls, good, wrong, plaintext = asyncio.run(main())
    assert tls
    assert good.code == OK, good.details
    assert transcript_of(good.events) == transcript_of(reference)
    assert (wrong.code, wrong.details) == (grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
    assert plaintext.code == grpc.StatusCode.UNAVAILABLE and not plaintext.messages


def test_metrics_health_and_reflection(asr, packets):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def main():
        async with serving(asr, metrics_port=0) as server:
            msgs = [start_msg(codec=CODEC_NAME)] + features_msgs(packets) + [END]
            out = await run_stream(server.address, msgs)
            bad = await run_stream(server.address, [END])
            async with grpc.aio.insecure_channel(server.address) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="harken.v1.Transcription"))
                services = []
                async for r in reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                        iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
                    services += [s.name for s in r.list_services_response.service]
            url = f"http://127.0.0.1:{server.metrics_port}/metrics"
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
            return out, bad, health, services, text

    out, bad, health, services, text = asyncio.run(main())
    assert out.code == OK and bad.code == ORDER
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert {"harken.v1.Transcription", "grpc.health.v1.Health"} <= set(services)
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    assert samples[("harken_bytes_in_total", (("kind", "features"),))] == sum(len(p.payload) for p in packets)
    assert samples[("harken_messages_in_total", (("kind", "features"),))] == len(packets)
    assert samples[("harken_transcript_events_total", ())] == len(out.transcripts)
    assert samples[("harken_errors_total", (("code", "FAILED_PRECONDITION"),))] == 1
    assert samples[("harken_time_to_first_partial_seconds_count", ())] == 2  # one per segment
    assert samples[("harken_final_latency_seconds_count", ())] == 2
    assert samples[("harken_update_latency_seconds_count", ())] == sum(not t.is_final for t in out.transcripts)
    assert samples[("harken_batch_size_count", ())] >= 1
    assert ("harken_queue_depth", ()) in samples
    assert samples[("harken_sessions_active", ())] == 0 and samples[("harken_streams_attached", ())] == 0
    assert "Bearer" not in text and KEY_A not in text


def test_streams_cancelled_at_once_give_their_attachment_back(asr, packets):
    """Clients that drop right after Ready, 10 at a time: the attached-streams gauge comes back to
    what is really attached (the reported leak of +2 in 10 did not reproduce this way, on this
    code or before 56ee275; the next test drives the race that commit fixed)."""
    async def main():
        async with serving(asr, metrics_port=0, max_sessions=32, max_sessions_per_key=32) as server:
            msgs = [start_msg(codec=CODEC_NAME)] + features_msgs(packets[:5])
            gauge = lambda: server.metrics.registry.get_sample_value("harken_streams_attached")  # noqa: E731
            held = Outcome()
            holding = asyncio.create_task(run_stream(server.address, msgs, hold_open=asyncio.Event(), out=held))
            await held.progress.wait()
            while_one_is_attached = gauge()
            for _ in range(3):
                await asyncio.gather(*(run_stream(server.address, msgs, stop_after=lambda out: True)
                                       for _ in range(10)))
            for _ in range(100):  # the handlers' cleanup runs after the cancellations come back
                if gauge() == 1:
                    break
                await asyncio.sleep(0.05)
            after = gauge(), sum(s.attachment is not None for s in server._table.sessions.values())
            holding.cancel()
            await asyncio.gather(holding, return_exceptions=True)
            return while_one_is_attached, after

    while_one_is_attached, (gauge, really_attached) = asyncio.run(main())
    assert while_one_is_attached == 1
    assert gauge == really_attached == 1


def test_a_stream_cancelled_again_while_it_cleans_up_is_still_detached(asr, packets):
    """A dropped stream's handler waits for its reader to finish the message it is applying (held
    up here: the one decode thread is busy), and is cancelled again meanwhile. The stream must
    still be detached: before 56ee275 its session stayed attached for good (no grace period, so
    never expired) and the attached-streams gauge counted it forever. Driven through
    `TranscriptionService.Stream` directly (as the WebRTC endpoint drives it), so both
    cancellations land where they are meant to."""
    from harken.cloud.grpc_service import TranscriptionService

    class Context:
        def invocation_metadata(self):
            return ()

        async def abort(self, code, details):
            raise AssertionError(f"no error expected: {code} {details}")

    async def main():
        async with serving(asr, metrics_port=0, decode_threads=1) as server:
            service = TranscriptionService(server._table, None, server.metrics)
            incoming: asyncio.Queue = asyncio.Queue()

            async def requests():
                while True:
                    yield await incoming.get()

            stream = service.Stream(requests(), Context())
            incoming.put_nowait(start_msg(codec=CODEC_NAME).SerializeToString())
            ready = await stream.__anext__()
            session = server._table.sessions[ready.ready.session_id]
            attachment = session.attachment
            busy = threading.Event()
            server._table.executor.submit(busy.wait)  # the decode thread is taken
            incoming.put_nowait(features_msgs(packets[:1])[0].SerializeToString())
            while not session._apply_lock.locked():  # the reader is applying it (waiting to decode)
                await asyncio.sleep(0.01)
            handler = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.05)  # the handler waits for the stream's next event
            handler.cancel()  # the stream is dropped: the cleanup cancels the reader, waits for it
            while not attachment.reader.cancelling():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            handler.cancel()  # ... and is cancelled again meanwhile
            await asyncio.wait([handler])
            busy.set()
            await asyncio.wait([attachment.reader])
            gauge = server.metrics.registry.get_sample_value("harken_streams_attached")
            return session.attachment, session.detached_at, gauge

    attached, detached_at, gauge = asyncio.run(main())
    assert attached is None and detached_at is not None
    assert gauge == 0


def _scrape(port: int) -> dict:
    """The server's /metrics over HTTP: {(name, sorted labels): value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_queue_depth_is_the_work_waiting_now_not_at_the_last_step(asr, packets):
    """With the engine stalled (no step runs), a stream's frames make an update due: the scrape
    shows one session waiting for the model at once (before, the gauge was set only when a step
    began, and said 0 here). Once the engine has run and the stream ended, it is 0 again."""
    head = features_msgs(packets[:5])  # 100 frames of an open segment: an update (50 frames) is due

    async def main():
        async with serving(asr, metrics_port=0) as server:
            await server._scheduler.stop()
            before = (await asyncio.to_thread(_scrape, server.metrics_port))[("harken_queue_depth", ())]
            out = Outcome()
            hold = asyncio.Event()
            task = asyncio.create_task(run_stream(server.address, [start_msg(codec=CODEC_NAME)] + head,
                                                  hold_open=hold, then=[END], out=out))
            while not (out.acks and out.acks[-1].seq == 5):  # applied: the frames are in the engine
                out.progress.clear()
                await out.progress.wait()
            waiting = (await asyncio.to_thread(_scrape, server.metrics_port))[("harken_queue_depth", ())]
            await server._scheduler.start()
            hold.set()
            await asyncio.wait_for(task, TIMEOUT)
            after = (await asyncio.to_thread(_scrape, server.metrics_port))[("harken_queue_depth", ())]
            return before, waiting, after, out

    before, waiting, after, out = asyncio.run(main())
    assert out.code == OK, out.details
    assert (before, waiting, after) == (0, 1, 0)


def test_an_oversized_message_is_an_error_counted_like_any_other(asr, packets):
    """Messages over the server's limit (here 64 KiB), as the first message or mid-stream, end
    their streams RESOURCE_EXHAUSTED with a message saying so, and count in harken_errors_total
    (gRPC's own rejection ended the request stream silently: not counted, and a first message
    over the limit was counted INVALID_ARGUMENT as a stream without Start)."""
    limit = 64 << 10
    big = pb.ClientMessage(audio=pb.Audio(seq=1, pcm16=b"\0" * (2 * limit), sample_rate=16000))
    size = big.ByteSize()

    async def main():
        async with serving(asr, metrics_port=0, max_message_bytes=limit) as server:
            mid = await run_stream(server.address, [start_msg(codec=CODEC_NAME), big])
            first = await run_stream(server.address, [big])
            fine = await run_stream(server.address, [start_msg(codec=CODEC_NAME)] + features_msgs(packets[:5]) + [END])
            return mid, first, fine, await asyncio.to_thread(_scrape, server.metrics_port)

    mid, first, fine, samples = asyncio.run(main())
    message = f"a message of {size} bytes is larger than the server's maximum of {limit}"
    assert (mid.code, mid.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, message)
    assert (first.code, first.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, message)
    assert fine.code == OK, fine.details
    errors = {labels: v for (name, labels), v in samples.items() if name == "harken_errors_total"}
    assert errors == {(("code", "RESOURCE_EXHAUSTED"),): 2}


def test_shutdown_finalises_open_segments_and_sends_their_finals(asr, packets):
    seg1 = [i for i, p in enumerate(packets) if p.segment_id == 1]
    cut = seg1[len(seg1) // 2] // 5 * 5

    async def main():
        server = await start_server(asr, ServerOptions(port=0, policy=POLICY))
        try:
            out, more = Outcome(), asyncio.Event()
            task = asyncio.create_task(run_stream(server.address, [start_msg(codec=CODEC_NAME)]
                                                  + features_msgs(packets[:cut]), hold_open=more,
                                                  then=features_msgs(packets[cut:], first_seq=cut + 1), out=out))
            while not (out.acks and out.acks[-1].seq == cut):
                out.progress.clear()
                await out.progress.wait()
            stopping = asyncio.create_task(server.stop())
            more.set()  # a live client goes on sending while the server stops
            await stopping
            refused = await run_stream(server.address, [start_msg()])
            return await task, refused
        finally:
            await server.stop()

    out, refused = asyncio.run(main())
    assert (out.code, out.details) == (grpc.StatusCode.UNAVAILABLE,
                                       "the server is shutting down: open segments were finalised")
    finals = [t for t in out.transcripts if t.is_final]
    assert [t.segment_id for t in finals] == [0, 1]
    assert finals[1].seed.present and finals[1].seed.next_segment_id == 2
    applied = out.acks[-1].seq
    assert applied >= cut and out.acks[-1].last_final_segment == 1
    assert finals[1].end_s == pytest.approx((packets[applied - 1].first_frame + packets[applied - 1].frame_count) / 100)
    assert refused.code == grpc.StatusCode.UNAVAILABLE


def test_a_thin_segment_the_shutdown_cuts_short_gets_a_seed_without_front_end_state(asr, audio):
    """A graceful stop in the middle of a thin client's second utterance ends its segment where the
    audio stops. That final's seed has no front-end state: a replacement resumed from a quiet point
    before the segment would treat all of it as final and lose the speech after the cut; without
    one the client replays from the cut into a fresh front end. The first final's seed has one."""
    msgs = audio_msgs(audio)
    cut = 30  # 3.0 s: inside the second utterance (2.1 s to 4.5 s)

    async def main():
        server = await start_server(asr, ServerOptions(port=0, policy=POLICY))
        try:
            out = Outcome()
            task = asyncio.create_task(run_stream(server.address, [start_msg()] + msgs[:cut],
                                                  hold_open=asyncio.Event(), out=out))
            while not (out.acks and out.acks[-1].seq == cut):
                out.progress.clear()
                await out.progress.wait()
            await server.stop()
            return await task
        finally:
            await server.stop()

    out = asyncio.run(main())
    assert out.code == grpc.StatusCode.UNAVAILABLE, out.details
    finals = [t for t in out.transcripts if t.is_final]
    assert [t.segment_id for t in finals] == [0, 1] and finals[1].end_s <= cut / 10
    assert finals[0].seed.front_end_state and finals[0].seed.next_segment_id == 1
    assert finals[1].seed.present and finals[1].seed.next_segment_id == 2
    assert finals[1].seed.front_end_state == b"" and finals[1].seed.audio_sample == 0


def test_harken_serve_prints_its_addresses_and_stops_on_sigterm(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "harken", "serve", "--model", "tiny", "--idle-timeout-s", "0"],
                         capture_output=True, text=True, timeout=60)
    assert (bad.returncode, bad.stderr.strip()) == (
        2, "harken serve: error: --idle-timeout-s and --grace-s must be > 0")
    proc = subprocess.Popen([sys.executable, "-m", "harken", "serve", "--model", "tiny", "--port", "0",
                             "--metrics-port", "0", "--idle-timeout-s", "45"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        grpc_line = proc.stdout.readline().strip()
        metrics_line = proc.stdout.readline().strip()
        assert grpc_line.startswith("harken: listening on grpc://127.0.0.1:"), grpc_line
        port = int(grpc_line.rsplit(":", 1)[1])
        assert port > 0
        assert metrics_line.startswith("harken: metrics on http://127.0.0.1:") and metrics_line.endswith("/metrics")
        with urllib.request.urlopen(metrics_line.split(" on ", 1)[1], timeout=10) as r:
            assert b"harken_sessions_active" in r.read()
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        logs = [json.loads(line) for line in proc.stderr.read().splitlines()]
        assert [r["msg"] for r in logs if r["msg"].startswith("server ")] == ["server started", "server stopped"]
        assert next(r for r in logs if r["msg"] == "server started")["idle_timeout_s"] == 45
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_event_log_keeps_only_unfinished_segments_and_a_tail(asr, packets):
    """Once events are sent, those of final segments are dropped but for `replay_tail`; after the
    end, a resume still gets what it may have lost."""
    async def main():
        async with serving(asr, replay_tail=1) as server:
            out, release = Outcome(), asyncio.Event()
            task = asyncio.create_task(run_stream(server.address, [start_msg(codec=CODEC_NAME)]
                                                  + features_msgs(packets), hold_open=release, then=[END], out=out))
            while sum(t.is_final for t in out.transcripts) < 2:
                out.progress.clear()
                await out.progress.wait()
            session = server._table.sessions[out.ready.session_id]
            for _ in range(500):  # the server books a message as sent just after the client got it
                if session.core.delivered_event_seq == out.transcripts[-1].event_seq:
                    break
                await asyncio.sleep(0.01)
            held = [e.event_seq for e in session.core.events]
            # a client that claims to miss more than is held must recover as from a lost session
            too_old = await run_stream(server.address, [start_msg(session_id=out.ready.session_id,
                                                                  last_event_seq=held[0] - 2)])
            release.set()
            await task
            return out, held, too_old

    out, held, too_old = asyncio.run(main())
    assert out.code == OK
    assert held == [out.transcripts[-1].event_seq]
    assert too_old.code == grpc.StatusCode.NOT_FOUND
    assert too_old.details == f"events after {held[0] - 2} are no longer held; open a new session with the last seed"


def test_logs_are_json_without_keys_or_transcript_text(asr, packets, tmp_path):
    from harken.cloud.logs import JsonLogFormatter

    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} alice\n")
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(self.format(record))

    handler = Collect()
    handler.setFormatter(JsonLogFormatter())
    logger = logging.getLogger("harken")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        async def main():
            async with serving(asr, api_keys=str(keys)) as server:
                msgs = [start_msg(codec=CODEC_NAME)] + features_msgs(packets) + [END]
                good = await run_stream(server.address, msgs, metadata=bearer(KEY_A))
                await run_stream(server.address, msgs, metadata=bearer("wrong-key-123456"))
                return good

        good = asyncio.run(main())
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    records = [json.loads(line) for line in lines]
    assert {"server started", "session opened", "stream attached", "session ended",
            "stream ended with an error", "server stopped"} <= {r["msg"] for r in records}
    assert any(r.get("key") == "alice" for r in records)
    text = "\n".join(lines)
    assert KEY_A not in text and "wrong-key-123456" not in text and good.ready.session_id not in text
    for t in good.transcripts:
        for piece in (t.committed_delta, t.partial):
            assert len(piece) < 4 or piece not in text


def test_a_seeded_replacement_session_continues_exactly(asr, packets, reference):
    """What a client does after the server lost its session: a new session seeded with the last
    final's seed, fed the unfinished segment again, gives that segment's transcript unchanged."""
    seg1 = [p for p in packets if p.segment_id == 1]

    async def main():
        async with serving(asr) as server:
            first = await run_stream(server.address, [start_msg(codec=CODEC_NAME)]
                                     + features_msgs([p for p in packets if p.segment_id == 0]) + [END])
            seed = next(t.seed for t in first.transcripts if t.is_final)
            # a client may resend frames of a segment the seed says is final: they are ignored
            resent = [p for p in packets if p.segment_id == 0][:2]
            replacement = await run_stream(server.address, [start_msg(codec=CODEC_NAME, seed=seed)]
                                           + features_msgs(resent + seg1) + [END])
            return seed, replacement

    seed, out = asyncio.run(main())
    seg0_end = [p for p in packets if p.segment_id == 0][-1]
    assert seed.next_segment_id == 1 and seed.running_max_log10 == pytest.approx(seg0_end.running_max_log10)
    assert out.code == OK, out.details
    assert out.ready.last_final_segment == 0
    assert transcript_of(out.events) == [t for t in transcript_of(reference) if t[0] == 1]
    assert out.transcripts[-1].seed.next_segment_id == 2


def test_a_thin_clients_seeded_replacement_resumes_the_front_end(asr, audio):
    """A thin client's session to its end; then what the client does after losing it: a session
    seeded with the first final's seed, whose front-end state resumes the server's VAD and log-mel
    where they stood at a quiet point, fed the audio from the seed's `audio_sample` on (in other
    pieces): the later segment comes out with the same id, times and text. A state that does not
    parse, an `audio_sample` that is not its replay point, or audio at another rate after it is
    INVALID_ARGUMENT."""
    async def main():
        async with serving(asr) as server:
            first = await run_stream(server.address, [start_msg()] + audio_msgs(audio) + [END])
            seed = next(t.seed for t in first.transcripts if t.is_final)
            rest = audio[seed.audio_sample:]
            replacement = await run_stream(server.address, [start_msg(seed=seed)]
                                           + audio_msgs(rest, piece_s=0.37) + [END])
            bad_seeds = [pb.SessionSeed(), pb.SessionSeed()]
            for b in bad_seeds:
                b.CopyFrom(seed)
            bad_seeds[0].front_end_state = seed.front_end_state[:100] + b"!" + seed.front_end_state[101:]
            bad_seeds[1].audio_sample = seed.audio_sample + 160
            bad = [await run_stream(server.address, [start_msg(seed=b), END]) for b in bad_seeds]
            bad.append(await run_stream(server.address, [start_msg(seed=seed)] + audio_msgs(rest, rate=8000)[:1]))
            return first, seed, replacement, bad

    first, seed, out, bad = asyncio.run(main())
    print(f"\nthin replacement: replayed from sample {seed.audio_sample} ({len(seed.front_end_state)} bytes of state)")
    assert first.code == OK and out.code == OK, (first.details, out.details)
    assert seed.next_segment_id == 1 and seed.front_end_state and seed.audio_sample % 2560 == 0
    assert out.ready.last_final_segment == 0
    assert transcript_of(out.events) == [t for t in transcript_of(first.events) if t[0] == 1]
    assert [(o.code, o.details.split(":")[0]) for o in bad] == [
        (INVALID, "start.seed.front_end_state"), (INVALID, f"start.seed.audio_sample {seed.audio_sample + 160} is not "
                                                            f"where its front_end_state replays from ({seed.audio_sample})"),
        (INVALID, "start.seed.front_end_state goes on with 16 kHz audio, not 8000 Hz")]


def test_finalize_closes_the_open_segment_of_a_thin_client(asr, audio):
    """Push-to-talk: Finalize mid-utterance ends the segment at once; the rest of that VAD
    segment is dropped and the next one gets its own id."""
    msgs = audio_msgs(audio)
    half = 25  # 2.5 s: inside the second utterance

    async def main():
        async with serving(asr) as server:
            return await run_stream(server.address, [start_msg()] + msgs[:half]
                                    + [pb.ClientMessage(finalize=pb.Finalize())] + msgs[half:] + [END])

    out = asyncio.run(main())
    assert out.code == OK, out.details
    finals = [t for t in out.transcripts if t.is_final]
    assert [t.segment_id for t in finals] == [0, 1]
    assert finals[1].end_s <= half / 10


def test_an_engine_failure_ends_every_stream_unavailable_and_health_says_so(asr, packets, monkeypatch):
    """The fault (mocked): the model raises. Streams must not wait forever for events."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def broken(*args, **kwargs):
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(asr.encoder, "encode_windows", broken)

    async def main():
        async with serving(asr) as server:
            out = await run_stream(server.address, [start_msg(codec=CODEC_NAME)] + features_msgs(packets)
                                   + [END])
            async with grpc.aio.insecure_channel(server.address) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            refused = await run_stream(server.address, [start_msg()])
            return out, health, refused

    out, health, refused = asyncio.run(main())
    assert (out.code, out.details) == (grpc.StatusCode.UNAVAILABLE, "the engine failed: reconnect to another server")
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert refused.code == grpc.StatusCode.UNAVAILABLE


def test_a_session_failing_in_the_engine_gets_internal_while_the_others_carry_on(asr, packets, reference,
                                                                                 monkeypatch):
    """The fault (injected): one session's own processing raises inside the engine. Its stream
    ends INTERNAL (never hangs, whether attached then or later), its KV slot is freed, and a
    session beside it on the same server gets its full, correct transcript."""
    from harken.cloud.session import Session

    finish_job = Session.finish_job

    def fragile(self, job, tokens):
        if self.state.options.context == "fail here" and self.state.events >= 2:
            raise RuntimeError("simulated fault in one session's processing")
        return finish_job(self, job, tokens)

    monkeypatch.setattr(Session, "finish_job", fragile)

    async def main():
        async with serving(asr) as server:
            msgs = features_msgs(packets) + [END]
            bad, good = await asyncio.gather(
                run_stream(server.address, [start_msg(codec=CODEC_NAME, context="fail here")] + msgs),
                run_stream(server.address, [start_msg(codec=CODEC_NAME)] + msgs))
            engine = server.engine
            # a client that resumes the failed session is told the same, at once
            again = await run_stream(server.address, [start_msg(session_id=bad.ready.session_id,
                                                                last_event_seq=0)])
            return bad, good, again, len(engine.sessions), engine.cache.num_free(), engine.cache.max_slots

    bad, good, again, engine_sessions, free, slots = asyncio.run(main())
    assert (bad.code, bad.details) == (grpc.StatusCode.INTERNAL, "internal error")
    assert len(bad.transcripts) >= 2  # it ran, then failed before its last final:
    assert sum(t.is_final for t in bad.transcripts) < sum(e[-1] for e in reference)
    assert good.code == OK, good.details
    assert transcript_of(good.events) == transcript_of(reference)
    assert (again.code, again.details) == (grpc.StatusCode.INTERNAL, "internal error")
    assert engine_sessions == 0 and free == slots  # both sessions released, the failed one's slot too
