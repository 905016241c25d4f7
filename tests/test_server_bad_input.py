"""cloud/server: bad input of every kind gets the right status code, next to a good session.

One server (`busy_server`, on its own event loop thread for synchronous hypothesis clients) takes
every case while a well-behaved client holds a session open through the whole module; on teardown
that session must end with the reference transcript. Covered: bytes that are no ClientMessage and
first messages other than Start; every field of Start; random sequences of real, replayed,
reordered and corrupted Features against a model of the contract; bad Audio; order and size
violations with their exact messages; missing, unknown and foreign API keys; and messages over
the server's size limit, which are counted in the error metrics like any other error.
"""

from __future__ import annotations

import asyncio
import struct
import threading

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from google.protobuf.message import DecodeError

from harken.shared.codec import CODEC_NAME
from harken.proto import harken_pb2 as pb
from server_helpers import (END, INVALID, KEY_A, KEY_B, OK, ORDER, Outcome, TIMEOUT, _scrape, bearer, features_msgs,
                            run_stream, serving, start_msg, transcript_of)
from server_helpers import audio, reference  # module fixtures: pytest finds them here


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
    from harken.shared.codec import decode_frames, max_frames_for_payload
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
            # malformed in itself, wherever it comes (a duplicate or past a gap too): the server reads
            # every message before it looks at its place in the order (shared/wire.py, then admit)
            if (f.seq == 0 or not f.payload or np.isnan(f.running_max_log10)
                    or f.frame_count > max_frames_for_payload(len(f.payload))):
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


@pytest.mark.parametrize("how", ["dup", "gap"])
def test_a_payload_too_short_for_its_frames_is_invalid_even_as_a_duplicate_or_past_a_gap(busy_server, packets, how):
    """What once failed test_bad_feature_sequences (its model said a duplicate is ignored and a gap
    is FAILED_PRECONDITION whatever the message holds): a Features message whose payload is cut
    below what its frame_count needs (8 frames a byte) is malformed in itself, INVALID_ARGUMENT
    wherever it comes; a payload that only fails to decode is looked at when the message is applied,
    so as a duplicate it is ignored and past a gap it is FAILED_PRECONDITION."""
    from harken.shared.codec import max_frames_for_payload

    first = features_msgs(packets[:1])[0]
    cut = features_msgs(packets[:1], first_seq=1 if how == "dup" else 3)[0]
    assert cut.features.frame_count > max_frames_for_payload(1)
    cut.features.payload = cut.features.payload[:1]
    out = busy_server.stream([start_msg(codec=CODEC_NAME), first, cut, END])
    assert out.code == INVALID, (out.code, out.details)
    assert "is more than a payload of 1 bytes may carry" in out.details
    flipped = features_msgs(packets[:1], first_seq=1 if how == "dup" else 3)[0]
    flipped.features.payload = bytes([flipped.features.payload[0] ^ 0xFF]) + flipped.features.payload[1:]
    out = busy_server.stream([start_msg(codec=CODEC_NAME), first, flipped, _probe(1)])
    assert out.code == ORDER, (out.code, out.details)


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
