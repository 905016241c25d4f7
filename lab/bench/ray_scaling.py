"""`harken bench ray --streams N --json`: what Ray Serve gives and costs on this machine.

- `ray_scaling`: aggregate throughput (audio seconds transcribed per wall second, N streams sent
  as fast as the servers take them) with 2 replicas over the same with 1.
- `proxy_p50_ms`, `proxy_p95_ms`: the latency Serve's proxy adds per update — the update latency
  of N live (real-time paced) streams through 1 replica minus the same load on an in-process
  `harken serve` (lab/bench/load.py measures both the same way).

A local Ray cluster is started with `cpus` CPUs, no dashboard and a small object store, and shut
down at the end. The replicas get `cpus / 2` CPUs each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import sys
import time
from dataclasses import dataclass

import numpy as np

from harken.shared.errors import HarkenError


@dataclass(frozen=True)
class RayBenchOptions:
    streams: int = 4
    seconds: float = 10.0  # audio per stream
    model: str = "tiny"
    cpus: int = 2

    def __post_init__(self):
        if self.streams < 1 or self.seconds <= 0 or self.cpus < 1:
            raise HarkenError("--streams and --cpus must be >= 1 and --seconds > 0")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _throughput(target: str, audios: list[np.ndarray], language: str) -> float:
    """Audio seconds per wall second, every stream sent as fast as it is taken."""
    from harken.edge.client import ClientOptions, TranscriptionClient
    from harken.edge.client.front_end import audio_pieces
    from harken.shared.features_spec import SAMPLE_RATE

    async def one(audio):
        client = TranscriptionClient(target, options=ClientOptions(language=language))
        async for _ in client.stream(audio_pieces(audio)):
            pass

    t0 = time.monotonic()
    await asyncio.gather(*(one(a) for a in audios))
    return sum(a.size for a in audios) / SAMPLE_RATE / (time.monotonic() - t0)


def bench_ray(options: RayBenchOptions) -> dict:
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise HarkenError("bench ray needs Ray Serve: pip install 'harken[scale]'") from e
    from harken.cloud.ray_app import Scaling, start_ray
    from harken.cloud.server import ServerOptions, start_server
    from harken.bench.load import LoadBenchOptions, run_load, sample_audio, tiled

    import torch

    torch.set_num_threads(1)  # as `bench load --self-serve`: small matmuls on a shared CPU
    language = "English" if options.model.startswith("tiny") else ""
    sample = sample_audio()
    n = options.streams
    audios = [tiled(sample, options.seconds, offset_s=round(i * sample.size / 16_000 / n, 1)) for i in range(n)]
    load = LoadBenchOptions(server="ray", streams=n, seconds=options.seconds, language=language)
    server_options = ServerOptions(host="127.0.0.1", port=_free_port(), max_sessions=max(16, n),
                                   max_sessions_per_key=max(16, n), shutdown_grace_s=2.0)
    out: dict = {"streams": n, "seconds": options.seconds, "model": options.model, "cpus": options.cpus}

    async def plain() -> dict:
        server = await start_server(options.model, ServerOptions(
            host="127.0.0.1", port=0, max_sessions=max(16, n), max_sessions_per_key=max(16, n)))
        try:
            return await run_load(server.address, load, sample)
        finally:
            await server.stop(grace_s=2.0)

    direct = asyncio.run(plain())
    ray.init(num_cpus=options.cpus, include_dashboard=False, object_store_memory=200 << 20,
             logging_level=logging.WARNING, log_to_driver=False)
    try:
        per_replica = options.cpus / 2
        running = start_ray(options.model, server_options, Scaling(1, 1, replica_cpus=per_replica),
                            serve_http_port=_free_port())
        via_proxy = asyncio.run(run_load(running.address, load, sample))
        one = asyncio.run(_throughput(running.address, audios, language))
        running = start_ray(options.model, server_options, Scaling(2, 2, replica_cpus=per_replica),
                            serve_http_port=_free_port())
        two = asyncio.run(_throughput(running.address, audios, language))
    finally:
        serve.shutdown()
        ray.shutdown()
    out.update({
        "throughput_1_replica": round(one, 2), "throughput_2_replicas": round(two, 2),
        "ray_scaling": round(two / one, 3),
        "direct_p50_update_ms": direct["p50_update_ms"], "direct_p95_update_ms": direct["p95_update_ms"],
        "ray_p50_update_ms": via_proxy["p50_update_ms"], "ray_p95_update_ms": via_proxy["p95_update_ms"],
    })
    if None not in (direct["p50_update_ms"], via_proxy["p50_update_ms"]):
        out["proxy_p50_ms"] = round(via_proxy["p50_update_ms"] - direct["p50_update_ms"], 1)
        out["proxy_p95_ms"] = round(via_proxy["p95_update_ms"] - direct["p95_update_ms"], 1)
    return out


def bench_ray_command(options: RayBenchOptions) -> int:
    # Ray's driver prints its cluster's messages (a replica being stopped...) on stdout: keep
    # stdout for the JSON alone
    with contextlib.redirect_stdout(sys.stderr):
        result = bench_ray(options)
    print(json.dumps(result, indent=1))
    return 0
