"""`harken bench load --replay`: what the server's host work costs, with the edge's work taken out.

The clients run in a process of their own (`python -m harken.bench.replay_clients`) and replay feature
packets computed before the run: each stream's audio (the bundled sample, tiled and offset as in
`harken bench load`) went through the edge's `FeatureStream` in 100 ms pieces, and a packet is sent
at the wall time its last piece would have been captured (the audio clock from one shared start),
exactly what a live edge would send then. So the server process does only the server's work (gRPC,
sessions, codec decode, the commit policy, events, the engine and the model), and its CPU time is
measured alone:

- `server_cpu_ms_per_stream_s`: the server process's CPU time (user + system, every thread) during
  the run, per second of audio served (N x S).
- `model_cpu_ms_per_stream_s`: the part of it spent inside the model's calls (the encoder's window
  encodes, the decoder's prefills and decode steps: the engine thread's CPU time in them; its kernels
  on a CPU). On a GPU that is the host's side of the launches; `harken bench engine-load --profile-s`
  gives the device's kernel time there.
- `host_cpu_ms_per_stream_s`: the rest, everything that is not the model: what limits how many
  streams one process can hold whatever the accelerator.

Latencies are `harken bench load`'s, on the audio clock: an event's arrival minus the wall time the
audio it covers had been captured. `max_send_lag_ms` is how late the replaying process sent its
packets (a client process that cannot keep up shows here, not as server latency).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import pickle
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from harken.edge.pipeline import FeatureStream
from harken.shared.codec import CODEC_NAME
from harken.shared.features_spec import SAMPLE_RATE
from harken.shared.wire import features_to_proto

PIECE_S = 0.1


def stream_packets(audio: np.ndarray, piece_s: float = PIECE_S) -> list[tuple[float, bytes]]:
    """(audio time the edge has it, serialized `ClientMessage`) for every feature packet of `audio`
    pushed through the edge's pipeline in `piece_s` pieces (then flushed at its end)."""
    step = int(round(piece_s * SAMPLE_RATE))
    stream = FeatureStream()
    out: list[tuple[float, bytes]] = []

    def add(packets, at_s: float) -> None:
        for p in packets:
            out.append((at_s, features_to_proto(p, seq=len(out) + 1).SerializeToString()))

    for k, i in enumerate(range(0, audio.size, step)):
        add(stream.push(audio[i:i + step]), min(audio.size, i + step) / SAMPLE_RATE)
    add(stream.flush(), audio.size / SAMPLE_RATE)
    return out


def prepared_streams(audios: list[np.ndarray]) -> list[list[tuple[float, bytes]]]:
    """The packets of each stream's audio, computed once per distinct audio (streams that start at
    the same offset into the same sample are the same packets)."""
    cache: dict[bytes, list[tuple[float, bytes]]] = {}
    streams = []
    for audio in audios:
        key = hashlib.sha1(audio.tobytes()).digest()
        if key not in cache:
            cache[key] = stream_packets(audio)
        streams.append(cache[key])
    return streams


class ModelClock:
    """The engine thread's CPU time inside the model's calls: the encoder's `encode_windows` and the
    decoder's `prefill` and `decode_step` as the engine calls them, wrapped for the run."""

    def __init__(self, engine):
        import harken.cloud.inference.engine as engine_module

        self.cpu_s = 0.0
        self._undo = []
        for owner, name in ((engine_module, "prefill"), (engine_module, "decode_step"),
                            (engine.asr.encoder, "encode_windows")):
            fn = getattr(owner, name)
            self._undo.append((owner, name, fn if name in vars(owner) else None))
            setattr(owner, name, self._timed(fn))

    def _timed(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu_s += time.thread_time() - t
        return timed

    def close(self) -> None:
        for owner, name, fn in self._undo:
            if fn is None:
                delattr(owner, name)  # an instance's method: its class's again
            else:
                setattr(owner, name, fn)
        self._undo.clear()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _children_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) of these processes so far (a process gone counts 0)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


async def replay(target: str, audios: list[np.ndarray], language: str = "", api_key: str | None = None,
                 engine=None, front_ends: Callable[[], list[int]] | None = None) -> dict:
    """Replay one stream per audio against `target` from a client process of its own. Returns the
    client process's record (per stream: its events as (arrival, segment_id, start_s, end_s,
    is_final), `max_lag_s`, `error`, `done_at`; `wall_s`, `cpu_s`), `start_at` (the audio clock's
    zero on this machine's monotonic clock) and this process's CPU during the run, `server_cpu_s`,
    with `model_cpu_s` when `engine` (the in-process server's) is given; `front_ends`: the pids of
    the server's other processes (`--workers`), whose CPU counts in `server_cpu_s`."""
    streams = prepared_streams(audios)
    with tempfile.TemporaryDirectory() as tmp:
        job, result_path = Path(tmp) / "job.pickle", Path(tmp) / "result.json"
        start_at = time.monotonic() + 2.0 + 0.002 * len(audios)  # the client process's start-up before it
        job.write_bytes(pickle.dumps({"target": target, "language": language, "streams": streams,
                                      "codec": CODEC_NAME, "api_key": api_key, "start_at": start_at}))
        clock = ModelClock(engine) if engine is not None else None
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "harken.bench.replay_clients", str(job),
                                                    str(result_path), env={**os.environ, "GRPC_VERBOSITY": "NONE"})
        try:
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))
            pids = front_ends() if front_ends is not None else []
            cpu0, model0 = _cpu_s() + _children_cpu_s(pids), clock.cpu_s if clock else 0.0
            returncode = await proc.wait()
            cpu1, model1 = _cpu_s() + _children_cpu_s(pids), clock.cpu_s if clock else 0.0
        finally:
            if proc.returncode is None:
                proc.kill()
            if clock is not None:
                clock.close()
        if returncode != 0 or not result_path.exists():
            raise RuntimeError(f"the replaying client process failed (exit {returncode})")
        got = json.loads(result_path.read_text())
    got.update(start_at=start_at, server_cpu_s=cpu1 - cpu0)
    if clock is not None:
        got["model_cpu_s"] = model1 - model0
    return got
