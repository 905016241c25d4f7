"""`harken bench soak`: one long live stream; memory and update latency sampled every minute.

An in-process server on loopback (cloud/server.py with `model`, tiny by default) and one SDK client
(`TranscriptionClient`, features over gRPC) streaming the bundled 20 s sample tiled without end, in
100 ms pieces handed over when a microphone would deliver them (`speed` x real time; `speed` 2 hands
over two seconds of audio per second), for `minutes` of wall time; then End, and the last finals.
Nothing in the bench grows with the stream except one float per piece handed over (its hand-over
time, 8 bytes: 0.3 MB an hour at real time), so what grows is the server's and the client's.

Every `sample_s` (60 s) one sample:
  rss_mb              the process's resident set (server + client + bench, /proc/self/status VmRSS)
  updates, p50_update_ms, p95_update_ms   the non-final events that arrived since the last sample,
                      and their latency as `harken bench load` defines it (lab/bench/load.py):
                      arrival minus when the audio the event covers had been handed to the client
  finals, audio_s     segments finalised since the last sample; stream time handed over so far
  events_held         transcript events the server's session holds for replay (its event log)
Summary:
  rss_growth_mb       last sample's RSS minus the first's (the first minute holds the warm-up:
                      allocator pools, caches and buffers filling); rss_start_mb before the stream
  rss_slope_mb_per_hour   least-squares slope of RSS over the second half of the samples (the
                      trend once warm-up effects, such as the allocator handing memory back, are over)
  p95_update_ms_first / _last   the first and last samples' p95
  errors, reconnects  the stream's end (a gRPC code) if it failed, and calls it re-established
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from array import array
from contextlib import aclosing
from dataclasses import dataclass, field

import numpy as np

from harken.bench.load import PIECE_MS, percentiles, sample_audio, sent_at
from harken.shared.errors import HarkenError
from harken.shared.features_spec import SAMPLE_RATE


@dataclass(frozen=True)
class SoakBenchOptions:
    minutes: float = 30.0
    speed: float = 1.0  # audio seconds handed over per wall second
    sample_s: float = 60.0
    # `tiny-untied` never ends its answer, so every update decodes, all along. The `tiny` checkpoint
    # falls silent for good after some minutes of this input: fed its own earlier output as context
    # (the carried committed text), it answers end-of-text at once, which carries nothing new.
    model: str = "tiny-untied"
    language: str = "English"  # the tiny checkpoints' random weights write text only when forced
    piece_ms: int = PIECE_MS

    def __post_init__(self):
        if self.minutes <= 0 or self.speed <= 0 or self.sample_s <= 0:
            raise HarkenError("--minutes, --speed and --sample-s must be > 0")


def rss_mb() -> float | None:
    """The resident set of this process in MB (Linux /proc), None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


@dataclass
class SoakRecord:
    """The stream's timeline: when each piece was handed over; latencies since the last sample."""

    piece_samples: int
    handed: array = field(default_factory=lambda: array("d"))  # wall time piece k was handed over
    update_ms: list[float] = field(default_factory=list)  # since the last sample
    finals: int = 0  # since the last sample
    events: int = 0
    segments: int = 0
    max_lag_s: float = 0.0

    def observe(self, end_s: float, is_final: bool, now: float) -> None:
        self.events += 1
        if is_final:
            self.finals += 1
            self.segments += 1
        else:
            self.update_ms.append(1000 * (now - sent_at(end_s, self.handed, self.piece_samples)))

    def take(self) -> tuple[list[float], int]:
        out = self.update_ms, self.finals
        self.update_ms, self.finals = [], 0
        return out

    @property
    def audio_s(self) -> float:
        return len(self.handed) * self.piece_samples / SAMPLE_RATE


async def endless_pieces(sample: np.ndarray, record: SoakRecord, t0: float, stop_at: float, speed: float):
    """`sample` tiled without end, piece k handed over at t0 + (k + 1) * piece / speed, until `stop_at`."""
    step = record.piece_samples
    k = 0
    while True:
        due = t0 + (k + 1) * step / SAMPLE_RATE / speed
        if due > stop_at:
            return
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        now = time.monotonic()
        record.max_lag_s = max(record.max_lag_s, now - due)
        record.handed.append(now)
        start = (k * step) % sample.size
        yield np.take(sample, np.arange(start, start + step), mode="wrap")
        k += 1


async def run_soak(options: SoakBenchOptions, server, sample: np.ndarray) -> dict:
    from harken.edge.client.grpc_client import ClientOptions, ServerRejectedError, TranscriptionClient, TransportError

    record = SoakRecord(SAMPLE_RATE * options.piece_ms // 1000)
    client = TranscriptionClient(server.address, options=ClientOptions(language=options.language))
    samples: list[dict] = []
    rss_start = rss_mb()
    t0 = time.monotonic()
    stop_at = t0 + 60 * options.minutes
    error: str | None = None

    def events_held() -> int:
        return sum(len(s.core.events) for s in server._table.sessions.values())

    async def sampler() -> None:
        n = 1
        while True:
            await asyncio.sleep(max(0.0, t0 + n * options.sample_s - time.monotonic()))
            updates, finals = record.take()
            p = percentiles(updates)
            samples.append({"t_s": round(time.monotonic() - t0, 1), "rss_mb": _round(rss_mb()), "updates": len(updates),
                            "p50_update_ms": p["p50"], "p95_update_ms": p["p95"], "finals": finals,
                            "audio_s": round(record.audio_s, 1), "events_held": events_held()})
            n += 1

    async def stream() -> None:
        nonlocal error
        try:
            pieces = endless_pieces(sample, record, t0, stop_at, options.speed)
            async with aclosing(client.stream(pieces)) as events:
                async for e in events:
                    record.observe(e.end_s, e.is_final, time.monotonic())
        except ServerRejectedError as e:
            error = e.code
        except TransportError as e:
            error = type(e).__name__

    sampling = asyncio.ensure_future(sampler())
    try:
        await stream()
    finally:
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
    wall_s = time.monotonic() - t0
    first = samples[0] if samples else None
    last = samples[-1] if samples else None
    return {
        "minutes": options.minutes,
        "speed": options.speed,
        "sample_s": options.sample_s,
        "model": options.model,
        "samples": samples,
        "rss_start_mb": _round(rss_start),
        "rss_growth_mb": _round(last["rss_mb"] - first["rss_mb"]) if first and last and first["rss_mb"] else None,
        "rss_max_mb": max((s["rss_mb"] for s in samples if s["rss_mb"] is not None), default=None),
        "rss_slope_mb_per_hour": rss_slope(samples[len(samples) // 2:]),
        "p95_update_ms_first": first["p95_update_ms"] if first else None,
        "p95_update_ms_last": last["p95_update_ms"] if last else None,
        "audio_s": round(record.audio_s, 1),
        "events": record.events,
        "segments": record.segments,
        "max_send_lag_ms": round(1000 * record.max_lag_s, 1),
        "errors": {error: 1} if error else {},
        "reconnects": client.stats.failed_attempts,
        "wall_s": round(wall_s, 1),
    }


def rss_slope(samples: list[dict]) -> float | None:
    """Least-squares slope of rss_mb over t_s, in MB per hour (None with fewer than 2 samples)."""
    points = [(s["t_s"], s["rss_mb"]) for s in samples if s["rss_mb"] is not None]
    if len(points) < 2:
        return None
    t, m = np.array(points).T
    return round(float(np.polyfit(t, m, 1)[0]) * 3600, 2)


def _round(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else round(x, 1)


async def bench_soak(options: SoakBenchOptions) -> dict:
    import torch

    from harken.cloud.server import ServerOptions, start_server

    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    sample = sample_audio()
    server = await start_server(options.model, ServerOptions(host="127.0.0.1", port=0))
    try:
        return await run_soak(options, server, sample)
    finally:
        await server.stop(grace_s=2.0)


def bench_soak_command(options: SoakBenchOptions) -> int:
    print(json.dumps(asyncio.run(bench_soak(options)), indent=1))
    return 0
