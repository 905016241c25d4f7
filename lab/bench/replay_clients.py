"""The replaying clients of `harken bench load --replay`, in a process of their own:

    python -m harken.bench.replay_clients JOB.pickle RESULT.json

JOB holds the target, the language and, per stream, the serialized `Features` messages with the
audio time each is due at; from the shared start (`start_at`, on the machine's monotonic clock, which
every process reads alike) each stream opens its call, sends `Start`, each packet when it is due and
`End`, and records every transcript event's arrival. No edge work, no resume: a stream that fails
records its status. RESULT gets the events, the send lag, the wall time and this process's CPU time.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import resource
import sys
import time

import grpc

from harken.proto import harken_pb2 as pb
from harken.proto import harken_pb2_grpc


async def replay(stub, start: bytes, packets: list[tuple[float, bytes]], start_at: float, metadata: tuple) -> dict:
    out: dict = {"events": [], "max_lag_s": 0.0, "error": None, "done_at": None}

    async def requests():
        yield pb.ClientMessage.FromString(start)
        for due_s, message in packets:
            due = start_at + due_s
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            out["max_lag_s"] = max(out["max_lag_s"], time.monotonic() - due)
            yield pb.ClientMessage.FromString(message)
        yield pb.ClientMessage(end=pb.End())

    try:
        async for m in stub.Stream(requests(), metadata=metadata):
            if m.WhichOneof("kind") == "transcript":
                t = m.transcript
                out["events"].append((time.monotonic(), t.segment_id, t.start_s, t.end_s, t.is_final))
        out["done_at"] = time.monotonic()
    except grpc.aio.AioRpcError as e:
        out["error"] = e.code().name
        out["details"] = e.details()
    return out


STREAMS_PER_CHANNEL = 64  # HTTP/2 connections as several edges would open them


async def main(job: dict) -> dict:
    start = pb.ClientMessage(start=pb.Start(language=job["language"], codec=job["codec"])).SerializeToString()
    options = [("grpc.max_receive_message_length", 16 << 20), ("grpc.use_local_subchannel_pool", 1)]
    n = len(job["streams"])
    channels = [grpc.aio.insecure_channel(job["target"], options=options)
                for _ in range(0, n, STREAMS_PER_CHANNEL)]
    try:
        stubs = [harken_pb2_grpc.TranscriptionStub(c) for c in channels]
        await asyncio.sleep(max(0.0, job["start_at"] - time.monotonic()))
        t0 = time.monotonic()
        metadata = (("authorization", f"Bearer {job['api_key']}"),) if job.get("api_key") else ()
        streams = await asyncio.gather(*(replay(stubs[i // STREAMS_PER_CHANNEL], start, packets, job["start_at"], metadata)
                                         for i, packets in enumerate(job["streams"])))
    finally:
        for c in channels:
            await c.close()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"streams": streams, "wall_s": time.monotonic() - t0, "cpu_s": round(usage.ru_utime + usage.ru_stime, 3)}


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as job_file:
        job = pickle.load(job_file)
    result = asyncio.run(main(job))
    with open(sys.argv[2], "w") as result_file:
        json.dump(result, result_file)
