"""`harken bench overload`: twice the admitted sessions, and clients that try to push others out.

Three runs, each on a fresh in-process server (cloud/server.py, `model`, tiny by default) with an
API key per client, each `seconds` of audio per user; users are SDK clients (`TranscriptionClient`)
streaming the bundled sample like a microphone, as in `harken bench load` (bench/load.py):

  alone      the server admits M sessions (`--max-sessions M`); M users stream.
  overload   the same server; while M users stream, M more users each try to open a stream again
             and again (a fresh connection per try, every `knock_interval_s`): 2M in all. Knocking
             starts once the M hold their sessions and stops when the first of them ends.
  attacked   the server admits M + P (`--max-sessions-per-key P`: the attacker key's share). Before
             the users come, an attacker key sends a Features payload claiming more frames than its
             bytes may carry; then opens a flooding stream (Features of 72 frames in 9 bytes, the
             most audio per byte the wire accepts, as fast as the server reads: at most
             `FLOOD_AHEAD` messages past what it applied) and an idle stream (Start, then nothing),
             and tries more sessions than its share. Then M users stream and M more knock, as in
             `overload`.

Figures (times in ms):
  <run>.p50_update_ms / p95_update_ms   the admitted users' update latency (bench load's definition:
                      arrival minus when the audio the event covers had been handed to the client)
  <run>.errors        admitted users whose stream failed, by code; `pushed_out` sums them over the
                      overload and attacked runs (users refused or failed while others knocked or attacked)
  p95_ratio_overload / p95_ratio_attacked   the run's p95 over alone's
  rejections          the knocking users' tries: codes, and the time from opening a connection to
                      the refusal arriving (p50/p95/max), both runs; `rejection_goal_ms` 100
  attacker            the over-claiming payload's code and time; the flood: messages written (into
                      gRPC's buffers), frames the server applied, the most frames its session ever had
                      queued (the server stops reading a session past `max_queued_frames_per_session`);
                      whether the flood and idle streams were admitted and still held when the users
                      were done; the attacker's tries past its share, by code
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from harken.bench.load import PIECE_MS, StreamRecord, paced, percentiles, sample_audio, tiled
from harken.shared.errors import HarkenError
from harken.shared.features_spec import SAMPLE_RATE

REJECTION_GOAL_MS = 100.0
FLOOD_FRAMES = 72  # frames per flooding message: 9 bytes, the most the wire accepts (8 frames per byte)
# The flood writes at most this many messages past what the server has applied: 18,432 frames, 3x
# the server's per-session limit, so the server never waits for it. It runs in this process; unbounded
# it spent the process's CPU filling gRPC's buffers (120,000 messages in 20 s, 300 of them read),
# which a real attacker spends on its own machine.
FLOOD_AHEAD = 256
ATTACKER_EXTRA_TRIES = 3


@dataclass(frozen=True)
class OverloadBenchOptions:
    sessions: int = 4  # M: users admitted
    seconds: float = 20.0  # audio per user
    attacker_share: int = 2  # P: the per-key limit, which the attacker key fills (flood + idle)
    knock_interval_s: float = 0.25  # between one knocking user's tries
    model: str = "tiny"
    language: str = "English"  # the tiny checkpoint's random weights write text only when forced
    max_audio_speed: float = 4.0  # the servers' pace of a live stream (harken serve's flags)
    audio_burst_s: float = 30.0
    rounds: int = 1  # alone, overload, attacked, then again: p95s pooled over the rounds

    def __post_init__(self):
        if (self.sessions < 1 or self.seconds <= 0 or self.attacker_share < 2 or self.knock_interval_s < 0
                or self.rounds < 1):
            raise HarkenError("--sessions >= 1, --seconds > 0, --attacker-share >= 2 (flood and idle), "
                              "--knock-interval-s >= 0, --rounds >= 1")


@dataclass
class Keys:
    """One key per user (M admitted + M knocking) and the attacker's, in a keys file."""

    path: str
    users: list[str]
    attacker: str

    @classmethod
    def write(cls, folder: Path, users: int) -> "Keys":
        keys = [f"user-key-{i:04d}-0123456789" for i in range(users)]
        attacker = "attacker-key-0123456789"
        path = folder / "keys"
        path.write_text("".join(f"{k} user{i}\n" for i, k in enumerate(keys)) + f"{attacker} attacker\n")
        return cls(str(path), keys, attacker)


@dataclass
class Knocks:
    codes: dict[str, int] = field(default_factory=dict)
    ms: list[float] = field(default_factory=list)

    def add(self, code: str, ms: float) -> None:
        self.codes[code] = self.codes.get(code, 0) + 1
        self.ms.append(ms)

    def summary(self) -> dict:
        p = percentiles(self.ms)
        return {"tries": len(self.ms), "codes": dict(sorted(self.codes.items())), "p50_ms": p["p50"],
                "p95_ms": p["p95"], "max_ms": round(max(self.ms), 1) if self.ms else None}


def _bearer(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


def _start(language: str):
    from harken.proto import harken_pb2 as pb
    from harken.shared.codec import CODEC_NAME

    return pb.ClientMessage(start=pb.Start(language=language, codec=CODEC_NAME))


async def knock(target: str, key: str, language: str) -> tuple[str, float]:
    """One try to open a stream, from a new connection: (the code of the first answer — "ADMITTED"
    for a Ready — and the ms from opening the connection to that answer)."""
    import grpc

    from harken.proto import harken_pb2_grpc

    t0 = time.monotonic()
    async with grpc.aio.insecure_channel(target) as channel:
        call = harken_pb2_grpc.TranscriptionStub(channel).Stream(metadata=_bearer(key), timeout=30)
        try:
            await call.write(_start(language))
            await call.done_writing()
            first = await call.read()
            ms = 1000 * (time.monotonic() - t0)
            if first is grpc.aio.EOF:
                return (await call.code()).name, ms
            kind = first.WhichOneof("kind")
            return (first.error.code if kind == "error" else "ADMITTED" if kind == "ready" else kind or "EMPTY"), ms
        except grpc.aio.AioRpcError as e:
            return e.code().name, 1000 * (time.monotonic() - t0)
        finally:
            call.cancel()


async def knocking(target: str, keys: list[str], options: OverloadBenchOptions, stop: asyncio.Event,
                   knocks: Knocks) -> None:
    async def one(key: str) -> None:
        while not stop.is_set():
            knocks.add(*await knock(target, key, options.language))
            try:
                await asyncio.wait_for(stop.wait(), options.knock_interval_s)
            except TimeoutError:
                pass

    await asyncio.gather(*(one(k) for k in keys))


async def run_users(target: str, keys: list[str], options: OverloadBenchOptions, sample: np.ndarray,
                    first_done: asyncio.Event) -> dict:
    """M users streaming at once (bench/load.py's clients); their latency and errors.
    `first_done` is set when the first of them ends (its session then frees its slot)."""
    from harken.edge.transport import ClientOptions, TranscriptionClient

    piece_samples = SAMPLE_RATE * PIECE_MS // 1000
    records = [StreamRecord(piece_samples) for _ in keys]
    period_s = sample.size / SAMPLE_RATE
    n = len(keys)
    t0 = time.monotonic()

    async def one(i: int) -> None:
        client = TranscriptionClient(target, api_key=keys[i], options=ClientOptions(language=options.language))
        audio = tiled(sample, options.seconds, offset_s=round(i * period_s / n, 1))
        record = records[i]
        try:
            async with aclosing(client.stream(paced(audio, t0, record))) as events:
                async for event in events:
                    record.observe(event, time.monotonic())
            record.done_at = time.monotonic()
        except Exception as e:  # the user's stream failed: its code (a ServerRejectedError's) or its type
            record.error = getattr(e, "code", None) or type(e).__name__
        finally:
            first_done.set()

    await asyncio.gather(*(one(i) for i in range(n)))
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    update = percentiles([ms for r in records for ms in r.update_ms])
    return {"p50_update_ms": update["p50"], "p95_update_ms": update["p95"], "errors": errors,
            "_update_ms": [ms for r in records for ms in r.update_ms],  # pooled over rounds, then dropped
            "events": sum(r.events for r in records), "segments": sum(r.finals for r in records),
            "max_send_lag_ms": round(1000 * max(r.max_lag_s for r in records), 1),
            "wall_s": round(time.monotonic() - t0, 2)}


class Attacker:
    """The attacker key's clients: an over-claiming payload, a flood, an idle stream, extra tries."""

    def __init__(self, target: str, key: str, language: str, server):
        self.target, self.key, self.language, self.server = target, key, language, server
        self.stop = asyncio.Event()
        self.result: dict = {"flood_messages_written": 0, "flood_frames_applied": 0, "flood_max_queued_frames": 0}
        self.tasks: list[asyncio.Task] = []

    async def over_claim(self) -> None:
        """A 10-byte payload claiming 6000 frames (a minute of audio)."""
        import grpc

        from harken.proto import harken_pb2 as pb
        from harken.proto import harken_pb2_grpc
        from harken.shared.codec import PacketHeader
        from harken.shared.integrity import payload_crc32c

        payload = PacketHeader("balanced", 6000, np.full(6000, -3.0, np.float32), at_floor=True).serialize()
        features = pb.ClientMessage(features=pb.Features(seq=1, segment_id=0, first_frame=0, frame_count=6000,
                                                         segment_start=True, payload=payload,
                                                         payload_crc32c=payload_crc32c(payload)))
        t0 = time.monotonic()
        code = "OK"
        async with grpc.aio.insecure_channel(self.target) as channel:
            call = harken_pb2_grpc.TranscriptionStub(channel).Stream(
                iter([_start(self.language), features]), metadata=_bearer(self.key), timeout=30)
            try:
                async for msg in call:
                    if msg.WhichOneof("kind") == "error":
                        code = msg.error.code
                        break
            except grpc.aio.AioRpcError as e:
                code = e.code().name
            finally:
                call.cancel()
        self.result["over_claim_code"] = code
        self.result["over_claim_payload_bytes"] = len(payload)
        self.result["over_claim_ms"] = round(1000 * (time.monotonic() - t0), 1)

    async def hold(self, name: str, requests) -> None:
        """A stream held open until `stop`; its state then ("held" while it still runs)."""
        import grpc

        from harken.proto import harken_pb2_grpc

        async with grpc.aio.insecure_channel(self.target) as channel:
            call = harken_pb2_grpc.TranscriptionStub(channel).Stream(requests, metadata=_bearer(self.key))
            admitted = asyncio.Event()

            async def read() -> str:
                try:
                    async for msg in call:
                        if msg.WhichOneof("kind") == "ready":
                            admitted.set()
                    return "OK"
                except grpc.aio.AioRpcError as e:
                    return e.code().name

            reader = asyncio.ensure_future(read())
            waiting = asyncio.ensure_future(admitted.wait())
            await asyncio.wait([reader, waiting], return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            self.result[f"{name}_admitted"] = admitted.is_set()
            stopping = asyncio.ensure_future(self.stop.wait())
            await asyncio.wait([reader, stopping], return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            self.result[f"{name}_state"] = reader.result() if reader.done() else "held"
            call.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def flood_requests(self):
        from harken.proto import harken_pb2 as pb
        from harken.shared.codec import PacketHeader
        from harken.shared.integrity import payload_crc32c

        payload = PacketHeader("balanced", FLOOD_FRAMES, np.full(FLOOD_FRAMES, -3.0, np.float32),
                               at_floor=True).serialize()
        crc = payload_crc32c(payload)
        yield _start(self.language)
        seq = 0
        while not self.stop.is_set():
            if seq >= self._flood_applied() + FLOOD_AHEAD:
                await asyncio.sleep(0.005)
                continue
            seq += 1
            yield pb.ClientMessage(features=pb.Features(
                seq=seq, segment_id=0, first_frame=(seq - 1) * FLOOD_FRAMES, frame_count=FLOOD_FRAMES,
                segment_start=seq == 1, payload=payload, running_max_log10=5.0,  # floor -3 = max - 8
                payload_crc32c=crc))
            self.result["flood_messages_written"] = seq  # into gRPC's buffers; the server reads them later

    def _flood_applied(self) -> int:
        """The highest seq the server applied of the attacker's sessions (the idle one applies none)."""
        return max((s.applied_seq for s in self.server._table.sessions.values() if s.key_id == "attacker"),
                   default=0)

    async def idle_requests(self):
        yield _start(self.language)
        await self.stop.wait()

    async def watch_queue(self) -> None:
        while not self.stop.is_set():
            mine = [s for s in self.server._table.sessions.values() if s.key_id == "attacker"]
            r = self.result
            r["flood_max_queued_frames"] = max([r["flood_max_queued_frames"], *(s.queued_frames() for s in mine)])
            r["flood_frames_applied"] = max([r["flood_frames_applied"], *(s.applied_seq * FLOOD_FRAMES for s in mine)])
            await asyncio.sleep(0.1)

    async def start(self) -> None:
        await self.over_claim()
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self.hold("flood", self.flood_requests())),
                      loop.create_task(self.hold("idle", self.idle_requests())),
                      loop.create_task(self.watch_queue())]
        while "flood_admitted" not in self.result or "idle_admitted" not in self.result:
            await asyncio.sleep(0.01)
        extra = Knocks()
        for _ in range(ATTACKER_EXTRA_TRIES):
            extra.add(*await knock(self.target, self.key, self.language))
        self.result["extra_tries"] = extra.codes

    async def finish(self) -> dict:
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        return self.result


async def run(options: OverloadBenchOptions, asr, kind: str, keys: Keys, sample: np.ndarray) -> dict:
    """One run (`kind`: alone, overload or attacked) on a fresh server."""
    from harken.cloud.server import ServerOptions, start_server

    m, p = options.sessions, options.attacker_share
    server = await start_server(asr, ServerOptions(
        host="127.0.0.1", port=0, api_keys=keys.path, max_sessions=m + (p if kind == "attacked" else 0),
        max_sessions_per_key=p, shutdown_grace_s=2.0, max_audio_speed=options.max_audio_speed,
        audio_burst_s=options.audio_burst_s))
    target = server.address
    out: dict = {}
    try:
        attacker = Attacker(target, keys.attacker, options.language, server) if kind == "attacked" else None
        if attacker is not None:
            await attacker.start()
        stop = asyncio.Event()  # a user has ended: its slot is free, knocking stops
        users = asyncio.ensure_future(run_users(target, keys.users[:m], options, sample, stop))
        knocks = Knocks()
        knockers = None
        if kind != "alone":
            # the knockers come once every user holds its session
            while not users.done() and sum(1 for s in server._table.sessions.values()
                                           if s.key_id.startswith("user")) < m:
                await asyncio.sleep(0.01)
            knockers = asyncio.ensure_future(knocking(target, keys.users[m:2 * m], options, stop, knocks))
        out = await users
        if knockers is not None:
            await knockers
            out["rejections"] = knocks.summary()
            out["_knocks"] = knocks  # for the summary over both runs
        if attacker is not None:
            out["attacker"] = await attacker.finish()
        # ticks in which a ready session ahead of real time (the flood) waited for live ones
        out["passes_deferred"] = server.engine.deferrals
    finally:
        await server.stop(grace_s=2.0)
    return out


def _pooled(results: list[dict]) -> dict:
    """One kind's runs as one: latencies pooled, counts summed, the attacker's figures those of the
    last round (each round's flood is in `rounds`)."""
    if len(results) == 1:
        out = dict(results[0])
        out.pop("_update_ms")
        return out
    update = percentiles([ms for r in results for ms in r["_update_ms"]])
    errors: dict[str, int] = {}
    for r in results:
        for code, n in r["errors"].items():
            errors[code] = errors.get(code, 0) + n
    out = {"p50_update_ms": update["p50"], "p95_update_ms": update["p95"], "errors": errors,
           "events": sum(r["events"] for r in results), "segments": sum(r["segments"] for r in results),
           "max_send_lag_ms": max(r["max_send_lag_ms"] for r in results),
           "wall_s": round(sum(r["wall_s"] for r in results), 2),
           "passes_deferred": sum(r["passes_deferred"] for r in results)}
    if "_knocks" in results[0]:
        knocks = Knocks()
        for r in results:
            for code, n in r["_knocks"].codes.items():
                knocks.codes[code] = knocks.codes.get(code, 0) + n
            knocks.ms += r["_knocks"].ms
        out["rejections"], out["_knocks"] = knocks.summary(), knocks
    if "attacker" in results[0]:
        out["attacker"] = results[-1]["attacker"]
    return out


async def bench_overload(options: OverloadBenchOptions, asr) -> dict:
    t0 = time.monotonic()
    sample = sample_audio()
    with tempfile.TemporaryDirectory() as folder:
        keys = Keys.write(Path(folder), 2 * options.sessions)
        rounds: list[dict] = []
        for _ in range(options.rounds):  # interleaved: a neighbour's load falls on every kind alike
            rounds.append({kind: await run(options, asr, kind, keys, sample)
                           for kind in ("alone", "overload", "attacked")})
    runs = {kind: _pooled([r[kind] for r in rounds]) for kind in ("alone", "overload", "attacked")}
    alone_p95 = runs["alone"]["p95_update_ms"]

    def ratio(kind: str) -> float | None:
        p95 = runs[kind]["p95_update_ms"]
        return round(p95 / alone_p95, 2) if p95 is not None and alone_p95 else None

    rejections = Knocks()
    for kind in ("overload", "attacked"):
        knocks = runs[kind].pop("_knocks")
        for code, n in knocks.codes.items():
            rejections.codes[code] = rejections.codes.get(code, 0) + n
        rejections.ms += knocks.ms
    return {
        "sessions": options.sessions,
        "seconds": options.seconds,
        "attacker_share": options.attacker_share,
        "alone": runs["alone"],
        "overload": runs["overload"],
        "attacked": {k: v for k, v in runs["attacked"].items() if k != "attacker"},
        "p95_ratio_overload": ratio("overload"),
        "p95_ratio_attacked": ratio("attacked"),
        "rounds": [{**{f"p95_{k}_ms": r[k]["p95_update_ms"] for k in r},
                    "flood_frames_applied": r["attacked"]["attacker"]["flood_frames_applied"],
                    "passes_deferred": r["attacked"]["passes_deferred"]} for r in rounds],
        "pushed_out": sum(sum(runs[k]["errors"].values()) for k in ("overload", "attacked")),
        "rejections": rejections.summary(),
        "attacker": runs["attacked"]["attacker"],
        "rejection_goal_ms": REJECTION_GOAL_MS,
        "model": options.model,
        "max_audio_speed": options.max_audio_speed,
        "audio_burst_s": options.audio_burst_s,
        "wall_s": round(time.monotonic() - t0, 1),
    }


def bench_overload_command(options: OverloadBenchOptions) -> int:
    import torch

    from harken.cloud.model.asr import Qwen3ASR

    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    asr = Qwen3ASR.load(options.model)
    print(json.dumps(asyncio.run(bench_overload(options, asr)), indent=1))
    return 0
