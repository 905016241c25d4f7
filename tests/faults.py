"""Network faults for the transport tests: a real TCP proxy that cuts connections.

`CuttingProxy` listens on a loopback port and forwards bytes both ways between each client
connection and the upstream server. Each connection is cut (both sockets aborted, so both peers
see a reset, as with a dropped network) after a byte budget drawn from a seeded generator, until
`max_cuts` cuts have happened; after that it forwards faithfully. Only the fault is simulated:
client and server are the real ones.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field


@dataclass
class CuttingProxy:
    """Forward 127.0.0.1:`port` -> `upstream_host`:`upstream_port`, cutting connections.

    A connection is cut once `budget` bytes (both directions together) have crossed it, the budget
    drawn uniformly from [`min_bytes`, `max_bytes`] per connection; `max_cuts` bounds the cuts.
    For `down_s` seconds after a cut the network stays down: new connections are reset at once.
    """

    upstream_host: str
    upstream_port: int
    min_bytes: int = 2_000
    max_bytes: int = 12_000
    max_cuts: int = 12
    seed: int = 0
    down_s: float = 0.0
    cuts: int = 0
    connections: int = 0
    bytes_forwarded: int = 0
    port: int = 0
    closed: bool = False  # close() was called: the upstream is unreachable through this proxy
    _server: asyncio.AbstractServer | None = None
    _tasks: set[asyncio.Task] = field(default_factory=set)
    _stops: set[asyncio.Event] = field(default_factory=set)  # one per live connection
    _down_until: float = 0.0
    _stalled: set[asyncio.Event] = field(default_factory=set)  # connections that drop everything
    _rng: random.Random = field(init=False)

    def __post_init__(self):
        self._rng = random.Random(self.seed)

    async def start(self) -> CuttingProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stall(self) -> None:
        """From now on the live connections carry nothing, silently (no reset, no close): a
        network that drops packets. New connections work."""
        self._stalled.update(self._stops)

    def outage(self, down_s: float) -> None:
        """Cut every connection now and keep the network down for `down_s` seconds."""
        self.cuts += len(self._stops)
        self._down_until = asyncio.get_running_loop().time() + down_s
        for stop in list(self._stops):
            stop.set()

    async def close(self) -> None:
        self.closed = True
        if self._server is not None:
            self._server.close()
        # stop the connections through their own exit path: start_server's callback reports a
        # handler that was cancelled from outside as an error
        for stop in list(self._stops):
            stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self.connections += 1
        upstream_writer = None
        try:
            if asyncio.get_running_loop().time() < self._down_until:
                return  # the network is down: reset
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(self.upstream_host,
                                                                                 self.upstream_port)
            except OSError:
                return  # upstream down: the client sees the connection close, like a refused one
            cutting = self.cuts < self.max_cuts
            budget = [self._rng.randint(self.min_bytes, self.max_bytes) if cutting else None]
            cut, stop = asyncio.Event(), asyncio.Event()
            self._stops.add(stop)
            pumps = [asyncio.create_task(self._pump(client_reader, upstream_writer, budget, cut, stop)),
                     asyncio.create_task(self._pump(upstream_reader, client_writer, budget, cut, stop))]
            waiters = [asyncio.create_task(cut.wait()), asyncio.create_task(stop.wait())]
            try:
                await asyncio.wait([*pumps, *waiters], return_when=asyncio.FIRST_COMPLETED)
                if cut.is_set():
                    self.cuts += 1
                    self._down_until = asyncio.get_running_loop().time() + self.down_s
            finally:
                for t in (*pumps, *waiters):
                    t.cancel()
                await asyncio.gather(*pumps, *waiters, return_exceptions=True)
                self._stops.discard(stop)
                self._stalled.discard(stop)
        finally:
            # abort, not close: a cut network delivers no orderly FIN
            client_writer.transport.abort()
            if upstream_writer is not None:
                upstream_writer.transport.abort()
            self._tasks.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, budget: list,
                    cut: asyncio.Event, connection: asyncio.Event) -> None:
        while True:
            data = await reader.read(4096)
            if not data:
                return
            if connection in self._stalled:
                continue  # dropped on the floor
            if budget[0] is not None:
                if len(data) >= budget[0]:
                    # forward the bytes up to the cut point, then cut mid-message
                    writer.write(data[:budget[0]])
                    self.bytes_forwarded += budget[0]
                    await writer.drain()
                    budget[0] = 0
                    cut.set()
                    return
                budget[0] -= len(data)
            writer.write(data)
            self.bytes_forwarded += len(data)
            await writer.drain()
