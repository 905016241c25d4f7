"""harken on Ray Serve: many engines behind one gRPC address, sessions sticky to their replica.

    client ──gRPC──> Serve's gRPC proxy ──(ConsistentHashRouter on the `session_id` metadata)──>
        replica: `TranscriptionReplica` = one engine + scheduler + SessionTable (`ServingCore`),
                 its `Stream` run by the same stream handler as `harken serve`

The proxy carries harken's bidirectional `Stream` as it is (`gRPCInputStream` in, `ServerMessage`s
out); the requests stay bytes up to the servicer (`add_transcription_servicer` registers the
method without a request deserializer), so malformed input is INVALID_ARGUMENT exactly as on a
plain server. Every call of one client stream carries the same `session_id` metadata (the SDK's
`ClientSession.route_key`), so its resumes reach the replica that holds the session; a replica
that does not (it died, or was scaled down) answers NOT_FOUND and the client replays the stream's
unfinished segments into a new, seeded session on another replica: the transcript comes out the
same. Each replica admits `max_sessions` sessions, which is also its `max_ongoing_requests` (one
request = one stream). Autoscaling follows harken's own load signal: every replica reports its
sessions and the sessions waiting for the model (`record_autoscaling_stats`), and
`autoscaling_policy` sizes the deployment to keep sessions at `target_utilization` of the slots.

`harken serve --ray` (`serve_ray_command`) starts it; `serve run harken.cloud.ray_app:app_builder
model=tiny` runs it from Serve's own CLI or a config file (deploy/ray-serve.yaml).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import signal
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from .base.auth import ApiKeys
from .adapters.logs import configure_logging
from .adapters.grpc_service import service_handler
from .server import ServerOptions, ServingCore, start_core
from .hosting.stream_handler import StreamFailed, StreamHandler
from ..shared.errors import HarkenError
from .model.asr import Qwen3ASR

APP_NAME = "harken"
DEPLOYMENT_NAME = "TranscriptionReplica"
# The proxy's registration of harken's service (an import path: the proxy imports it itself).
SERVICER_FUNCTIONS = ["harken.cloud.ray_app.add_transcription_servicer",
                      "harken.cloud.ray_app.add_health_servicer"]
# Trailing metadata on every stream: which replica served it (for operators and the tests).
REPLICA_METADATA = "harken-replica"
LOCAL_OBJECT_STORE_BYTES = 256 << 20
# Drain on scale-down (`TranscriptionReplica._drain_when_stopping`): how often a replica reads its
# state, after how many failed reads it says so, and Serve's deadline beyond shutdown_grace_s.
DRAIN_POLL_S = 0.5
# Each poll reads the whole deployment's details at the controller (O(replicas)), and every
# replica polls: the fleet keeps to this many polls a second in all (each replica waits longer the
# more replicas there are), so the controller's load grows with the fleet, not with its square.
DRAIN_POLLS_PER_S = 20.0
DRAIN_POLL_TIMEOUT_S = 2.0  # a poll that takes longer counts as failed
DRAIN_POLL_FAILURES = 5
DRAIN_MARGIN_S = 5.0
ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"


@dataclass(frozen=True)
class Scaling:
    """`--replicas N` (fixed) or `--autoscale MIN:MAX`."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_utilization: float = 0.75  # autoscaling: sessions held / session slots, fleet-wide
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas > self.min_replicas

    @classmethod
    def parse(cls, replicas: int | None, autoscale: str | None, **kw) -> Scaling:
        if replicas is not None and autoscale is not None:
            raise HarkenError("give --replicas N or --autoscale MIN:MAX, not both")
        if autoscale is not None:
            lo, sep, hi = autoscale.partition(":")
            if not sep or not lo.isdigit() or not hi.isdigit() or not 1 <= int(lo) <= int(hi):
                raise HarkenError(f"--autoscale wants MIN:MAX with 1 <= MIN <= MAX, not {autoscale!r}")
            return cls(int(lo), int(hi), **kw)
        n = 1 if replicas is None else replicas
        if n < 1:
            raise HarkenError("--replicas must be >= 1")
        return cls(n, n, **kw)


# ---- the proxy's side: service registration ---------------------------------------------------

def add_transcription_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """For `gRPCOptions.grpc_servicer_functions`: harken.v1.Transcription, requests as bytes."""
    server.add_generic_rpc_handlers([service_handler(servicer)])


def add_health_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """grpc.health.v1.Health/Check through the proxy (answered by a replica: `Check` below), so
    `harken health` and Kubernetes' gRPC probes work unchanged."""
    from grpc_health.v1 import health_pb2_grpc

    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)


# ---- the replica -------------------------------------------------------------------------------

class TranscriptionReplica:
    """One replica: one engine and its sessions (made a Serve deployment by `deployment()`)."""

    # Serve awaits an async __init__ (Ray actors support it; type checkers do not)
    async def __init__(self, model: str, options: ServerOptions,  # type: ignore[misc]
                       keys: ApiKeys | None = None, device: str | None = None, dtype: str | None = None):
        from ray import serve


        configure_logging()
        if options.decode_threads < 1:
            raise HarkenError("decode_threads must be >= 1")
        asr = await asyncio.to_thread(Qwen3ASR.load, model, dtype=dtype, device=device)
        self.options = options
        self.core: ServingCore = await start_core(asr, options)
        self.handler = StreamHandler(self.core.table, keys, self.core.metrics, options.max_message_bytes)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.app, self.deployment = context.app_name, context.deployment  # `serve run` names the app "default"
        self._closing: asyncio.Task | None = None
        self._drain_watch = asyncio.create_task(self._drain_when_stopping())

    async def Stream(self, request_stream, grpc_context):
        """harken.v1.Transcription/Stream: the same stream handler as `harken serve`. Its error status
        is set on the context before the `Error` message that precedes it goes out: Serve sends
        the context along with each message, and a status set after the last one would be lost
        (Serve's `RayServegRPCContext` has no `abort`)."""
        grpc_context.set_trailing_metadata([(REPLICA_METADATA, self.replica_id)])
        try:
            async with aclosing(self.handler.run_proto(grpc_context.invocation_metadata(), request_stream)) as messages:
                async for message in messages:
                    if message.WhichOneof("kind") == "error":
                        grpc_context.set_code(grpc.StatusCode[message.error.code])
                        grpc_context.set_details(message.error.message)
                    yield message
        except StreamFailed:
            return  # the status is on the context already

    async def Check(self, request):
        """grpc.health.v1.Health/Check: SERVING while the engine runs."""
        from grpc_health.v1 import health_pb2

        status = (health_pb2.HealthCheckResponse.NOT_SERVING if self.core.engine_failed.is_set()
                  else health_pb2.HealthCheckResponse.SERVING)
        return health_pb2.HealthCheckResponse(status=status)

    async def check_health(self) -> None:
        """Serve's replica health check: a replica whose engine failed is replaced."""
        if self.core.engine_failed.is_set():
            raise RuntimeError("the engine failed")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """harken's load signal, for `autoscaling_policy`."""
        table = self.core.table
        waiting = self.core.metrics.registry.get_sample_value("harken_queue_depth") or 0.0
        return {"sessions": float(len(table.sessions)), "slots": float(self.options.max_sessions),
                "waiting": float(waiting)}

    async def held_sessions(self) -> dict[str, Any]:
        """Which replica this is and the sessions it holds (operators' debugging; the tests)."""
        from ray import serve

        return {"replica": self.replica_id,
                "actor": serve.get_replica_context().replica_id.to_full_id_str(),
                "sessions": sorted(self.core.table.sessions)}

    async def _drain_when_stopping(self) -> None:
        """Drain on scale-down. Serve stops a leaving replica by waiting for its requests to end
        and only then calling `__del__`; a live stream never ends by itself, so Serve would kill
        the replica at its deadline with the open segments unfinished (their clients would
        replay them elsewhere: no words lost, but work redone and finals late). So the replica
        watches its own state at the controller: once it is STOPPING (Serve routes it nothing
        new), it finalises every open segment, sends the finals and ends its streams UNAVAILABLE;
        their clients resume, get NOT_FOUND on the replica their key now reaches, and go on in a
        new session there from the first packet not yet final."""
        failures, replicas = 0, 1
        while True:
            await asyncio.sleep(drain_poll_interval(replicas) * random.uniform(0.75, 1.25))  # jitter: polls spread
            try:
                state, replicas = await asyncio.wait_for(replica_state(self.app, self.deployment, self.replica_id),
                                                         DRAIN_POLL_TIMEOUT_S)
            except Exception as e:  # the controller moved or its API changed: Serve's own stop still applies
                failures += 1
                if failures == DRAIN_POLL_FAILURES:
                    logging.getLogger("harken.ray").warning(
                        "cannot read this replica's state from the Serve controller (%s): a scale-down "
                        "will end this replica's streams without finals; clients replay them", e)
                continue
            if state == "STOPPING":
                logging.getLogger("harken.ray").info("replica %s leaving: finalising its sessions", self.replica_id)
                await self._close()
                return

    async def _close(self) -> None:
        """`ServingCore.close` once, whoever asks first (the watch or `__del__`), awaited by both."""
        if self._closing is None:
            self._closing = asyncio.create_task(self.core.close(self.options.shutdown_grace_s))
        await asyncio.shield(self._closing)

    async def __del__(self):
        """Shutdown (or a scale-down the watch missed): finalise the open segments, send their finals."""
        if self._closing is None:
            self._drain_watch.cancel()
        await self._close()


_controller: Any = None


def drain_poll_interval(replicas: int) -> float:
    """How long a replica waits between reads of its state: DRAIN_POLL_S in a small fleet, longer
    in a large one (DRAIN_POLLS_PER_S in all), at most half of Serve's margin beyond
    `shutdown_grace_s`, so that a leaving replica notices in time to finalise its segments."""
    return min(max(DRAIN_POLL_S, replicas / DRAIN_POLLS_PER_S), DRAIN_MARGIN_S / 2)


async def replica_state(app: str, deployment_name: str, replica_id: str) -> tuple[str | None, int]:
    """A replica's state at the Serve controller ("RUNNING", "STOPPING", ...; None: unknown), and
    how many replicas the deployment has.
    (The controller's own details call, which Serve's REST API and CLI use; Serve has no public
    per-replica call.) The controller's handle is looked up once, off the event loop (a GCS call)."""
    global _controller
    if _controller is None:
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        _controller = await asyncio.to_thread(ray.get_actor, SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    details = await _controller.get_deployment_details.remote(app, deployment_name)
    for r in details.replicas:
        if r.replica_id == replica_id:
            return str(getattr(r.state, "value", r.state)), len(details.replicas)
    return None, len(details.replicas)


def autoscaling_policy(ctx) -> tuple[int, dict]:
    """Serve's custom autoscaling policy on harken's own load: enough replicas that the fleet's
    sessions fill `target_utilization` of its session slots, and one more while sessions wait for
    the model on every replica. `ctx`: ray.serve.config.AutoscalingContext."""
    metrics = ctx.aggregated_metrics or {}
    sessions = sum((metrics.get("sessions") or {}).values())
    slots = max((metrics.get("slots") or {}).values(), default=0.0)
    waiting = metrics.get("waiting") or {}
    target = float(ctx.config.policy.policy_kwargs.get("target_utilization", 0.75)) if ctx.config else 0.75
    if slots <= 0:  # no report yet: stay where we are
        return ctx.target_num_replicas, {}
    desired = math.ceil(sessions / (slots * target)) if sessions else ctx.capacity_adjusted_min_replicas
    if waiting and min(waiting.values()) > 0:
        desired = max(desired, ctx.current_num_replicas + 1)
    return max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, desired)), {}


def deployment(model: str, options: ServerOptions, scaling: Scaling, keys: ApiKeys | None = None,
               device: str | None = None, dtype: str | None = None):
    """The Serve application: `TranscriptionReplica` with sticky routing, one request per
    session slot, fixed or autoscaled replicas."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

    config: dict[str, Any] = {
        "max_ongoing_requests": options.max_sessions,
        "request_router_config": RequestRouterConfig(request_router_class=ROUTER,  # type: ignore[arg-type]
                                                     request_router_kwargs={"num_fallback_replicas": 0}),
        "ray_actor_options": {"num_cpus": scaling.replica_cpus, "num_gpus": scaling.replica_gpus},
        # a replica leaving finalises its sessions (`_drain_when_stopping`, up to shutdown_grace_s),
        # its streams end, then Serve calls `__del__`: the margin covers the poll and Serve's loop
        "graceful_shutdown_timeout_s": options.shutdown_grace_s + DRAIN_MARGIN_S,
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    if scaling.autoscaling:
        config["autoscaling_config"] = AutoscalingConfig(
            min_replicas=scaling.min_replicas, max_replicas=scaling.max_replicas,
            policy=AutoscalingPolicy(policy_function=autoscaling_policy,
                                     policy_kwargs={"target_utilization": scaling.target_utilization}))
    else:
        config["num_replicas"] = scaling.min_replicas
    d = serve.deployment(name=DEPLOYMENT_NAME, **config)(TranscriptionReplica)
    return d.bind(model, options, keys, device, dtype)


def app_builder(args: dict[str, str]):
    """`serve run harken.cloud.ray_app:app_builder model=M [replicas=N | autoscale=MIN:MAX]
    [max_sessions=N] [api_keys=FILE] [device=D] [dtype=T] [aligner=M]`, or the same under `args:` in a
    Serve config file (`aligner`: word timings, each replica loads it as `harken serve --aligner`)."""
    options = ServerOptions(max_sessions=int(args.get("max_sessions", 16)),
                            max_sessions_per_key=int(args.get("max_sessions_per_key", args.get("max_sessions", 16))),
                            aligner=args.get("aligner") or None)
    replicas = args.get("replicas")
    scaling = Scaling.parse(int(replicas) if replicas else None, args.get("autoscale"),
                            replica_cpus=float(args.get("replica_cpus", 1)),
                            replica_gpus=float(args.get("replica_gpus", 0)))
    keys = ApiKeys.load(args["api_keys"]) if args.get("api_keys") else None
    return deployment(args.get("model", "Qwen/Qwen3-ASR-0.6B"), options, scaling, keys,
                      args.get("device"), args.get("dtype"))


# ---- running it --------------------------------------------------------------------------------

@dataclass
class RayServing:
    """A running Serve application (`start_ray`); `stop()` shuts Serve down."""

    host: str
    port: int
    handle: Any = field(repr=False)
    deployed: tuple = field(repr=False, default=())  # deployment()'s arguments but the scaling

    def redeploy(self, replicas: int) -> None:
        """Deploy the application again with `replicas` replicas. (Serve's imperative `serve.run`
        gives each deploy a new code version: every replica is replaced, a rolling update, each
        old one draining as it leaves. A declarative config (`serve deploy`, KubeRay) changing only
        `num_replicas`, and the autoscaler, stop just the replicas that leave.)"""
        from ray import serve

        model, options, keys, device, dtype, scaling = self.deployed
        scaling = replace(scaling, min_replicas=replicas, max_replicas=replicas)
        self.handle = serve.run(deployment(model, options, scaling, keys, device, dtype), name=APP_NAME,
                                route_prefix=f"/{APP_NAME}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def replica_of(self, route_key: str) -> dict[str, Any]:
        """`held_sessions()` of the replica that streams with this `session_id` metadata reach
        (the router hashes the handle call's session id the same way)."""
        return self.handle.options(session_id=route_key).held_sessions.remote().result()

    def stop(self) -> None:
        from ray import serve

        serve.shutdown()


def start_ray(model: str, options: ServerOptions, scaling: Scaling, keys: ApiKeys | None = None,
              device: str | None = None, dtype: str | None = None, serve_http_port: int = 8000) -> RayServing:
    """Deploy on the Ray cluster this process is connected to (`ray.init` first): Serve's gRPC
    proxy on `options.host:options.port` (Serve's HTTP proxy, unused by harken, on
    `serve_http_port`), the application, its replicas ready."""
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    serve.start(http_options=HTTPOptions(host=options.host, port=serve_http_port),
                grpc_options=gRPCOptions(port=options.port, grpc_servicer_functions=SERVICER_FUNCTIONS))
    handle = serve.run(deployment(model, options, scaling, keys, device, dtype), name=APP_NAME,
                       route_prefix=f"/{APP_NAME}")
    return RayServing(options.host, options.port, handle, (model, options, keys, device, dtype, scaling))


def serve_ray_command(model: str, options: ServerOptions, scaling: Scaling, device: str | None = None,
                      dtype: str | None = None) -> int:
    """`harken serve --ray`: join the Ray cluster of $RAY_ADDRESS, or start a local one; serve
    until SIGINT/SIGTERM."""
    unavailable = {"--tls-cert": "Serve's gRPC proxy speaks plaintext: terminate TLS in front of it",
                   "--metrics-port": "each replica's metrics go to Ray's Prometheus export",
                   "--http-port": "WebRTC is served by `harken serve` without --ray only"}
    for flag, value in (("--tls-cert", options.tls_cert), ("--metrics-port", options.metrics_port),
                        ("--http-port", options.http_port)):
        if value is not None:
            raise HarkenError(f"{flag} is not available with --ray ({unavailable[flag]})")
    try:
        import ray
    except ImportError as e:
        raise HarkenError("--ray needs Ray Serve: pip install 'harken[scale]'") from e
    configure_logging()
    keys = ApiKeys.load(options.api_keys) if options.api_keys else None
    if device and device.startswith("cuda") and scaling.replica_gpus == 0:
        scaling = replace(scaling, replica_gpus=1.0)
    address = os.environ.get("RAY_ADDRESS")
    # a local cluster: harken moves only small messages through Ray, a small object store will do
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
             object_store_memory=None if address else LOCAL_OBJECT_STORE_BYTES)
    try:
        running = start_ray(model, options, scaling, keys, device, dtype)
        mode = (f"autoscaling {scaling.min_replicas}:{scaling.max_replicas}" if scaling.autoscaling
                else f"{scaling.min_replicas} replica{'' if scaling.min_replicas == 1 else 's'}")
        print(f"harken: listening on grpc://{options.host}:{running.port} (Ray Serve, {mode})", flush=True)
        stop = asyncio.Event()

        async def wait() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()

        asyncio.run(wait())
        running.stop()
    finally:
        ray.shutdown()
    return 0


__all__ = ["Scaling", "TranscriptionReplica", "autoscaling_policy", "deployment", "app_builder", "start_ray",
           "serve_ray_command", "RayServing", "add_transcription_servicer", "add_health_servicer"]

