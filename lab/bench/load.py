"""`harken bench load`: N live clients against a running server, latency as the users see it.

N concurrent SDK clients (`TranscriptionClient`, the public API only) each stream S seconds of the
bundled sample, tiled, in real time: a 100 ms piece is handed to the client when its last sample
would have been captured by a microphone (piece k at t0 + (k + 1) * 100 ms). Stream i starts
i / N of the way into the sample, so the streams' segments do not all begin at once. Everything
is timed on one monotonic clock in this process; the client-side edge work (VAD, log-mel, codec,
200 ms feature packets) is part of every figure, as it is of what a user sees.

Definitions (all in ms, over every stream's events):

- `sent(t)`: the wall time at which the client had been handed all audio up to stream time t
  (the time the piece holding the sample just before t was handed over).
- `p50/p95_update_ms`: for every non-final event, its arrival time minus `sent(event.end_s)`
  (`end_s` is the end of the audio the event covers).
- `first_partial_ms`: for every segment, the arrival of its first event (partial, commit or final)
  minus `sent(event.start_s)`, the segment's onset.
- `final_ms`: for every segment, the arrival of its final event minus `sent(final.end_s)`, the
  segment's end; it includes the VAD's wait for enough silence to end the segment.
- `errors`: streams that failed, by gRPC status code (`ServerRejectedError.code`; a server away
  longer than `max_offline_s` counts as UNAVAILABLE, a client buffer overflow as BUFFER_OVERFLOW).
  Connections the client re-established on its own are `reconnects`, not errors.
- `realtime_ok`: every stream completed without error, no stream's source fell more than one
  piece behind live time (`max_send_lag_ms`: the clients' edge work kept up), and
  `p95_update_ms` <= `KEEP_UP_UPDATE_MS`, the server's default update interval (1 s of audio): the
  updates of a server that keeps up arrive before the next update's audio is in; one that falls
  behind queues them and the figure grows with the backlog.
- `batching_gain` (`--self-serve`, N > 1): the in-process engine's compute for stream 0's audio
  alone (a second run, one client) x N / its compute for the N streams at once (`engine_compute_s`:
  the engine thread's CPU time in its ticks, GPU wall time on CUDA) — what batching saves per
  second of audio served.
- `rtf` (`--self-serve`): the engine's busy wall time (its ticks, every thread's work in them:
  vLLM's included) over the audio served (N x S seconds). 1 / rtf is how many such streams the
  engine could carry at this per-stream cost: it keeps up while N x rtf < 1 (busy less than the
  wall time); past that its updates queue and the latencies grow with the backlog.
- `prefix_cache_hit_rate` (`--self-serve --decoder vllm`): prompt positions vLLM's prefix cache
  served / all prompt positions of the passes (None for the own engine, which keeps each session's
  KV across updates instead of re-prefilling it).
- `--decoder own,vllm`: one self-served run per decoder, one after the other (the own engine first:
  vLLM takes over torch's thread settings in its process), printed as {"runs": [...]}.
- `--streams 1,4,8` (several levels): one run per level, one after the other (`--self-serve`: a
  fresh server each), printed as {"levels": [...], "max_streams_ok": N}: the largest N whose run
  had `realtime_ok` and `p95_update_ms` <= `TARGET_P95_MS` (300 ms, the engine-load target).
- `--finalize`: each client also asks to finalize (`FINALIZE`, as Pipecat or a push-to-talk button
  does) right after the piece holding the end of each of its edge VAD's segments (the last word plus
  the VAD's 100 ms pad, before the VAD itself would end the segment); `finalize_ms` is the arrival
  of the `from_finalize` final minus the request (`finalize_requests`, `finalize_answered`: those
  whose segment the request cut).
- With no `--server`, `--self-serve` is implied.
- `drain_ms`: last piece handed over -> stream complete (its last final in). Not part of
  `realtime_ok`: it is dominated by the final pass over the segment open at the end, whose length
  is the model's business (the random tiny model never emits EOS, so its final passes run to the
  256-token budget).

No torch here, except on the `--self-serve` path (an in-process server, `cloud/server.py`).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace

import numpy as np

from harken.edge.audio import load_audio, peak_normalize
from harken.edge.client.front_end import FINALIZE
from harken.edge.client.grpc_client import (BufferOverflowError, ClientOptions, ServerRejectedError,
                                   ServerUnavailableError, TranscriptionClient, TransportError)
from harken.shared.errors import HarkenError
from harken.shared.features_spec import SAMPLE_RATE
from harken.shared.transcript import TranscriptEvent

from harken.bench.replay import PIECE_S, replay

PIECE_MS = 100
KEEP_UP_UPDATE_MS = 1000.0  # CommitPolicy.update_interval_s, the server default
FINALIZE_MATCH_S = 0.25  # a from_finalize final ends within this of the audio its request was sent after
TARGET_P95_MS = 300.0  # a level is "ok" at or under this p95 update latency (lab/bench/engine_load.py's)


@dataclass(frozen=True)
class LoadBenchOptions:
    """`harken bench load` as a dataclass. `server` None with `self_serve`: an in-process one."""

    server: str | None = None
    streams: int = 4
    seconds: float = 20.0
    api_key: str | None = None
    tls_ca: str | None = None
    language: str = ""  # "" = detect
    self_serve: bool = False
    model: str = "tiny"  # --self-serve only
    decoder: str = "own"  # --self-serve only: "own", "vllm" or a comma list of them
    piece_ms: int = PIECE_MS
    replay: bool = False  # clients in a process of their own replaying precomputed packets (replay.py)
    finalize: bool = False  # each stream asks to finalize at the end of each of its VAD segments
    workers: int = 0  # --self-serve: `harken serve --workers N` (the engine in this process, N front ends)

    def __post_init__(self):
        if (self.server is None) == (not self.self_serve):
            raise HarkenError("give either --server HOST:PORT or --self-serve")
        if self.streams < 1 or self.seconds <= 0:
            raise HarkenError("--streams must be >= 1 and --seconds > 0")
        if self.tls_ca is not None and not os.path.isfile(self.tls_ca):
            raise HarkenError(f"{self.tls_ca}: no such certificate file")
        if self.decoders != ["own"] and not self.self_serve:
            raise HarkenError("--decoder goes with --self-serve (a --server has its own)")
        if self.replay and self.finalize:
            raise HarkenError("--finalize goes with the SDK's clients, not --replay")
        if self.replay and self.tls_ca is not None:
            raise HarkenError("--replay's clients speak plaintext gRPC: no --tls-ca")
        if self.workers and not self.self_serve:
            raise HarkenError("--workers goes with --self-serve (a --server has its own)")
        if self.workers < 0:
            raise HarkenError("--workers must be >= 1 (0: one process)")
        if not self.decoders or any(d not in ("own", "vllm") for d in self.decoders):
            raise HarkenError(f"--decoder: own, vllm or a comma list of them, got {self.decoder!r}")

    @property
    def decoders(self) -> list[str]:
        return [d.strip() for d in self.decoder.split(",") if d.strip()]


def tiled(audio: np.ndarray, seconds: float, offset_s: float = 0.0) -> np.ndarray:
    """`seconds` of `audio` repeated end to end, starting `offset_s` into it."""
    n = int(round(seconds * SAMPLE_RATE))
    start = int(round(offset_s * SAMPLE_RATE))
    return audio[(np.arange(n) + start) % audio.size]


def sent_at(t_s: float, handed: Sequence[float], piece_samples: int) -> float:
    """`sent(t)`: when the client had all audio before stream time `t_s`, given `handed[k]`, the
    wall time piece k (samples [k * piece_samples, (k + 1) * piece_samples)) was handed over."""
    k = math.ceil(round(t_s * SAMPLE_RATE) / piece_samples) - 1
    return handed[min(max(k, 0), len(handed) - 1)]


def percentiles(values: list[float]) -> dict:
    """{"p50", "p95"} in ms rounded to 0.1, None where there are no values."""
    if not values:
        return {"p50": None, "p95": None}
    p50, p95 = np.percentile(np.asarray(values), [50, 95])
    return {"p50": round(float(p50), 1), "p95": round(float(p95), 1)}


@dataclass
class StreamRecord:
    """One client's timeline: what was handed over when, what came back when."""

    piece_samples: int
    handed: list[float] = field(default_factory=list)  # wall time piece k was handed over
    max_lag_s: float = 0.0  # handed later than due, at most
    update_ms: list[float] = field(default_factory=list)
    first_ms: list[float] = field(default_factory=list)
    final_ms: list[float] = field(default_factory=list)
    seen_segments: set[int] = field(default_factory=set)
    events: int = 0
    finals: int = 0
    error: str | None = None
    done_at: float | None = None
    reconnects: int = 0
    finalize_asked: list[tuple[float, float]] = field(default_factory=list)  # (audio s, wall time asked)
    finalize_ms: list[float] = field(default_factory=list)

    def observe(self, event: TranscriptEvent, now: float) -> None:
        self.events += 1
        if event.segment_id not in self.seen_segments:
            self.seen_segments.add(event.segment_id)
            self.first_ms.append(1000 * (now - sent_at(event.start_s, self.handed, self.piece_samples)))
        lag_ms = 1000 * (now - sent_at(event.end_s, self.handed, self.piece_samples))
        if event.is_final:
            self.finals += 1
            self.final_ms.append(lag_ms)
            if getattr(event, "from_finalize", False) and self.finalize_asked:
                # the request that cut this segment: the one asked at the audio time it ends at
                audio_s, asked = min(self.finalize_asked, key=lambda r: abs(r[0] - event.end_s))
                if abs(audio_s - event.end_s) <= FINALIZE_MATCH_S:
                    self.finalize_ms.append(1000 * (now - asked))
        else:
            self.update_ms.append(lag_ms)

    @property
    def drain_s(self) -> float | None:
        if self.done_at is None or not self.handed:
            return None
        return self.done_at - self.handed[-1]


async def paced(audio: np.ndarray, t0: float, record: StreamRecord, finalize_at: Sequence[int] = ()):
    """`audio` in pieces, each handed over when a microphone would have delivered it; `FINALIZE`
    right after the piece that holds each sample position of `finalize_at`."""
    step = record.piece_samples
    pending = list(finalize_at)
    for k, i in enumerate(range(0, audio.size, step)):
        due = t0 + (k + 1) * step / SAMPLE_RATE
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        now = time.monotonic()
        record.max_lag_s = max(record.max_lag_s, now - due)
        record.handed.append(now)
        yield audio[i:i + step]
        end = min(audio.size, i + step)
        if pending and pending[0] <= end:
            while pending and pending[0] <= end:
                pending.pop(0)
            record.finalize_asked.append((end / SAMPLE_RATE, time.monotonic()))
            yield FINALIZE


def finalize_points(audio: np.ndarray) -> list[int]:
    """Where a client that hears its speaker stop asks to finalize: the end of each of the edge
    VAD's segments of `audio` (the last word plus the VAD's 100 ms pad), as sample positions."""
    from harken.edge.vad import get_speech_timestamps

    return [s.end_sample for s in get_speech_timestamps(audio)]


async def _one_stream(client: TranscriptionClient, audio: np.ndarray, t0: float, record: StreamRecord,
                      finalize: bool = False) -> None:
    try:
        async with aclosing(client.stream(paced(audio, t0, record, finalize_points(audio) if finalize else ()))) as events:
            async for event in events:
                record.observe(event, time.monotonic())
        record.done_at = time.monotonic()
    except ServerRejectedError as e:
        record.error = e.code
    except ServerUnavailableError:
        record.error = "UNAVAILABLE"
    except BufferOverflowError:
        record.error = "BUFFER_OVERFLOW"
    except TransportError as e:
        record.error = type(e).__name__
    finally:
        record.reconnects = client.stats.failed_attempts


async def run_load(target: str, options: LoadBenchOptions, sample: np.ndarray) -> dict:
    """Stream `options.streams` tiled copies of `sample` to `target` at once; the JSON result."""
    piece_samples = SAMPLE_RATE * options.piece_ms // 1000
    n = options.streams
    records = [StreamRecord(piece_samples) for _ in range(n)]
    client_options = ClientOptions(language=options.language)
    clients = [TranscriptionClient(target, api_key=options.api_key, tls=options.tls_ca, options=client_options)
               for _ in range(n)]
    audios = stream_audios(sample, options)
    t0 = time.monotonic()
    await asyncio.gather(*(_one_stream(c, a, t0, r, options.finalize) for c, a, r in zip(clients, audios, records)))
    wall_s = time.monotonic() - t0
    return summarize(records, options, wall_s)


def summarize(records: list[StreamRecord], options: LoadBenchOptions, wall_s: float) -> dict:
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    updates = [ms for r in records for ms in r.update_ms]
    drains = [r.drain_s for r in records if r.drain_s is not None]
    max_lag_ms = 1000 * max(r.max_lag_s for r in records)
    update = percentiles(updates)
    kept_up = (not errors and all(r.done_at is not None for r in records) and max_lag_ms <= options.piece_ms
               and (update["p95"] is None or update["p95"] <= KEEP_UP_UPDATE_MS))
    return {
        "streams": options.streams,
        "seconds": options.seconds,
        "p50_update_ms": update["p50"],
        "p95_update_ms": update["p95"],
        "first_partial_ms": percentiles([ms for r in records for ms in r.first_ms]),
        "final_ms": percentiles([ms for r in records for ms in r.final_ms]),
        "errors": errors,
        "events": sum(r.events for r in records),
        "updates": len(updates),
        "segments": sum(r.finals for r in records),
        "realtime_ok": kept_up,
        "max_send_lag_ms": round(max_lag_ms, 1),
        "drain_ms": {"p50": round(1000 * float(np.median(drains)), 1) if drains else None,
                     "max": round(1000 * max(drains), 1) if drains else None},
        "reconnects": sum(r.reconnects for r in records),
        **({"finalize_ms": percentiles([ms for r in records for ms in r.finalize_ms]),
            "finalize_requests": sum(len(r.finalize_asked) for r in records),
            "finalize_answered": sum(len(r.finalize_ms) for r in records)} if options.finalize else {}),
        "wall_s": round(wall_s, 2),
        "piece_ms": options.piece_ms,
    }


def stream_audios(sample: np.ndarray, options: LoadBenchOptions) -> list[np.ndarray]:
    """Each stream's audio: `options.seconds` of `sample` tiled, stream i starting i / N of the way in."""
    n, period_s = options.streams, sample.size / SAMPLE_RATE
    return [tiled(sample, options.seconds, offset_s=round(i * period_s / n, 1)) for i in range(n)]


async def run_replay(target: str, options: LoadBenchOptions, sample: np.ndarray, engine=None,
                     front_ends: Callable[[], list[int]] | None = None) -> dict:
    """`--replay`: the streams from a client process of its own (replay.py); the JSON result, with
    the server's CPU per stream-second split into the model's calls and the rest when `engine` (the
    in-process server's) is given. `front_ends`: the pids of --workers' front-end processes, whose
    CPU is the server's too."""
    got = await replay(target, stream_audios(sample, options), options.language, options.api_key, engine,
                       front_ends=front_ends)
    piece_samples = int(round(PIECE_S * SAMPLE_RATE))
    records = []
    for s in got["streams"]:
        r = StreamRecord(piece_samples)
        pieces = int(np.ceil(options.seconds / PIECE_S))
        r.handed = [got["start_at"] + (k + 1) * PIECE_S for k in range(pieces)]  # the audio clock: captured then
        r.max_lag_s, r.error, r.done_at = s["max_lag_s"], s["error"], s["done_at"]
        for arrival, segment_id, start_s, end_s, is_final in s["events"]:
            r.observe(TranscriptEvent(segment_id, "", "", 0.0, start_s, end_s, "", is_final), arrival)
        records.append(r)
    out = summarize(records, options, got["wall_s"])
    audio_s = options.streams * options.seconds
    server_ms = 1000 * got["server_cpu_s"] / audio_s
    out["replay"] = True
    out["server_cpu_ms_per_stream_s"] = round(server_ms, 3)
    if "model_cpu_s" in got:
        model_ms = 1000 * got["model_cpu_s"] / audio_s
        out["model_cpu_ms_per_stream_s"] = round(model_ms, 3)
        out["host_cpu_ms_per_stream_s"] = round(server_ms - model_ms, 3)
    out["client_cpu_s"] = got["cpu_s"]
    return out


def sample_audio() -> np.ndarray:
    """The bundled 20 s sample (speech with pauses), peak-normalised as the client treats files."""
    from importlib.resources import files

    return peak_normalize(load_audio(str(files("harken") / "data" / "sample.wav")))


async def bench_load(options: LoadBenchOptions) -> dict:
    if len(options.decoders) > 1:
        from harken.cloud.inference.vllm_decoder import check_decoder  # --self-serve: torch is there anyway

        for d in options.decoders:  # a missing vLLM fails before the first run, not after it
            check_decoder(d)
        return {"runs": [await bench_load(replace(options, decoder=d)) for d in options.decoders]}
    sample = sample_audio()
    if not options.self_serve:
        assert options.server is not None  # LoadBenchOptions: --server or --self-serve
        result = await (run_replay(options.server, options, sample) if options.replay
                        else run_load(options.server, options, sample))
        result["server"] = options.server
        return result
    server = await _start_self_served(options)
    try:
        if options.replay:
            result = await run_replay(server.address, options, sample, engine=server.engine,
                                      front_ends=getattr(server, "front_end_pids", None) and (
                                          lambda: list(server.front_end_pids().values())))
        else:
            result = await run_load(server.address, options, sample)
        engine = server.engine
        batched_s = engine.compute_s
        result["engine_compute_s"] = round(batched_s, 3)
        result["rtf"] = round(engine.busy_s / (options.streams * options.seconds), 4)
        hit_rate = getattr(engine, "prefix_cache_hit_rate", None)
        result["prefix_cache_hit_rate"] = round(hit_rate, 4) if hit_rate is not None else None
        if options.streams > 1 and not options.replay:
            # the same work one stream at a time: stream 0 alone, on the same server
            before = engine.compute_s
            await run_load(server.address, replace(options, streams=1), sample)
            alone_s = engine.compute_s - before
            result["engine_compute_alone_s"] = round(alone_s, 3)
            result["batching_gain"] = round(alone_s * options.streams / batched_s, 3) if batched_s > 0 else None
        else:
            result["batching_gain"] = None
    finally:
        await server.stop(grace_s=2.0)
    result["server"] = "self-serve" + (f" --workers {options.workers}" if options.workers else "")
    result["model"] = options.model
    result["decoder"] = options.decoder
    return result


async def _start_self_served(options: LoadBenchOptions):
    """An in-process server on a free port (imports torch: only here)."""
    import torch

    from harken.cloud.server import ServerOptions, start_server

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # small batched matmuls on a shared CPU: one thread is fastest
        # vLLM's CPU worker would bind an OpenMP thread to every core; "nobind" keeps torch's one
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from harken.cloud.inference.vllm_decoder import check_decoder

    check_decoder(options.decoder)
    server_options = ServerOptions(
        host="127.0.0.1", port=0, max_sessions=max(16, options.streams),
        max_sessions_per_key=max(16, options.streams), decoder=options.decoder)
    if options.workers:
        from harken.cloud.model.asr import Qwen3ASR
        from harken.cloud.workers import start_workers

        asr = await asyncio.to_thread(Qwen3ASR.load, options.model)
        return await start_workers(asr, replace(server_options, workers=options.workers))
    return await start_server(options.model, server_options)


async def bench_load_levels(options: LoadBenchOptions, levels: Sequence[int]) -> dict:
    """One run per level of streams, in order: {"levels": [...], "max_streams_ok": N or None}."""
    runs = [await bench_load(replace(options, streams=n)) for n in levels]

    def ok(run: dict) -> bool:
        inner = run["runs"] if "runs" in run else [run]
        return all(r["realtime_ok"] and r["p95_update_ms"] is not None and r["p95_update_ms"] <= TARGET_P95_MS
                   for r in inner)

    good = [n for n, run in zip(levels, runs) if ok(run)]
    return {"levels": runs, "target_p95_update_ms": TARGET_P95_MS, "max_streams_ok": max(good) if good else None}


def parse_levels(text: str) -> list[int]:
    """`--streams`: one N or a comma list of levels."""
    try:
        levels = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise HarkenError(f"--streams: a number or a comma list of numbers, got {text!r}") from None
    if not levels or any(n < 1 for n in levels):
        raise HarkenError("--streams must be >= 1")
    return levels


def bench_load_command(options: LoadBenchOptions, levels: Sequence[int] | None = None) -> int:
    if options.api_key is None and os.environ.get("HARKEN_API_KEY"):
        options = replace(options, api_key=os.environ["HARKEN_API_KEY"])
    if levels is not None and len(levels) > 1:
        result = asyncio.run(bench_load_levels(options, levels))
    else:
        result = asyncio.run(bench_load(options))
    print(json.dumps(result, indent=1))
    return 0
