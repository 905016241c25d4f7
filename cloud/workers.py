"""`harken serve --workers N`: host work past one core. N front-end processes hold the
transports (gRPC, and with --http-port WebRTC and the Realtime API) and the sessions, all on the
same ports (SO_REUSEPORT: the kernel spreads new connections over them); one engine process, this
one, owns the model and its `Scheduler` (one per GPU). Each front end talks to the engine over a
Unix socket of its own (cloud/hosting/engine_link.py: frames as raw float32 behind a fixed struct,
the rare rest pickled).

    engine process  Qwen3ASR, Engine, Scheduler, EngineLinks; reserves the ports; starts,
                    watches and restarts the front ends
    front end i     start_server(scheduler=RemoteScheduler): gRPC + HTTP listeners (reuse_port),
                    SessionTable, HostedSessions, codec decode; `python -m harken.cloud.workers FD`

A front end that dies (kill -9, a crash) takes its sessions with it: the engine process closes
their engine sessions when its link closes and starts a new front end. Their clients reconnect (to
any front end), their resume gets NOT_FOUND, and they replay into seeded sessions (edge/client/),
so no committed word is lost (tests/test_workers.py). Shutdown (SIGINT/SIGTERM to the engine
process): each front end shuts down as one server does (finals first, the engine still serving),
then the engine stops. Not with --workers: --aligner, --metrics-port (ServerOptions), --ray.
The file APIs (OpenAI's, Deepgram's pre-recorded POST) are served by every front end: each file goes
to the engine process whole (cloud/hosting/file_link.py) and runs in its Scheduler's file passes; a
front end knows the model by its tokenizer and description (`LinkedModel`, sent as it starts).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import socket
import sys
from dataclasses import dataclass, field, replace

from .adapters.logs import configure_logging
from .base.metrics import ServerMetrics
from .hosting.engine_link import CONTROL, EngineLinks, RemoteScheduler, _control, read_message
from .hosting.file_link import LinkedModel
from .server import ServerOptions, _bracketed, start_engine, start_server
from ..shared import entropy_jit
from ..shared.errors import HarkenError

log = logging.getLogger("harken.workers")

FRONT_END_START_S = 120.0  # a front end's start (imports, listeners) before it counts as failed
RESTART_PAUSE_S = 0.2


def _reserve(host: str, port: int) -> socket.socket:
    """A bound, not listening socket with SO_REUSEPORT: fixes the port (a free one for 0) for the
    front ends, which listen on it beside it (the kernel hands connections to listeners only)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise HarkenError(f"cannot listen on {_bracketed(host)}:{port} ({e.strerror})") from e
    return s


@dataclass
class Workers:
    """The engine process's view of a running `--workers` server."""

    options: ServerOptions  # the front ends' (real ports, reuse_port)
    scheduler: object
    links: EngineLinks
    reserved: list[socket.socket]
    model: LinkedModel | None = None  # what the front ends know of the model
    procs: dict[int, asyncio.subprocess.Process] = field(default_factory=dict)
    restarts: int = 0
    engine_failed: asyncio.Event = field(default_factory=asyncio.Event)  # no front end can serve: none restarts
    _watches: dict[int, asyncio.Task] = field(default_factory=dict)
    _serving: set[asyncio.Task] = field(default_factory=set)
    _stopping: bool = False

    @property
    def port(self) -> int:
        return self.options.port

    @property
    def http_port(self) -> int | None:
        return self.options.http_port

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    @property
    def engine(self):
        return self.scheduler.engine  # type: ignore[attr-defined]

    def front_end_pids(self) -> dict[int, int]:
        return {i: p.pid for i, p in self.procs.items() if p.returncode is None}

    async def spawn(self, index: int) -> None:
        """Start front end `index` and wait until it listens."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # no model there: one thread is plenty
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "harken.cloud.workers", str(theirs.fileno()), pass_fds=(theirs.fileno(),),
                env=env)
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        writer.write(_control(("options", self.options, index, self.model)))
        ready = asyncio.get_running_loop().create_future()

        def on_message(message: tuple) -> bool:
            if message[0] == "ready":
                if not ready.done():
                    ready.set_result(message)
                return True
            return False

        serving = asyncio.get_running_loop().create_task(self.links.serve(index, reader, writer, on_message),
                                                         name=f"link-{index}")
        self._serving.add(serving)
        serving.add_done_callback(self._serving.discard)
        self.procs[index] = proc
        exited = asyncio.ensure_future(proc.wait())
        done, _ = await asyncio.wait([ready, exited], timeout=FRONT_END_START_S,
                                     return_when=asyncio.FIRST_COMPLETED)
        if ready not in done:
            exited.cancel()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            raise HarkenError(f"front end {index} did not start (exit {proc.returncode})")
        exited.cancel()
        log.info("front end started", extra={"fields": {"front_end": index, "pid": proc.pid}})
        self._watches[index] = asyncio.get_running_loop().create_task(self._watch(index, proc),
                                                                      name=f"watch-{index}")

    async def _watch(self, index: int, proc: asyncio.subprocess.Process) -> None:
        """Restart front end `index` when it dies (unless the server is stopping)."""
        code = await proc.wait()
        if self._stopping or self.engine_failed.is_set():
            return  # a failed engine ends the server (`serve_workers` exits 1), not a loop of restarts
        log.warning("front end died: starting a new one", extra={"fields": {"front_end": index, "pid": proc.pid,
                                                                             "exit": code}})
        self.restarts += 1
        while not self._stopping and not self.engine_failed.is_set():
            await asyncio.sleep(RESTART_PAUSE_S)
            try:
                await self.spawn(index)
                return
            except HarkenError:
                log.exception("front end restart failed", extra={"fields": {"front_end": index}})

    async def stop(self, grace_s: float | None = None) -> None:
        """Each front end shuts down as a server does (finals first, the engine serving them),
        then the engine stops."""
        self._stopping = True
        grace = self.options.shutdown_grace_s if grace_s is None else grace_s
        for w in self._watches.values():
            w.cancel()
        for proc in self.procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                await asyncio.wait_for(proc.wait(), 2 * grace + 10)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        await self.links.stop()
        try:
            await self.scheduler.stop()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - the engine failed earlier; that was logged then
            pass
        for s in self.reserved:
            s.close()


async def start_workers(asr, options: ServerOptions) -> Workers:
    """The engine on this process's loop (`asr`: a loaded Qwen3ASR) and `options.workers` front
    ends listening on `options.port` (and `http_port`; 0: free ones, the same for all)."""
    n = options.workers
    if n < 1:
        raise HarkenError("--workers must be >= 1")
    reserved = [_reserve(options.host, options.port)]
    port = reserved[0].getsockname()[1]
    http_port = options.http_port
    if http_port is not None:
        reserved.append(_reserve(options.host, http_port))
        http_port = reserved[1].getsockname()[1]
    engine_failed = asyncio.Event()
    scheduler = await start_engine(asr, options, ServerMetrics(), engine_failed)
    links = EngineLinks(scheduler)
    links.start()
    front = replace(options, port=port, http_port=http_port, reuse_port=True, workers=0)
    workers = Workers(front, scheduler, links, reserved, LinkedModel(asr.tokenizer, asr.describe()),
                      engine_failed=engine_failed)

    async def watch_engine() -> None:
        await engine_failed.wait()
        links.engine_failed(scheduler.error or RuntimeError("the engine failed"))

    workers._serving.add(asyncio.get_running_loop().create_task(watch_engine(), name="engine-watch"))
    try:
        for i in range(n):
            await workers.spawn(i)
    except BaseException:
        await workers.stop(0)
        raise
    return workers


# ---- a front-end process --------------------------------------------------------------------------

def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the engine process dies (no orphaned listeners)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


async def _front_end(fd: int) -> int:
    sock = socket.socket(fileno=fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    kind, body = await read_message(reader)
    assert kind == CONTROL
    what, options, index, model = pickle.loads(body)
    assert what == "options"
    remote = RemoteScheduler(writer, options.max_sessions, model)
    link = asyncio.get_running_loop().create_task(remote.run(reader), name="engine-link")
    await asyncio.to_thread(entropy_jit.warm)
    running = await start_server(None, options, scheduler=remote)
    writer.write(_control(("ready", index, os.getpid())))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    gone = loop.create_task(remote.failed.wait())
    stopping = loop.create_task(stop.wait())
    await asyncio.wait([gone, stopping], return_when=asyncio.FIRST_COMPLETED)
    await running.stop(0 if remote.failed.is_set() else None)
    writer.close()
    link.cancel()
    return 0 if stop.is_set() else 1


def main(argv: list[str]) -> int:
    _die_with_parent()
    configure_logging()
    return asyncio.run(_front_end(int(argv[0])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
