"""Fuzzing the wire decoders and the served session (issue 14): the targets and their properties.

Used by tests/test_fuzz.py (hypothesis drives the random source, a bounded number of examples) and
by `harken bench fuzz` (lab/bench/fuzz.py: a seeded run of any length); the inputs come from
lab/bench/fuzz_inputs.py. Every target takes what a peer could send and returns the status code name
of its outcome ("OK" when accepted); a broken property raises `Crash`.

    codec               shared/codec.decode_frames(payload, max_frames)
    wire                shared/wire: bytes -> ClientMessage -> the domain message -> decoded features
    datachannel_server  cloud/webrtc's data-channel framing (binary = a message, text = a control
                        frame), then every message it queued, as `wire`
    datachannel_client  edge/webrtc_transport.DataChannelCall, the same framing from the client's
                        side: text = the call's status, binary = a ServerMessage (shared/wire.py)
    session             `StreamHandler.run_proto` (cloud/hosting/stream_handler.py), the served session
                        behind every transport, fed whole streams (`ServedFuzz`): Start/Features/Audio/Finalize/End
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
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harken.cloud.hosting.audio_front_end import check_seeded_front_end

from harken.shared import wire
from harken.bench.fuzz_inputs import FUZZ_LANGUAGE, FuzzCorpus, FuzzStream, features_message
from harken.cloud.hosting.stream_handler import StreamFailed, status_name
from harken.proto import harken_pb2 as pb
from harken.shared.codec import CODEC_NAME, MAX_FRAMES, VALUE_LIMIT, decode_frames
from harken.shared.errors import HarkenError
from harken.shared.features_spec import N_MELS
from harken.shared.protocol import Audio, Features, ServerError

TARGETS = ("codec", "wire", "datachannel_server", "datachannel_client", "session")
SERVER_TARGETS = ("codec", "wire", "datachannel_server", "session")  # what a client can send
INVALID_ARGUMENT = "INVALID_ARGUMENT"
CLIENT_ERRORS = frozenset({INVALID_ARGUMENT, "FAILED_PRECONDITION", "NOT_FOUND", "PERMISSION_DENIED", "ABORTED",
                           "RESOURCE_EXHAUSTED"})
CANCELLED = "CANCELLED"  # a stream the fuzzer dropped itself (a lost connection): not the server's answer
STREAM_DEADLINE_S = 120.0  # a fuzzed stream that has not ended by then hangs
FUZZ_KEY, REFERENCE_KEY = "fuzz-key-0123456789", "reference-key-0123456789"


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


# ---- the decoder targets -------------------------------------------------------------------------

def _rejection(target: str, e: BaseException, data: Any) -> str:
    """A decoder's rejection must be a HarkenError the service maps to INVALID_ARGUMENT."""
    code = status_name(e)
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
        item = wire.client_message_from_proto(wire.client_message_from_bytes(data), front_end=check_seeded_front_end)
        if isinstance(item, Features):
            frames = wire.decode_features(item.packet)
    except Exception as e:
        return _rejection(target, e, data)
    if isinstance(item, Features):
        _check_frames(target, frames, item.packet.frame_count, data)
    elif isinstance(item, Audio):
        s = item.samples()
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
    """The server's data-channel framing (cloud/adapters/webrtc.py): a binary frame is queued as it is, a
    text frame is a control frame (a half-close ends the request stream) or ignored."""
    from harken.cloud.hosting.stream_handler import RequestQueue
    from harken.cloud.adapters.webrtc import _Channel, _TrackFeed

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
    if queued not in ([], [RequestQueue._END]):  # nothing, or the half-close
        raise Crash("datachannel_server", f"a text frame queued {describe(queued)}", data)
    return "OK"


async def check_datachannel_client(data: bytes | str) -> str:
    """The client's side (edge/webrtc_transport.DataChannelCall): every frame from the server is
    read without raising anything but the call's own end: a message, the end of the call with a
    status (a status frame, taken whatever its code: "OK"), or the call failing (its code)."""
    from harken.edge.client.call import EOF, STATUS_NAMES, CallFailed, status_error
    from harken.edge.client.webrtc_client import DataChannelCall

    call = DataChannelCall(_FakeDataChannel())
    try:
        call._on_message(data)
        try:
            reply = await asyncio.wait_for(call.read(), 1.0)
        except CallFailed as e:
            if e.code not in STATUS_NAMES:
                raise Crash("datachannel_client", f"status {e.code!r} is no status code", data)
            return "OK" if isinstance(data, str) else e.code
        if reply is EOF:
            return "OK"
        if isinstance(reply, ServerError) and status_error(reply).code not in STATUS_NAMES:
            raise Crash("datachannel_client", f"Error code {reply.code!r} became no status code", data)
    except Crash:
        raise
    except Exception as e:
        raise Crash("datachannel_client", f"raised {type(e).__name__}: {e}", data) from e
    return "OK"


# ---- the session target --------------------------------------------------------------------------

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


class _Script:
    """A fuzzed stream's request side: the messages, then a half-close, or (`hold`) nothing until
    the stream is cancelled; `pace_s` between messages."""

    def __init__(self, messages: Sequence[bytes], hold: bool = False, pace_s: float = 0.0):
        self.messages, self.hold, self.pace_s = list(messages), hold, pace_s
        self.next = 0
        self.all_read = asyncio.Event()

    def __aiter__(self) -> "_Script":
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
    table) and the stream handler that every transport runs, called in-process."""

    def __init__(self, core, handler, corpus: FuzzCorpus, grace_s: float):
        self.core, self.handler, self.corpus, self.grace_s = core, handler, corpus, grace_s
        self.session_ids: list[str] = []  # ids from Ready messages: the fuzzer resumes them
        self.reference_id: str | None = None  # the reference session's, while it runs
        self.differences: list[dict] = []  # reference transcripts beside the fuzzing that differed

    @classmethod
    async def start(cls, asr, corpus: FuzzCorpus, grace_s: float = 0.3, max_sessions: int = 256) -> "ServedFuzz":
        from harken.cloud.base.auth import ApiKeys
        from harken.cloud.inference.commit import CommitPolicy
        from harken.cloud.server import ServerOptions, start_core
        from harken.cloud.hosting.stream_handler import StreamHandler

        # short updates and budgets keep the tiny model quick; one policy for every session
        policy = CommitPolicy(update_interval_s=1.0, rollback_tokens=2, max_new_tokens_per_update=6, max_item_tokens=24)
        options = ServerOptions(port=0, max_sessions=max_sessions, max_sessions_per_key=max_sessions,
                                grace_s=grace_s, policy=policy)
        core = await start_core(asr, options)
        keys = ApiKeys.parse(f"{FUZZ_KEY} fuzz\n{REFERENCE_KEY} reference\n")
        return cls(core, StreamHandler(core.table, keys, core.metrics), corpus, grace_s)

    async def close(self) -> None:
        await self.core.close(grace_s=2.0)

    async def run(self, stream: FuzzStream, key: str = FUZZ_KEY, pace_s: float = 0.0,
                  deadline_s: float = STREAM_DEADLINE_S) -> StreamOutcome:
        """Drive one stream through the handler; its outcome (no property checked here)."""
        metadata = (("authorization", f"Bearer {key}"),)
        requests = _Script(stream.messages, hold=stream.drop, pace_s=pace_s)
        out = StreamOutcome(code="")

        async def call() -> None:
            try:
                async with aclosing(self.handler.run_proto(metadata, requests)) as messages:
                    async for message in messages:
                        out.messages.append(message)
                out.code = "OK"
            except StreamFailed as e:
                out.code, out.details = e.code, e.message

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
