"""`harken serve`: load the model, serve until SIGINT/SIGTERM, shut down gracefully. One process
(cloud/server.py) or, with `--workers N`, an engine process and N front ends (cloud/workers.py):
the floor above both, so neither imports the other's way of being run."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from .adapters.logs import configure_logging
from .base.auth import ApiKeys
from .inference.vllm_decoder import check_decoder
from .model.asr import Qwen3ASR
from .server import ServerOptions, _bracketed, _tls_credentials, start_server
from .workers import start_workers

log = logging.getLogger("harken.server")


def serve_command(model: str, options: ServerOptions, device: str | None = None,
                  dtype: str | None = None) -> int:
    """Load the model, serve until SIGINT/SIGTERM, shut down gracefully. Prints the addresses it
    listens on, one line each, once ready. With `options.workers`: this process holds the engine,
    N front-end processes the ports and sessions (cloud/workers.py)."""
    configure_logging()

    # bad key or certificate files fail now, not after a model load of minutes
    if options.api_keys:
        ApiKeys.load(options.api_keys)
    _tls_credentials(options)

    check_decoder(options.decoder)  # without vLLM: one line saying how to install it, before the load
    asr = Qwen3ASR.load(model, dtype=dtype, device=device)
    if model == "tiny":
        log.warning("the tiny model has random weights: its transcripts are meaningless", extra={"fields": {}})
    aligner = None
    if options.aligner is not None:
        from .model.aligner import TINY_ALIGNER, Qwen3ForcedAligner

        aligner = Qwen3ForcedAligner.load(options.aligner, dtype=dtype, device=device)
        if options.aligner == TINY_ALIGNER:
            log.warning("the tiny aligner has random weights: its word times are meaningless", extra={"fields": {}})
    if options.workers:
        return asyncio.run(serve_workers(asr, options))
    return asyncio.run(_serve(asr, options, aligner))


async def _serve(asr, options: ServerOptions, aligner=None) -> int:
    running = await start_server(asr, options, aligner=aligner)
    scheme = "grpcs" if running.tls else "grpc"
    print(f"harken: listening on {scheme}://{_bracketed(options.host)}:{running.port}", flush=True)
    if running.http_port is not None:
        print(f"harken: WebRTC and the browser page on http://{_bracketed(options.host)}:{running.http_port}/",
              flush=True)
    if running.metrics_port is not None:
        print(f"harken: metrics on http://{_bracketed(options.host)}:{running.metrics_port}/metrics", flush=True)
    return await until_signalled(running.stop)


async def serve_workers(asr, options: ServerOptions) -> int:
    """`harken serve --workers N` until SIGINT/SIGTERM."""
    workers = await start_workers(asr, options)
    scheme = "grpcs" if options.tls_cert else "grpc"
    print(f"harken: listening on {scheme}://{_bracketed(options.host)}:{workers.port} "
          f"({options.workers} front-end processes, one engine)", flush=True)
    if workers.http_port is not None:
        print(f"harken: WebRTC and the browser page on http://{_bracketed(options.host)}:{workers.http_port}/",
              flush=True)
    return await until_signalled(workers.stop, failed=workers.engine_failed)


async def until_signalled(stop: Callable[[], Awaitable[object]], failed: asyncio.Event | None = None) -> int:
    """Wait for SIGINT or SIGTERM, then `stop()` (a graceful shutdown): 0. With `failed` (the engine's
    failure under --workers, where no front end can serve any more): stop when it is set too, 1, so
    a supervisor sees the process end rather than front ends restarting into a dead engine."""
    signalled = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signalled.set)
    waits = [loop.create_task(signalled.wait())] + ([loop.create_task(failed.wait())] if failed else [])
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await stop()
    if failed is not None and failed.is_set() and not signalled.is_set():
        log.error("the engine failed: the server stops", extra={"fields": {}})
        return 1
    return 0
