"""`harken bench overload`'s clients from outside: the knocking users and the attacker key, in a
process of their own (lab/bench/overload.py starts it; the server and the admitted users stay in the
benchmark's process, where their latency is measured).

In a real deployment those clients run on other machines: the CPU they spend making connections
and writing messages is theirs, not the server's. Run inside the server's process they took its
event loop and GIL (the knockers alone raised the users' p95 by up to 3.5x on the 2-core machine
with nothing to do with the server's work). In their own process, at a lower priority
(`OUTSIDE_NICE`: on a small machine this process stands in for other machines, so it gets the CPU
the server does not use), what the users feel is what the server does with those clients'
connections and messages: the handshakes, the refusals, the flood's frames, the idle stream.

The process is driven over a pipe, one request at a time (`serve`):

    ("begin", kind, target)   the attacker's moves first when kind is "attacked" -> ("ready", None)
    ("knock",)                the knocking users start (nothing is answered)
    ("stop_knocking",)        ... and stop
    ("end",)                  the attacker's streams close -> ("done", {"knocks": ..., "attacker": ...})
    ("exit",)                 at any time: the run's clients stop, then the process
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field

import numpy as np

from harken.bench.load import percentiles

FLOOD_FRAMES = 72  # frames per flooding message: 9 bytes, the most the wire accepts (8 frames per byte)
# The flood writes at most this many messages past the server's last Ack: 18,432 frames, 3x the
# server's per-session limit, so the server never waits for it (unbounded, the flood only fills
# gRPC's buffers: 120,000 messages in 20 s, 300 of them read).
FLOOD_AHEAD = 256
ATTACKER_EXTRA_TRIES = 3
OUTSIDE_NICE = 10  # added to this process's niceness (see the module's docstring)


@dataclass
class Knocks:
    codes: dict[str, int] = field(default_factory=dict)
    ms: list[float] = field(default_factory=list)

    def add(self, code: str, ms: float) -> None:
        self.codes[code] = self.codes.get(code, 0) + 1
        self.ms.append(ms)

    def extend(self, other: "Knocks") -> None:
        for code, n in other.codes.items():
            self.codes[code] = self.codes.get(code, 0) + n
        self.ms += other.ms

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


async def knocking(target: str, keys: list[str], language: str, interval_s: float, stop: asyncio.Event,
                   knocks: Knocks) -> None:
    """Each key tries to open a stream every `interval_s` from a fresh connection until `stop`."""
    async def one(key: str) -> None:
        while not stop.is_set():
            knocks.add(*await knock(target, key, language))
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except asyncio.TimeoutError:  # (TimeoutError itself only from Python 3.11)
                pass

    await asyncio.gather(*(one(k) for k in keys))


class Attacker:
    """The attacker key's clients: an over-claiming payload, a flood, an idle stream, extra tries."""

    def __init__(self, target: str, key: str, language: str):
        self.target, self.key, self.language = target, key, language
        self.stop = asyncio.Event()
        self.acked = 0  # the flood's highest seq the server acknowledged
        self.result: dict = {"flood_messages_written": 0}
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
                        kind = msg.WhichOneof("kind")
                        if kind == "ready":
                            admitted.set()
                        elif kind == "ack" and name == "flood":
                            self.acked = max(self.acked, msg.ack.seq)
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
            if seq >= self.acked + FLOOD_AHEAD:
                await asyncio.sleep(0.005)
                continue
            seq += 1
            yield pb.ClientMessage(features=pb.Features(
                seq=seq, segment_id=0, first_frame=(seq - 1) * FLOOD_FRAMES, frame_count=FLOOD_FRAMES,
                segment_start=seq == 1, payload=payload, running_max_log10=5.0,  # floor -3 = max - 8
                payload_crc32c=crc))
            self.result["flood_messages_written"] = seq  # into gRPC's buffers; the server reads them later

    async def idle_requests(self):
        yield _start(self.language)
        await self.stop.wait()

    async def start(self) -> None:
        await self.over_claim()
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self.hold("flood", self.flood_requests())),
                      loop.create_task(self.hold("idle", self.idle_requests()))]
        while "flood_admitted" not in self.result or "idle_admitted" not in self.result:
            failed = [t for t in self.tasks if t.done()]
            if failed:  # a stream that ended before its admission was known: its error, not a hang
                await failed[0]
                raise RuntimeError("an attacker stream ended before it was admitted or refused")
            await asyncio.sleep(0.01)
        extra = Knocks()
        for _ in range(ATTACKER_EXTRA_TRIES):
            extra.add(*await knock(self.target, self.key, self.language))
        self.result["extra_tries"] = extra.codes

    async def finish(self) -> dict:
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        return self.result


async def _serve(conn, attacker_key: str, knocker_keys: list[str], language: str, interval_s: float) -> None:
    loop = asyncio.get_running_loop()

    async def recv() -> tuple:
        return await loop.run_in_executor(None, conn.recv)

    while True:
        request = await recv()
        if request[0] == "exit":
            return
        _, kind, target = request
        attacker = Attacker(target, attacker_key, language) if kind == "attacked" else None
        if attacker is not None:
            await attacker.start()
        conn.send(("ready", None))
        knocks, stop, knockers = Knocks(), asyncio.Event(), None
        while (request := await recv())[0] not in ("end", "exit"):
            if request[0] == "knock" and knockers is None:
                knockers = asyncio.ensure_future(knocking(target, knocker_keys, language, interval_s, stop, knocks))
            elif request[0] == "stop_knocking":
                stop.set()
        stop.set()
        if knockers is not None:
            await knockers
        result = {"knocks": (knocks.codes, knocks.ms), "attacker": await attacker.finish() if attacker is not None else None}
        if request[0] == "exit":  # the benchmark gave up on this run: stop here
            return
        conn.send(("done", result))


def serve(conn, attacker_key: str, knocker_keys: list[str], language: str, interval_s: float) -> None:
    """The process's entry point (multiprocessing, spawned)."""
    try:
        os.nice(OUTSIDE_NICE)
    except OSError:
        pass
    asyncio.run(_serve(conn, attacker_key, knocker_keys, language, interval_s))
