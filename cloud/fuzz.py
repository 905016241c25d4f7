"""Fuzzing the wire decoders and the served session (issue 14): inputs, targets, properties.

Used by tests/test_fuzz.py (hypothesis drives the random source, a bounded number of examples) and
by `harken bench fuzz` (cloud/bench_fuzz.py: a seeded run of any length). Every target takes what
a peer could send and returns the status code name of its outcome ("OK" when accepted); a broken
property raises `Crash`.

    codec               shared/codec.decode_frames(payload, max_frames)
    wire                cloud/wire: bytes -> ClientMessage -> the domain message -> decoded features
    datachannel_server  cloud/webrtc's data-channel framing (binary = a message, text = a control
                        frame), then every message it queued, as `wire`
    datachannel_client  edge/webrtc_transport.DataChannelCall, the same framing from the client's
                        side: text = the call's status, binary = a ServerMessage (edge/wire.py)
    session             `TranscriptionService.Stream`, the served session behind the gRPC and WebRTC
                        drivers, fed whole streams (`ServedFuzz`): Start/Features/Audio/Finalize/End
                        in any order, replays, gaps, resumes of other sessions, garbage, half-closes
                        and dropped connections

Properties:
- A decoder accepts an input, and what comes out is well formed (frames [128, k] float32, finite,
  within the codec's value limit, k as the message claims; PCM within [-1, 1)), or rejects it with a
  HarkenError that the service maps to INVALID_ARGUMENT. Another exception, another code: a crash.
- The client's side never raises on what a server sends: a status frame becomes the call's status
  (INTERNAL when malformed), a ServerMessage that does not parse fails the call with INTERNAL, as
  grpc.aio does.
- Every fuzzed stream ends (within `STREAM_DEADLINE_S`) with OK or one of `CLIENT_ERRORS` — the
  codes of DESIGN §3 for what a client can get wrong: INVALID_ARGUMENT (malformed input),
  FAILED_PRECONDITION (input in the wrong order), NOT_FOUND / PERMISSION_DENIED / ABORTED (a resume
  of a session gone, another key's, or taken over by a newer stream), RESOURCE_EXHAUSTED
  (admission) — and its last message is an Error with that same code; a stream whose first message
  is no ClientMessage gets INVALID_ARGUMENT, one whose first message is not a start
  FAILED_PRECONDITION. Never INTERNAL, UNAVAILABLE or a hang.
- (`ServedFuzz.run_reference`) a session of another key streaming beside the fuzzed ones gets the
  transcript it gets alone, and every session is gone from the table once its grace period is over.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harken.cloud import wire
from harken.cloud.server import status_of
from harken.proto import harken_pb2 as pb
from harken.shared.codec import CODEC_NAME, MAX_FRAMES, MODES, VALUE_LIMIT, PacketHeader, decode_frames, encode_frames
from harken.shared.errors import HarkenError
from harken.shared.features_spec import N_MELS, SAMPLE_RATE
from harken.shared.integrity import payload_crc32c
from harken.shared.protocol import FeaturePacket, ServerError

TARGETS = ("codec", "wire", "datachannel_server", "datachannel_client", "session")
SERVER_TARGETS = ("codec", "wire", "datachannel_server", "session")  # what a client can send
INVALID_ARGUMENT = "INVALID_ARGUMENT"
CLIENT_ERRORS = frozenset({INVALID_ARGUMENT, "FAILED_PRECONDITION", "NOT_FOUND", "PERMISSION_DENIED", "ABORTED",
                           "RESOURCE_EXHAUSTED"})
CANCELLED = "CANCELLED"  # a stream the fuzzer dropped itself (a lost connection): not the server's answer
STREAM_DEADLINE_S = 120.0  # a fuzzed stream that has not ended by then hangs
FUZZ_KEY, REFERENCE_KEY = "fuzz-key-0123456789", "reference-key-0123456789"
FUZZ_LANGUAGE = "English"  # the tiny random checkpoint writes text only with a forced language


class Crash(AssertionError):
    """A broken property: `target` got `data` and did `reason`."""

    def __init__(self, target: str, reason: str, data: Any):
        super().__init__(f"{target}: {reason} on {describe(data)}")
        self.target, self.reason, self.data = target, reason, data


def describe(data: Any, limit: int = 160) -> str:
    """A short printable form of an input, for crash reports."""
    if isinstance(data, (bytes, bytearray)):
        text = bytes(data).hex()
        return f"bytes[{len(data)}] {text[:limit]}{'...' if len(text) > limit else ''}"
    text = repr(data)
    return text[:limit] + ("..." if len(text) > limit else "")


# ---- the corpus: valid inputs to start from ------------------------------------------------------

@dataclass(frozen=True)
class FuzzCorpus:
    """Valid inputs the generators mutate: codec payloads of every kind, the edge's feature packets
    and 100 ms PCM16 pieces of the bundled sample's first seconds, and serialized ClientMessages."""

    payloads: tuple[bytes, ...]
    packets: tuple[FeaturePacket, ...]
    pcm_pieces: tuple[bytes, ...]  # 16 kHz PCM16, 100 ms each
    messages: tuple[bytes, ...]


def build_corpus(seconds: float = 4.0) -> FuzzCorpus:
    """From the bundled sample: its first `seconds` through the edge pipeline (VAD, log-mel, codec)."""
    from importlib.resources import files

    from harken.edge.audio import load_audio, peak_normalize
    from harken.edge.pipeline import FeatureStream

    audio = peak_normalize(load_audio(str(files("harken") / "data" / "sample.wav")))[:int(seconds * SAMPLE_RATE)]
    stream = FeatureStream()
    piece = SAMPLE_RATE // 10
    packets = []
    for i in range(0, audio.size, piece):
        packets += stream.push(audio[i:i + piece])
    packets += stream.flush()
    pcm = np.clip(np.round(audio * 32768), -32768, 32767).astype("<i2")
    pcm_pieces = tuple(pcm[i:i + piece].tobytes() for i in range(0, pcm.size, piece))
    frames = np.random.default_rng(0).normal(-2.0, 1.0, (N_MELS, 40)).astype(np.float32)
    payloads = [p.payload for p in packets]
    payloads += [encode_frames(frames[:, :k], mode) for mode in MODES for k in (1, 7, 40)]
    payloads += [encode_frames(frames[:, :12], "balanced", floor_log10=-1.0),
                 PacketHeader(None, 0, np.zeros(0, np.float32)).serialize(),  # keep-alive
                 PacketHeader("balanced", 72, np.full(72, -3.0, np.float32), at_floor=True).serialize()]
    messages = [pb.ClientMessage(start=pb.Start(language=FUZZ_LANGUAGE, codec=CODEC_NAME)),
                pb.ClientMessage(start=pb.Start(session_id="x" * 24, last_event_seq=3)),
                pb.ClientMessage(start=pb.Start(seed=pb.SessionSeed(present=True, running_max_log10=-1.5,
                                                                    context_tail="earlier", next_segment_id=2))),
                pb.ClientMessage(audio=pb.Audio(seq=1, pcm16=pcm_pieces[0], sample_rate=SAMPLE_RATE)),
                pb.ClientMessage(finalize=pb.Finalize()), pb.ClientMessage(end=pb.End())]
    messages += [features_message(p, seq=i + 1) for i, p in enumerate(packets[:6])]
    return FuzzCorpus(tuple(payloads), tuple(packets), pcm_pieces, tuple(m.SerializeToString() for m in messages))


def features_message(p: FeaturePacket, seq: int) -> pb.ClientMessage:
    """The edge's message for packet `p` (edge/wire.features_message: with its CRC32C)."""
    from harken.edge.wire import features_message as edge_features_message

    return edge_features_message(p, seq=seq)


# ---- random values -------------------------------------------------------------------------------

_INTERESTING_INTS = (0, 1, 2, 3, 7, 8, 9, 20, 72, 127, 128, 255, 256, 6000, 6001, 32767, 65535, 65536,
                     2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1)
_INTERESTING_FLOATS = (0.0, -0.0, 1.0, -1.0, -3.5, 99.9, 100.0, 100.5, -100.5, 1e30, -1e30, 3.4e38,
                       math.inf, -math.inf, math.nan)
_ALPHABETS = ("abcdefghijklmnopqrstuvwxyz ", "ABC-_0123456789", "éüßçñ", "中文日本語", "😀🎧", "\x00\t\n\x7f")


def random_int(rng: random.Random, bits: int) -> int:
    """An unsigned value of a `bits`-bit field: an edge case, small, or anything."""
    r = rng.random()
    if r < 0.5:
        return min(rng.choice(_INTERESTING_INTS), (1 << bits) - 1)
    if r < 0.8:
        return rng.randrange(0, 64)
    return rng.getrandbits(bits)


def random_float(rng: random.Random) -> float:
    """A value for a float32 field."""
    return rng.choice(_INTERESTING_FLOATS) if rng.random() < 0.6 else rng.uniform(-150.0, 150.0)


def random_text(rng: random.Random, max_len: int = 80) -> str:
    """Valid UTF-8 (proto strings must be): letters, digits, accents, CJK, emoji, controls."""
    n = rng.randrange(0, max_len + 1)
    alphabet = "".join(rng.sample(_ALPHABETS, rng.randrange(1, len(_ALPHABETS) + 1)))
    return "".join(rng.choice(alphabet) for _ in range(n))


def random_bytes(rng: random.Random, max_len: int = 64) -> bytes:
    return rng.randbytes(rng.randrange(0, max_len + 1))


def pick_id(rng: random.Random, session_ids: Sequence[str]) -> str:
    """One of `session_ids` (sessions the fuzzer saw), or a well-formed id no session has. Draws
    the same randomness whatever the ids: hypothesis replays an example from its draws alone."""
    x = rng.random()
    return session_ids[int(x * len(session_ids))] if session_ids else "never-issued-" + str(int(x * 1e9))


def mutate(data: bytes, rng: random.Random, others: Sequence[bytes] = ()) -> bytes:
    """1-4 byte-level mutations: bit flips, edge-case bytes, inserts, deletes, truncation,
    duplicated ranges, splices with another input."""
    out = bytearray(data)
    for _ in range(rng.randrange(1, 5)):
        op = rng.randrange(8)
        if op == 0 and out:
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
        elif op == 1 and out:
            out[rng.randrange(len(out))] = rng.choice((0x00, 0x01, 0x7F, 0x80, 0xFF, 0xA7, 0x10, 0x40))
        elif op == 2:
            i = rng.randrange(len(out) + 1)
            out[i:i] = rng.randbytes(rng.randrange(1, 9))
        elif op == 3 and out:
            i = rng.randrange(len(out))
            del out[i:i + rng.randrange(1, 9)]
        elif op == 4:
            del out[rng.randrange(len(out) + 1):]
        elif op == 5 and out:
            i = rng.randrange(len(out))
            j = min(len(out), i + rng.randrange(1, 17))
            out[j:j] = out[i:j]
        elif op == 6 and others:
            other = rng.choice(others)
            cut = rng.randrange(len(out) + 1)
            out = out[:cut] + other[rng.randrange(len(other) + 1):]
        elif op == 7 and out:  # a varint-looking run: lengths and counts that overflow
            i = rng.randrange(len(out))
            out[i:i + 1] = bytes([0xFF] * rng.randrange(1, 11) + [0x01])
    return bytes(out)


# ---- generators, one per target ------------------------------------------------------------------

def random_codec_input(rng: random.Random, corpus: FuzzCorpus) -> tuple[bytes, int]:
    """(payload, max_frames) for `check_codec`."""
    r = rng.random()
    if r < 0.15:
        payload = rng.choice(corpus.payloads)
    elif r < 0.75:
        payload = mutate(rng.choice(corpus.payloads), rng, corpus.payloads)
    elif r < 0.9:  # a valid-looking header, then anything
        payload = bytes([0xA7, 0x10 | rng.randrange(5)]) + random_bytes(rng, 40)
    else:
        payload = random_bytes(rng)
    max_frames = rng.choice((MAX_FRAMES, MAX_FRAMES, rng.randrange(0, 100)))
    return payload, max_frames


def random_client_message(rng: random.Random, corpus: FuzzCorpus, session_ids: Sequence[str] = ()) -> pb.ClientMessage:
    """A ClientMessage of any kind whose fields hold edge cases or anything (what a client written
    from the proto alone might send)."""
    kind = rng.choice(("start", "features", "features", "audio", "finalize", "end", "empty"))
    if kind == "start":
        s = pb.Start(language=rng.choice(("", FUZZ_LANGUAGE, "en", "en-US", "zh", "Klingon", random_text(rng))),
                     context=rng.choice(("", "harken", random_text(rng), "é" * rng.randrange(7990, 8010))),
                     codec=rng.choice(("", CODEC_NAME, "opus", "harken-mel/2", random_text(rng, 50))),
                     session_id=rng.choice(("", "", random_text(rng, 70), pick_id(rng, session_ids))),
                     last_event_seq=random_int(rng, 64))
        if rng.random() < 0.3:
            s.seed.CopyFrom(pb.SessionSeed(present=rng.random() < 0.8, running_max_log10=random_float(rng),
                                           context_tail=random_text(rng), next_segment_id=random_int(rng, 32)))
        return pb.ClientMessage(start=s)
    if kind == "features":
        payload = rng.choice((rng.choice(corpus.payloads), mutate(rng.choice(corpus.payloads), rng), random_bytes(rng),
                              b""))
        f = pb.Features(seq=random_int(rng, 64), segment_id=random_int(rng, 32), first_frame=random_int(rng, 64),
                        frame_count=random_int(rng, 32), segment_start=rng.random() < 0.5,
                        segment_end=rng.random() < 0.5, payload=payload)
        if rng.random() < 0.5:
            f.running_max_log10 = random_float(rng)
        if rng.random() < 0.5:
            f.payload_crc32c = payload_crc32c(payload) if rng.random() < 0.7 else rng.getrandbits(32)
        return pb.ClientMessage(features=f)
    if kind == "audio":
        pcm = rng.choice((rng.choice(corpus.pcm_pieces), random_bytes(rng, 801), b"", rng.choice(corpus.pcm_pieces)[1:]))
        rate = rng.choice((SAMPLE_RATE, 8_000, 48_000, 7_999, 192_001, random_int(rng, 32)))
        return pb.ClientMessage(audio=pb.Audio(seq=random_int(rng, 64), pcm16=pcm, sample_rate=rate))
    if kind == "finalize":
        return pb.ClientMessage(finalize=pb.Finalize())
    if kind == "end":
        return pb.ClientMessage(end=pb.End())
    return pb.ClientMessage()


def random_wire_input(rng: random.Random, corpus: FuzzCorpus) -> bytes:
    """Bytes a client could send as one message."""
    r = rng.random()
    if r < 0.35:
        return random_client_message(rng, corpus).SerializeToString()
    if r < 0.7:
        return mutate(rng.choice(corpus.messages), rng, corpus.messages)
    if r < 0.85:
        return rng.choice(corpus.messages)
    return random_bytes(rng)


def random_json_text(rng: random.Random) -> str:
    """Text frames for the data channel: control frames, statuses, JSON of every shape, not JSON."""
    r = rng.randrange(10)
    if r == 0:
        return json.dumps({"half_close": rng.choice((True, 1, "yes", None, 0, [], {}))})
    if r == 1:
        return json.dumps({"flush_audio": rng.choice((True, False, 2))})
    if r == 2:
        return json.dumps({"status": rng.choice(("OK", "INVALID_ARGUMENT", "UNAVAILABLE", "ok", "", 3, None, [1],
                                                 {"a": 1})),
                           "message": rng.choice(("", random_text(rng), 7, None, ["x"]))})
    if r == 3:  # deep nesting: the JSON parser's recursion limit
        depth = rng.choice((10, 1_000, 20_000, 60_000))
        return rng.choice(("[", '{"a":')) * depth
    if r == 4:
        return rng.choice(("1" * rng.randrange(1, 6000), "1e999", "-0", "NaN", "Infinity", "null", "true", '""', "[]"))
    if r == 5:
        return json.dumps([random_text(rng, 10) for _ in range(rng.randrange(4))])
    if r == 6:
        return random_text(rng, 200)
    if r == 7:
        return "".join(rng.choice('{}[]:,"01a ') for _ in range(rng.randrange(60)))
    if r == 8:
        return json.dumps({random_text(rng, 8): random_text(rng, 8) for _ in range(rng.randrange(4))})
    return ""


def random_datachannel_server_input(rng: random.Random, corpus: FuzzCorpus) -> bytes | str:
    return random_wire_input(rng, corpus) if rng.random() < 0.5 else random_json_text(rng)


def random_server_message(rng: random.Random) -> pb.ServerMessage:
    kind = rng.randrange(5)
    if kind == 0:
        return pb.ServerMessage(ready=pb.Ready(session_id=random_text(rng, 30), resume_after_seq=random_int(rng, 64),
                                               last_final_segment=random_int(rng, 63) * rng.choice((1, -1))))
    if kind == 1:
        t = pb.Transcript(segment_id=random_int(rng, 32), committed_delta=random_text(rng), partial=random_text(rng),
                          stability=random_float(rng), start_s=random_float(rng), end_s=random_float(rng),
                          language=random_text(rng, 12), is_final=rng.random() < 0.5, event_seq=random_int(rng, 64))
        if rng.random() < 0.3:
            t.seed.CopyFrom(pb.SessionSeed(present=rng.random() < 0.8, running_max_log10=random_float(rng),
                                           context_tail=random_text(rng), next_segment_id=random_int(rng, 32)))
        return pb.ServerMessage(transcript=t)
    if kind == 2:
        return pb.ServerMessage(ack=pb.Ack(seq=random_int(rng, 64), last_final_segment=random_int(rng, 63)))
    if kind == 3:
        code = rng.choice(("OK", "INVALID_ARGUMENT", "NOT_FOUND", "name", "value", "__class__", random_text(rng, 20)))
        return pb.ServerMessage(error=pb.Error(code=code, message=random_text(rng)))
    return pb.ServerMessage()


def random_datachannel_client_input(rng: random.Random) -> bytes | str:
    r = rng.random()
    if r < 0.3:
        return random_json_text(rng)
    message = random_server_message(rng).SerializeToString()
    if r < 0.6:
        return message
    if r < 0.9:
        return mutate(message, rng)
    return random_bytes(rng)


# ---- the decoder targets -------------------------------------------------------------------------

def _rejection(target: str, e: BaseException, data: Any) -> str:
    """A decoder's rejection must be a HarkenError the service maps to INVALID_ARGUMENT."""
    code = status_of(e).name
    if not isinstance(e, HarkenError) or code != INVALID_ARGUMENT:
        raise Crash(target, f"rejected with {type(e).__name__} -> {code}: {e}", data) from e
    return code


def _check_frames(target: str, frames: Any, count: int | None, data: Any) -> None:
    if not (isinstance(frames, np.ndarray) and frames.dtype == np.float32 and frames.ndim == 2
            and frames.shape[0] == N_MELS and (count is None or frames.shape[1] == count)):
        raise Crash(target, f"accepted, but decoded to {type(frames).__name__} "
                            f"{getattr(frames, 'shape', None)} {getattr(frames, 'dtype', None)}", data)
    if frames.size and not (np.all(np.isfinite(frames)) and float(np.abs(frames).max()) <= VALUE_LIMIT):
        raise Crash(target, "accepted, but decoded to non-finite or out-of-range values", data)


def check_codec(payload: bytes, max_frames: int = MAX_FRAMES) -> str:
    try:
        frames = decode_frames(payload, max_frames=max_frames)
    except Exception as e:
        return _rejection("codec", e, payload)
    _check_frames("codec", frames, None, payload)
    if frames.shape[1] > max_frames:
        raise Crash("codec", f"accepted {frames.shape[1]} frames, more than max_frames={max_frames}", payload)
    return "OK"


def check_wire(data: bytes, target: str = "wire") -> str:
    try:
        item = wire.parse_client_message(wire.client_message_from_bytes(data))
        if isinstance(item, wire.FeaturesIn):
            frames = wire.decode_features(item)
    except Exception as e:
        return _rejection(target, e, data)
    if isinstance(item, wire.FeaturesIn):
        _check_frames(target, frames, item.frame_count, data)
    elif isinstance(item, wire.AudioIn):
        s = item.samples
        if not (s.dtype == np.float32 and s.ndim == 1 and (s.size == 0 or float(np.abs(s).max()) <= 1.0)
                and wire.MIN_SAMPLE_RATE <= item.sample_rate <= wire.MAX_SAMPLE_RATE):
            raise Crash(target, "accepted audio out of its bounds", data)
    return "OK"


class _FakeDataChannel:
    """What the framing code uses of an aiortc RTCDataChannel: `on` (also as a decorator)."""

    readyState = "open"
    bufferedAmount = 0

    def __init__(self) -> None:
        self.handlers: dict[str, list] = {}
        self.sent: list[bytes | str] = []

    def on(self, event: str, f=None):
        def add(fn):
            self.handlers.setdefault(event, []).append(fn)
            return fn
        return add if f is None else add(f)

    def emit(self, event: str, *args) -> None:
        for fn in self.handlers.get(event, []):
            fn(*args)

    def send(self, data: bytes | str) -> None:
        self.sent.append(data)

    def close(self) -> None:
        self.readyState = "closed"


def check_datachannel_server(data: bytes | str) -> str:
    """The server's data-channel framing (cloud/webrtc.py): a binary frame is queued as it is, a
    text frame is a control frame (a half-close ends the request stream) or ignored."""
    from harken.cloud.webrtc import _Channel, _TrackFeed
    from harken.cloud.webrtc import _Requests as ChannelRequests

    channel = _FakeDataChannel()
    ch = _Channel(channel, _TrackFeed())
    try:
        channel.emit("message", data)
    except Exception as e:
        raise Crash("datachannel_server", f"the message handler raised {type(e).__name__}: {e}", data) from e
    queued = []
    while not ch.requests.queue.empty():
        queued.append(ch.requests.queue.get_nowait())
    if isinstance(data, bytes):
        if queued != [data]:
            raise Crash("datachannel_server", "a binary frame was not queued as it came", data)
        return check_wire(data, target="datachannel_server")
    if queued not in ([], [ChannelRequests._END]):  # nothing, or the half-close
        raise Crash("datachannel_server", f"a text frame queued {describe(queued)}", data)
    return "OK"


async def check_datachannel_client(data: bytes | str) -> str:
    """The client's side (edge/webrtc_transport.DataChannelCall): every frame from the server is
    read without raising: a message, the end of the call with a status, or the call failing."""
    import grpc

    from harken.edge import wire as edge_wire
    from harken.edge.transport import _status_error
    from harken.edge.webrtc_transport import DataChannelCall

    call = DataChannelCall(_FakeDataChannel(), pb.ServerMessage.FromString, pb.ClientMessage.SerializeToString)
    try:
        call._on_message(data)
        try:
            msg = await asyncio.wait_for(call.read(), 1.0)
        except grpc.aio.AioRpcError as e:
            return e.code().name
        if msg is grpc.aio.EOF:
            code = await call.code()
            if not isinstance(code, grpc.StatusCode):
                raise Crash("datachannel_client", f"status {code!r} is no grpc.StatusCode", data)
            return "OK"
        reply = edge_wire.server_message(msg)
        if isinstance(reply, ServerError) and not isinstance(_status_error(reply).code(), grpc.StatusCode):
            raise Crash("datachannel_client", f"Error code {reply.code!r} became no grpc.StatusCode", data)
    except Crash:
        raise
    except Exception as e:
        raise Crash("datachannel_client", f"raised {type(e).__name__}: {e}", data) from e
    return "OK"


# ---- the session target --------------------------------------------------------------------------

@dataclass(frozen=True)
class FuzzStream:
    """One stream: raw messages (what the client writes), then a half-close or a dropped connection."""

    messages: tuple[bytes, ...]
    drop: bool = False  # keep the request side open after the messages, then cancel the call
    drop_after_s: float = 0.0

    def first_kind(self) -> str | None:
        """The first message's kind, "garbage" when it is no ClientMessage, None when there is none."""
        if not self.messages:
            return None
        try:
            return pb.ClientMessage.FromString(self.messages[0]).WhichOneof("kind") or "empty"
        except Exception:
            return "garbage"


MAX_STREAM_MESSAGES = 12
_OPS = ("next_features", "next_audio", "duplicate", "gap", "stray_packet", "mutated_features", "mutated_bytes",
        "garbage", "empty", "finalize", "end", "start", "random_message")
_OP_WEIGHTS = (8, 2, 1, 1, 1, 2, 1, 1, 0.5, 1, 1.5, 0.5, 1)


def random_stream(rng: random.Random, corpus: FuzzCorpus, session_ids: Sequence[str] = ()) -> FuzzStream:
    """A stream that mostly goes some way into a valid session before it goes wrong, if it does."""
    r = rng.random()
    if r < 0.65:
        first = pb.ClientMessage(start=pb.Start(language=rng.choice((FUZZ_LANGUAGE, FUZZ_LANGUAGE, "", "en")),
                                                codec=rng.choice((CODEC_NAME, CODEC_NAME, ""))))
    elif r < 0.75:
        first = pb.ClientMessage(start=pb.Start(session_id=pick_id(rng, session_ids), language=FUZZ_LANGUAGE,
                                                last_event_seq=rng.choice((0, 0, 1, 5, random_int(rng, 64)))))
    elif r < 0.8:
        first = pb.ClientMessage(start=pb.Start(codec=CODEC_NAME, language=FUZZ_LANGUAGE, seed=pb.SessionSeed(
            present=True, running_max_log10=rng.choice((-2.0, 0.5, -math.inf)), context_tail=random_text(rng, 20),
            next_segment_id=rng.choice((0, 1, 3)))))
    else:
        first = random_client_message(rng, corpus, session_ids)
    messages = [first.SerializeToString()]
    if r >= 0.95:
        messages[0] = mutate(messages[0], rng)
    seq, cursor, pcm_cursor = 0, 0, 0
    for _ in range(rng.randrange(0, MAX_STREAM_MESSAGES + 1)):
        op = rng.choices(_OPS, _OP_WEIGHTS)[0]
        if op == "next_features" and cursor < len(corpus.packets):
            seq += 1
            messages.append(features_message(corpus.packets[cursor], seq).SerializeToString())
            cursor += 1
        elif op == "next_audio":
            seq += 1
            pcm = corpus.pcm_pieces[pcm_cursor % len(corpus.pcm_pieces)]
            pcm_cursor += 1
            messages.append(pb.ClientMessage(audio=pb.Audio(seq=seq, pcm16=pcm, sample_rate=SAMPLE_RATE))
                            .SerializeToString())
        elif op in ("duplicate", "gap", "stray_packet"):
            p = rng.choice(corpus.packets) if op == "stray_packet" else corpus.packets[max(0, cursor - 1)]
            s = {"duplicate": max(seq, 1), "gap": seq + rng.randrange(2, 5), "stray_packet": seq + 1}[op]
            messages.append(features_message(p, s).SerializeToString())
        elif op == "mutated_features":
            f = features_message(corpus.packets[min(cursor, len(corpus.packets) - 1)], seq + 1).features
            _mutate_features(f, rng)
            messages.append(pb.ClientMessage(features=f).SerializeToString())
        elif op == "mutated_bytes":
            messages.append(mutate(rng.choice(corpus.messages), rng, corpus.messages))
        elif op == "garbage":
            messages.append(random_bytes(rng))
        elif op == "empty":
            messages.append(b"")
        elif op == "finalize":
            messages.append(pb.ClientMessage(finalize=pb.Finalize()).SerializeToString())
        elif op == "end":
            messages.append(pb.ClientMessage(end=pb.End()).SerializeToString())
        elif op == "start":
            messages.append(pb.ClientMessage(start=pb.Start(codec=CODEC_NAME)).SerializeToString())
        elif op == "random_message":
            messages.append(random_client_message(rng, corpus, session_ids).SerializeToString())
    drop = rng.random() < 0.2
    return FuzzStream(tuple(messages), drop=drop, drop_after_s=rng.choice((0.0, 0.0, 0.01, 0.05)) if drop else 0.0)


def _mutate_features(f: pb.Features, rng: random.Random) -> None:
    """One field of a valid Features message made wrong (or right in another way)."""
    what = rng.randrange(10)
    if what == 0:
        f.frame_count = max(0, f.frame_count + rng.choice((-1, 1, 100)))
    elif what == 1:
        f.first_frame = random_int(rng, 64)
    elif what == 2:
        f.segment_id = random_int(rng, 32)
    elif what == 3:
        f.segment_start = not f.segment_start
    elif what == 4:
        f.segment_end = not f.segment_end
    elif what == 5:
        f.payload = mutate(f.payload, rng)  # its CRC32C no longer matches (mostly)
    elif what == 6:
        f.payload = mutate(f.payload, rng)
        f.payload_crc32c = payload_crc32c(f.payload)  # a corrupted payload that passes the CRC
    elif what == 7:
        f.running_max_log10 = random_float(rng)
    elif what == 8:
        f.seq = random_int(rng, 64)
    else:
        f.payload = struct.pack("<BB", 0xA7, 0x10 | rng.randrange(1, 4)) + f.payload[2:]
        f.payload_crc32c = payload_crc32c(f.payload)


@dataclass
class StreamOutcome:
    code: str  # "OK", a status code name, or CANCELLED (dropped by the fuzzer)
    messages: list = field(default_factory=list)  # ServerMessage, in order
    details: str = ""

    @property
    def session_id(self) -> str | None:
        if self.messages and self.messages[0].WhichOneof("kind") == "ready":
            return self.messages[0].ready.session_id
        return None


class _Aborted(Exception):
    pass


class _CallContext:
    """What `TranscriptionService.Stream` uses of a gRPC call: metadata and `abort`."""

    def __init__(self, key: str):
        self.metadata = (("authorization", f"Bearer {key}"),)
        self.code: str | None = None
        self.details = ""

    def invocation_metadata(self):
        return self.metadata

    async def abort(self, code, details: str = ""):
        self.code, self.details = code.name, details
        raise _Aborted(details)


class _Requests:
    """A stream's request side: the messages, then a half-close, or (`hold`) nothing until the call
    is cancelled; `pace_s` between messages."""

    def __init__(self, messages: Sequence[bytes], hold: bool = False, pace_s: float = 0.0):
        self.messages, self.hold, self.pace_s = list(messages), hold, pace_s
        self.next = 0
        self.all_read = asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        if self.next < len(self.messages):
            if self.pace_s and self.next:
                await asyncio.sleep(self.pace_s)
            self.next += 1
            return self.messages[self.next - 1]
        self.all_read.set()
        if self.hold:
            await asyncio.Event().wait()  # until the call is cancelled
        raise StopAsyncIteration


class ServedFuzz:
    """The served session under fuzzing: a `ServingCore` (the tiny model's engine and a session
    table) and the service that `harken serve` and the WebRTC endpoint drive, called in-process."""

    def __init__(self, core, service, corpus: FuzzCorpus, grace_s: float):
        self.core, self.service, self.corpus, self.grace_s = core, service, corpus, grace_s
        self.session_ids: list[str] = []  # ids from Ready messages: the fuzzer resumes them
        self.reference_id: str | None = None  # the reference session's, while it runs
        self.differences: list[dict] = []  # reference transcripts beside the fuzzing that differed

    @classmethod
    async def start(cls, asr, corpus: FuzzCorpus, grace_s: float = 0.3, max_sessions: int = 256) -> "ServedFuzz":
        from harken.cloud.auth import ApiKeys
        from harken.cloud.commit import CommitPolicy
        from harken.cloud.server import ServerOptions, TranscriptionService, start_core

        # short updates and budgets keep the tiny model quick; one policy for every session
        policy = CommitPolicy(update_interval_s=1.0, rollback_tokens=2, max_new_tokens_per_update=6, max_item_tokens=24)
        options = ServerOptions(port=0, max_sessions=max_sessions, max_sessions_per_key=max_sessions,
                                grace_s=grace_s, policy=policy)
        core = await start_core(asr, options)
        keys = ApiKeys.parse(f"{FUZZ_KEY} fuzz\n{REFERENCE_KEY} reference\n")
        return cls(core, TranscriptionService(core.table, keys, core.metrics), corpus, grace_s)

    async def close(self) -> None:
        await self.core.close(grace_s=2.0)

    async def run(self, stream: FuzzStream, key: str = FUZZ_KEY, pace_s: float = 0.0,
                  deadline_s: float = STREAM_DEADLINE_S) -> StreamOutcome:
        """Drive one stream through the service; its outcome (no property checked here)."""
        context = _CallContext(key)
        requests = _Requests(stream.messages, hold=stream.drop, pace_s=pace_s)
        out = StreamOutcome(code="")

        async def call() -> None:
            try:
                async for message in self.service.Stream(requests, context):
                    out.messages.append(message)
                out.code = "OK"
            except _Aborted:
                assert context.code is not None  # abort() set it
                out.code, out.details = context.code, context.details

        task = asyncio.get_running_loop().create_task(call())
        if stream.drop:
            read = asyncio.ensure_future(requests.all_read.wait())
            await asyncio.wait([task, read], return_when=asyncio.FIRST_COMPLETED, timeout=deadline_s)
            read.cancel()
            if not task.done():
                await asyncio.sleep(stream.drop_after_s)
                if not task.done():
                    task.cancel()  # the connection dropped: the session waits for a resume
                    out.code = CANCELLED
        done, _ = await asyncio.wait([task], timeout=deadline_s)
        if not done:
            task.cancel()
            await asyncio.wait([task])
            out.code = "HANG"
        elif not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            out.code, out.details = "RAISED", f"{type(exc).__name__}: {exc}"
        if out.session_id and key == FUZZ_KEY:
            self.session_ids = (self.session_ids + [out.session_id])[-32:]
        return out

    async def check(self, stream: FuzzStream) -> str:
        """Run one fuzzed stream and check its properties; the outcome's code."""
        out = await self.run(stream)
        if out.code == "HANG":
            raise Crash("session", f"the stream did not end within {STREAM_DEADLINE_S:.0f} s", stream)
        if out.code == "RAISED":
            raise Crash("session", f"the service raised {out.details}", stream)
        if out.code not in CLIENT_ERRORS | {"OK", CANCELLED}:
            raise Crash("session", f"ended {out.code}: {out.details}", stream)
        if out.code in CLIENT_ERRORS:
            last = out.messages[-1] if out.messages else None
            if last is None or last.WhichOneof("kind") != "error" or last.error.code != out.code:
                raise Crash("session", f"ended {out.code} without an Error message carrying it", stream)
        first = stream.first_kind()
        if first in ("garbage", "empty", "features", "audio", "finalize", "end") and out.code != CANCELLED:
            expected = INVALID_ARGUMENT if first == "garbage" else "FAILED_PRECONDITION"
            if out.code != expected:
                raise Crash("session", f"a first message of kind {first} ended {out.code}, not {expected}", stream)
        return out.code

    def resumable_ids(self) -> list[str]:
        """Session ids for the generator's resumes: fuzzed sessions, and the reference session
        while it runs (another key's: PERMISSION_DENIED)."""
        return self.session_ids + ([self.reference_id] if self.reference_id else [])

    def reference_stream(self) -> FuzzStream:
        """A well-behaved client of another key: the corpus's packets, then End."""
        start = pb.ClientMessage(start=pb.Start(language=FUZZ_LANGUAGE, codec=CODEC_NAME))
        features = [features_message(p, i + 1) for i, p in enumerate(self.corpus.packets)]
        return FuzzStream(tuple(m.SerializeToString() for m in [start, *features, pb.ClientMessage(end=pb.End())]))

    async def run_reference(self, pace_s: float = 0.0) -> list[tuple]:
        """One reference stream (its id is offered to the fuzzer while it runs: resuming it must be
        PERMISSION_DENIED); its transcript (`transcript_of`). Raises Crash unless it ends OK."""
        stream = self.reference_stream()
        task = asyncio.ensure_future(self.run(stream, key=REFERENCE_KEY, pace_s=pace_s))
        while not task.done() and self.reference_id is None:
            await asyncio.sleep(0.005)
            for sid in self._reference_ids():
                self.reference_id = sid
        out = await task
        self.reference_id = None
        if out.code != "OK":
            raise Crash("session", f"the reference session ended {out.code}: {out.details}", "reference stream")
        return transcript_of(out.messages)

    async def reference_runs(self, alone: list[tuple], stop: asyncio.Event, pace_s: float = 0.02) -> tuple[int, int]:
        """Reference streams back to back until `stop` is set: (runs, runs whose transcript was
        not `alone`, the transcript alone). The first few differences are kept in `differences`."""
        runs = affected = 0
        while not stop.is_set():
            try:
                got: Any = await self.run_reference(pace_s)
            except Crash as e:
                got = e.reason
            runs += 1
            if got != alone:
                affected += 1
                if len(self.differences) < 5:
                    self.differences.append({"alone": alone, "beside": got})
        return runs, affected

    def _reference_ids(self) -> list[str]:
        return [sid for sid, s in self.core.table.sessions.items() if s.key_id == "reference"]

    async def leaked_sessions(self) -> int:
        """Sessions still in the table once every stream has ended and the grace period is over."""
        await asyncio.sleep(self.grace_s + 1.2)  # the reaper looks every min(1 s, grace / 4)
        return len(self.core.table.sessions)


def transcript_of(messages: Sequence) -> list[tuple]:
    """Per segment: (segment id, all its committed text, start_s, end_s, language) of its final —
    what does not depend on arrival timing (the engine commits at fixed audio-time boundaries;
    partial events may differ with the timing)."""
    text: dict[int, str] = {}
    finals = []
    for m in messages:
        if m.WhichOneof("kind") != "transcript":
            continue
        t = m.transcript
        text[t.segment_id] = text.get(t.segment_id, "") + t.committed_delta
        if t.is_final:
            finals.append((t.segment_id, t.start_s, t.end_s, t.language))
    return [(seg, text.get(seg, ""), start_s, end_s, language) for seg, start_s, end_s, language in finals]
