"""`harken serve`: the process around the service — the engine, the session table, the stream
handler (cloud/hosting/stream_handler.py) behind the gRPC server (cloud/adapters/grpc_service.py), health, reflection, metrics, TLS, WebRTC signaling — and its
graceful shutdown.

Also on the port: gRPC health (`grpc.health.v1`, service "" and "harken.v1.Transcription") and
reflection. Prometheus metrics on `--metrics-port`. JSON logs on stderr, without keys or transcript
text. Shutdown (SIGINT/SIGTERM, or `RunningServer.stop()`): refuse new streams, finalise every
open segment and send the finals to the attached clients (their streams then end UNAVAILABLE, so
they reconnect and, the server being gone, replay into a new one), then `server.stop(grace)`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from .base.auth import ApiKeys
from .inference.commit import CommitPolicy
from .base.errors import EngineFailed
from .adapters.grpc_service import GRPC_RECEIVE_CEILING, SERVICE_NAME, TranscriptionService, service_handler
from .base.metrics import MetricsEndpoint, ServerMetrics, serve_metrics
from .hosting.server_session import SessionLimits
from .hosting.session_table import SessionTable
from .hosting.stream_handler import MAX_MESSAGE_BYTES, StreamHandler
from ..shared import entropy_jit
from ..shared.errors import HarkenError
from .model.asr import Qwen3ASR
from .inference.engine import EngineConfig
from .inference.file_passes import FileConfig
from .inference.scheduler import Scheduler
from .inference.vllm_decoder import engine_class
from .inference.word_timings import SegmentAligner
from .model.aligner import Qwen3ForcedAligner

if TYPE_CHECKING:
    from grpc_health.v1 import health

    from .inference.engine import Engine
    from .adapters.http_app import HttpApp

log = logging.getLogger("harken.server")
_RELAYS: set[asyncio.Task] = set()  # a front end's watch on its engine link (kept referenced)


@dataclass(frozen=True)
class ServerOptions:
    """`harken serve` as a dataclass. Ports 0 pick free ones (see `RunningServer`)."""

    host: str = "127.0.0.1"
    port: int = 50051
    tls_cert: str | None = None  # PEM paths; both or neither
    tls_key: str | None = None
    api_keys: str | None = None  # keys file; None = open server
    metrics_port: int | None = None  # None = no metrics endpoint
    http_port: int | None = None  # the HTTP port (cloud/adapters/http_app.py): page, WebRTC, OpenAI, Deepgram; None = off
    cors_origins: tuple[str, ...] = ()  # origins whose pages may use the HTTP port ("*": any); () = same origin only
    max_sessions: int = 16
    max_sessions_per_key: int = 16
    # queued audio, in feature frames (100 a second): see SessionLimits and EngineConfig
    max_queued_frames: int = 100 * 60 * 10
    max_queued_frames_per_session: int = 100 * 60
    max_queued_frames_per_key: int = 100 * 60 * 4
    grace_s: float = 60.0  # a detached session waits this long for its client to resume
    idle_timeout_s: float = 30.0  # a stream sending nothing this long while no audio is pending: ended
    keepalive_time_s: float = 20.0  # gRPC keepalive pings to a connection quiet this long ...
    keepalive_timeout_s: float = 10.0  # ... and closed when one is not answered in this time
    replay_tail: int = 512  # events of final segments kept for a resume, behind the last one sent
    shutdown_grace_s: float = 5.0  # for finals on shutdown, then for server.stop()
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_batch: int = 32
    decode_threads: int = 2  # codec decoding and the thin clients' front end
    policy: CommitPolicy = field(default_factory=CommitPolicy)  # every session's commit policy
    decoder: str = "own"  # "vllm": the text decoder on vLLM (cloud/inference/vllm_decoder.py)
    decode_step: str = "plain"  # the own engine's decode step: plain, static or graphs (EngineConfig)
    # the file APIs on the HTTP port (cloud/adapters/openai_api.py, Deepgram's pre-recorded POST): upload and
    # audio limits; files are transcribed in the serving engine, `max_files` together, `file_queue` more waiting
    max_upload_bytes: int = 25 * 1024 * 1024
    max_audio_speed: float = 4.0  # a live stream's pace: x real time on average (0: none), see AudioPace
    audio_burst_s: float = 30.0  # ... and this much audio ahead of it
    max_file_s: float = 3 * 3600.0
    max_files: int = 8
    file_queue: int = 8
    # word timings (`harken serve --aligner`): a Qwen3-ForcedAligner (checkpoint dir, Hugging Face id or
    # "tiny") aligns every final segment of the sessions that ask (`Start.word_timings`); None: no
    # aligner, and such sessions are told so in their Ready (cloud/inference/word_timings.py)
    aligner: str | None = None
    # --workers: N front-end processes share the ports (SO_REUSEPORT) and one engine process
    # (cloud/workers.py); `reuse_port` is what each front end's listeners set
    workers: int = 0
    reuse_port: bool = False

    def __post_init__(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise HarkenError("--tls-cert and --tls-key go together")
        if self.max_sessions < 1 or self.max_sessions_per_key < 1:
            raise HarkenError("--max-sessions and --max-sessions-per-key must be >= 1")
        if not self.idle_timeout_s > 0 or not self.grace_s > 0:
            raise HarkenError("--idle-timeout-s and --grace-s must be > 0")
        if not (self.keepalive_time_s > 0 and self.keepalive_timeout_s > 0):
            raise HarkenError("keepalive_time_s and keepalive_timeout_s must be > 0")
        if self.cors_origins and self.http_port is None:
            raise HarkenError("--cors-origin needs --http-port (it is for the WebRTC and page port)")
        for origin in self.cors_origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/?#\s]+", origin):
                raise HarkenError(f"--cors-origin {origin!r} is no origin: scheme://host[:port] with no path "
                                  "(e.g. https://meet.example.com), or '*'")
        if self.max_audio_speed < 0 or self.audio_burst_s < 0:
            raise HarkenError("--max-audio-speed and --audio-burst-s must be >= 0")
        if self.max_upload_bytes < 1 or not self.max_file_s > 0 or self.max_files < 1:
            raise HarkenError("--max-upload-mb, --max-file-s and --max-files must be > 0")
        if self.file_queue < 0:
            raise HarkenError("--file-queue must be >= 0")
        if not 0 < self.max_queued_frames_per_session <= self.max_queued_frames_per_key < self.max_queued_frames:
            raise HarkenError("queued-audio limits must be 0 < per session <= per key < the server's")
        if self.workers < 0:
            raise HarkenError("--workers must be >= 1 (0: one process)")
        if self.workers and self.aligner is not None:
            raise HarkenError("--aligner does not go with --workers: word timings need the aligner beside "
                              "the sessions (serve without --workers)")
        if self.workers and self.metrics_port is not None:
            raise HarkenError("--metrics-port does not go with --workers yet: each front end holds its own "
                              "sessions' metrics (serve without --workers)")


# ---- the running server ------------------------------------------------------------------------

@dataclass
class RunningServer:
    """A started server. `port` and `metrics_port` are the real ones; `stop()` shuts it down
    gracefully (finals first) and releases everything it owns."""

    port: int
    metrics_port: int | None
    tls: bool
    host: str
    metrics: ServerMetrics
    _grpc: grpc.aio.Server
    _table: SessionTable
    _scheduler: Scheduler
    _executor: ThreadPoolExecutor
    _health: health.aio.HealthServicer
    _metrics_endpoint: MetricsEndpoint | None
    _options: ServerOptions
    _engine_watch: asyncio.Task
    _stopped: bool = False
    http: HttpApp | None = None  # the HTTP port's application, when `http_port` was given

    @property
    def engine(self) -> Engine:
        """The engine serving every session (`cloud/scheduler.Engine`): counters for benchmarks."""
        return self._scheduler.engine

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def stop(self, grace_s: float | None = None) -> None:
        if self._stopped:
            return
        self._stopped = True
        grace = self._options.shutdown_grace_s if grace_s is None else grace_s
        t0 = time.monotonic()
        await self._health.enter_graceful_shutdown()
        held = len(self._table.sessions)
        await self._table.finish_all(timeout_s=grace)
        await self._grpc.stop(grace)
        if self.http is not None:
            await self.http.close()
        await self._table.close()
        self._engine_watch.cancel()
        await asyncio.wait([self._engine_watch])
        try:
            await self._scheduler.stop()
        except Exception:  # the engine failed earlier; that was logged when it happened
            pass
        self._executor.shutdown(wait=True)
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.close()
        log.info("server stopped", extra={"fields": {"sessions_finalised": held,
                                                     "seconds": round(time.monotonic() - t0, 3)}})

    async def wait_for_termination(self) -> None:
        await self._grpc.wait_for_termination()


async def start_server(model, options: ServerOptions = ServerOptions(),
                       clock: Callable[[], float] = time.monotonic, aligner=None, scheduler=None) -> RunningServer:
    """Start the service on the running event loop. `model`: a loaded `Qwen3ASR`, or a name for
    `Qwen3ASR.load` ("tiny", "synth-en", a Hugging Face id, a local dir). `clock` times grace
    periods and idle streams (tests pass a fake one). `aligner`: a loaded `Qwen3ForcedAligner` for
    word timings (else `options.aligner`, loaded here, or none). `scheduler`: a front end of
    `--workers` (cloud/workers.py): the engine process's, as a `RemoteScheduler`; `model` is then None."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection


    keys = ApiKeys.load(options.api_keys) if options.api_keys else None
    credentials = _tls_credentials(options)
    asr = await asyncio.to_thread(Qwen3ASR.load, model) if isinstance(model, str) else model
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", GRPC_RECEIVE_CEILING * options.max_message_bytes),
        ("grpc.max_send_message_length", options.max_message_bytes),
        ("grpc.so_reuseport", 1 if options.reuse_port else 0),
        # Ping every connection quiet for keepalive_time_s, and close it when a ping is not answered
        # in keepalive_timeout_s: a client whose network vanished (no reset) is detached then, and
        # its session's grace period starts, instead of holding the stream until the idle timeout.
        ("grpc.keepalive_time_ms", round(options.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", round(options.keepalive_timeout_s * 1000)),
        # the wait for a ping's ack that gRPC core (1.85) enforces; without it a keepalive ping into a
        # dead connection went unanswered for as long as a test waited
        ("grpc.http2.ping_timeout_ms", round(options.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # a stream in a long silence carries no data
        # clients may send their own keepalive pings down to every 10 s, with or without a call
        # (the default of 5 minutes ends their connections with GOAWAY too_many_pings)
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ])
    address = f"{_bracketed(options.host)}:{options.port}"
    try:  # bind first: a port in use fails before anything else has started
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as e:
        raise HarkenError(f"cannot listen on {address} ({e})") from e

    loop = asyncio.get_running_loop()
    core = await start_core(asr, options, clock, aligner, scheduler=scheduler)
    metrics, engine_failed, scheduler, executor, table = (core.metrics, core.engine_failed, core.scheduler,
                                                          core.executor, core.table)
    handler = StreamHandler(table, keys, metrics, options.max_message_bytes)
    server.add_generic_rpc_handlers([service_handler(TranscriptionService(handler))])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def watch_engine():
        """If the engine fails, no session can go on: say so to every stream and to health checks."""
        await engine_failed.wait()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await table.fail_all(EngineFailed("the engine failed: reconnect to another server"))

    watch = loop.create_task(watch_engine(), name="engine-watch")
    endpoint = None
    if options.metrics_port is not None:
        endpoint = serve_metrics(metrics, options.host, options.metrics_port)
    if keys is None:
        log.warning("no --api-keys: the server accepts every caller", extra={"fields": {}})
    log.info("server started", extra={"fields": {"port": port, "tls": credentials is not None,
                                                 "metrics_port": endpoint.port if endpoint else None,
                                                 "max_sessions": options.max_sessions,
                                                 "idle_timeout_s": options.idle_timeout_s}})
    http = None
    if options.http_port is not None:
        from .adapters.http_app import start_http
        from .adapters.openai_api import ApiLimits

        http = await start_http(handler, keys, options.host, options.http_port, options.cors_origins,
                                ApiLimits(max_upload_bytes=options.max_upload_bytes,
                                          max_audio_s=options.max_file_s),
                                reuse_port=options.reuse_port)
    return RunningServer(port=port, metrics_port=endpoint.port if endpoint else None,
                         tls=credentials is not None, host=options.host, metrics=metrics, _grpc=server,
                         _table=table, _scheduler=scheduler, _executor=executor, _health=health_servicer,
                         _metrics_endpoint=endpoint, _options=options, _engine_watch=watch, http=http)


@dataclass
class ServingCore:
    """One engine and the sessions it serves: what a `harken serve` process holds, and what each
    replica of the Ray Serve application holds (cloud/ray_app.py)."""

    metrics: ServerMetrics
    scheduler: Scheduler
    executor: ThreadPoolExecutor
    table: SessionTable
    engine_failed: asyncio.Event  # set (on the core's loop) when an engine step raised

    async def close(self, grace_s: float) -> None:
        """Finalise every open segment (finals to the attached streams, up to `grace_s`), then
        release the sessions, the engine and the decode threads."""
        await self.table.finish_all(timeout_s=grace_s)
        await self.table.close()
        try:
            await self.scheduler.stop()
        except Exception:  # the engine failed earlier; that was logged when it happened
            pass
        self.executor.shutdown(wait=True)


async def start_engine(asr, options: ServerOptions, metrics: ServerMetrics, engine_failed: asyncio.Event,
                       aligner=None) -> Scheduler:
    """The engine (`asr`: a loaded `Qwen3ASR`) with its scheduler started, on the running event
    loop; `engine_failed` is set when a tick fails for good. With an aligner (`aligner` loaded, or
    `options.aligner` by name) the scheduler also times final words."""
    loop = asyncio.get_running_loop()
    engine = engine_class(options.decoder)(
        asr, EngineConfig(max_sessions=options.max_sessions, max_batch=options.max_batch,
                          max_queued_frames=options.max_queued_frames, slot_policy=options.policy,
                          decode_step=options.decode_step),
        _EngineMetrics(metrics, on_failure=lambda: loop.call_soon_threadsafe(engine_failed.set)))
    # --decode-step graphs: every bucket now, not in a live tick; off the event loop (a Ray replica's
    # loop is already serving while it starts)
    await asyncio.to_thread(engine.capture_decode_graphs)
    scheduler = Scheduler(engine, await _segment_aligner(asr, options, aligner),
                          FileConfig(max_files=options.max_files, queue=options.file_queue))
    await scheduler.start()
    return scheduler


async def start_core(asr, options: ServerOptions, clock: Callable[[], float] = time.monotonic,
                     aligner=None, scheduler=None) -> ServingCore:
    """The engine (`start_engine`) and an empty session table (timing grace periods and idle
    streams on `clock`), on the running event loop. `scheduler` given (a --workers front end's
    `RemoteScheduler`): the table's sessions go to it, and no engine starts here."""

    metrics = ServerMetrics()
    engine_failed = asyncio.Event()
    if scheduler is None:
        scheduler = await start_engine(asr, options, metrics, engine_failed, aligner)
        engine = scheduler.engine
    else:
        engine = scheduler.engine
        failed = scheduler.failed

        async def relay() -> None:
            await failed.wait()
            engine_failed.set()
        _RELAYS.add(task := asyncio.get_running_loop().create_task(relay(), name="engine-link-watch"))
        task.add_done_callback(_RELAYS.discard)
    executor = ThreadPoolExecutor(max_workers=options.decode_threads, thread_name_prefix="harken-decode")
    await asyncio.to_thread(entropy_jit.warm)  # the codec's compiled walk: now, not in a stream's first packet
    limits = SessionLimits(max_sessions=options.max_sessions,
                           max_sessions_per_key=options.max_sessions_per_key,
                           grace_s=options.grace_s, idle_timeout_s=options.idle_timeout_s,
                           replay_tail=options.replay_tail, policy=options.policy,
                           max_queued_frames_per_session=options.max_queued_frames_per_session,
                           max_queued_frames_per_key=options.max_queued_frames_per_key,
                           max_audio_speed=options.max_audio_speed, audio_burst_s=options.audio_burst_s)
    table = SessionTable(scheduler, limits, metrics, executor, clock)
    metrics.read_at_scrape(attached_streams=table.attached_streams, ready_sessions=engine.ready_sessions)
    return ServingCore(metrics, scheduler, executor, table, engine_failed)


async def _segment_aligner(asr, options: ServerOptions, aligner):
    """The scheduler's `SegmentAligner` (word timings), or None when the server has no aligner."""
    if aligner is None and options.aligner is None:
        return None

    if aligner is None:
        name = options.aligner
        assert name is not None  # (checked above)
        aligner = await asyncio.to_thread(Qwen3ForcedAligner.load, name, device=getattr(asr, "device", None))
    log.info("word timings on", extra={"fields": {"aligner": aligner.source or options.aligner}})
    return SegmentAligner(aligner)


def _tls_credentials(options: ServerOptions):
    if options.tls_cert is None or options.tls_key is None:  # both or neither (ServerOptions)
        return None
    try:
        with open(options.tls_key, "rb") as f:
            key = f.read()
        with open(options.tls_cert, "rb") as f:
            cert = f.read()
    except OSError as e:
        raise HarkenError(f"cannot read the TLS key or certificate ({e.strerror}: {e.filename})") from e
    return grpc.ssl_server_credentials([(key, cert)])


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class _EngineMetrics:
    """The engine's reports -> the server's metrics; a failed tick also calls `on_failure()` (from
    the engine's thread): the Scheduler's task ends then, and without it every session would wait
    for events forever. (The sessions waiting for the model are read at scrape time:
    `Engine.ready_sessions`.)"""

    def __init__(self, metrics: ServerMetrics, on_failure: Callable[[], object]):
        self.metrics = metrics
        self.on_failure = on_failure

    def tick(self, sessions: int) -> None:
        self.metrics.batch_size.observe(sessions)

    def truncated(self, reason: str) -> None:
        self.metrics.decode_truncated.labels(reason).inc()

    def deferred(self) -> None:
        self.metrics.passes_deferred.inc()

    def failed(self, error: BaseException) -> None:
        log.error("engine step failed", exc_info=error, extra={"fields": {}})
        self.on_failure()
