"""The link between a front-end process and the engine process of `harken serve --workers N`
(cloud/workers.py): one Unix socket per front end.

    front end                                        engine process
    RemoteScheduler.open_session / close / ...  -->  ("open", h, sid, options) ... pickled: rare
    RemoteScheduler.ingest (every packet)       -->  FRAMES: a fixed struct + raw float32 frames
    the sessions' queues  <-- ("events", [(h, event or exception), ...])  per tick, pickled
    the local mirror      <-- ("status", {h: (frames received, queued, working)}, engine sessions,
                               this front end's opens and closes taken) per tick / 0.1 s
                          <-- ("engine failed", error)
    files (file_link.py)  --> FILE: a head, the pickled control, raw float32 audio; <-- ("file", ...)

Frames are never pickled: a packet's frames go as `FRAME_HEAD` (handle, segment, first frame, frame
count, start, end, running max) and the [128, k] float32 array's bytes. Control messages and the
engine's events (a few per session and second) are pickled. Every message is `HEAD` (kind, body
length) and its body.

`RemoteScheduler` is what the front end's sessions see in place of a `Scheduler`: it answers the
session layer's synchronous questions (`queued_frames`, `working_on`, `ready_sessions`) from a local
mirror (the engine's last status, plus what this front end has sent since), so no message waits for
a round trip; what it asks of the engine goes out at once without waiting for an answer. A session
is refused before its Ready when the mirror counts the engine full: the engine's session count at its
last status plus this front end's opens and closes it had not taken yet. Opens from other front ends
since that status can still fill the engine: its refusal then comes back as the session's failure on
its event queue (after the Ready). Files (`transcribe`, `pieces`, the subtitles' session) are
forwarded whole to the engine process's Scheduler (file_link.py).
`EngineLinks` is the engine process's side: it applies each front end's messages to the one
`Scheduler`, routes events back, and closes a front end's sessions when its socket closes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..base.errors import EngineFailed
from .file_link import FILE, LinkedModel, LinkFiles, RemoteFiles
from ...shared.errors import Overloaded, SessionNotFound
from ...shared.features_spec import N_MELS

log = logging.getLogger("harken.workers")

HEAD = struct.Struct("<BI")  # kind, body length
FRAMES, CONTROL = 1, 2
# handle, segment id, first frame, frame count, segment start, segment end, running max (NaN: none)
FRAME_HEAD = struct.Struct("<IqqIBBd")
STATUS_EVERY_S = 0.1  # the engine's status to each front end at least this often, and after each tick


def _control(message: tuple) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEAD.pack(CONTROL, len(body)) + body


def frames_message(handle: int, segment_id: int, first_frame: int, frames: np.ndarray, segment_start: bool,
                   segment_end: bool, running_max_log10: float | None) -> bytes:
    """One packet's frames as they cross the link: the fixed head, then the float32 bytes."""
    data = np.ascontiguousarray(frames, dtype=np.float32).tobytes()
    head = FRAME_HEAD.pack(handle, segment_id, first_frame, frames.shape[1], segment_start, segment_end,
                           math.nan if running_max_log10 is None else running_max_log10)
    return HEAD.pack(FRAMES, len(head) + len(data)) + head + data


def parse_frames(body: bytes) -> tuple[int, int, int, np.ndarray, bool, bool, float | None]:
    handle, segment_id, first_frame, k, start, end, running = FRAME_HEAD.unpack_from(body)
    frames = np.frombuffer(body, dtype=np.float32, offset=FRAME_HEAD.size, count=N_MELS * k).reshape(N_MELS, k)
    return handle, segment_id, first_frame, frames, bool(start), bool(end), None if math.isnan(running) else running


async def read_message(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(kind, body) of the next message; IncompleteReadError at the end of the stream."""
    kind, n = HEAD.unpack(await reader.readexactly(HEAD.size))
    return kind, await reader.readexactly(n)


# ---- the front end's side -------------------------------------------------------------------------

@dataclass
class _Mirror:
    """What the front end knows of one engine session: frames sent, and the engine's last word."""

    sid: str
    queue: asyncio.Queue
    sent: int = 0  # frames sent to the engine
    received: int = 0  # frames the engine had taken at its last status
    queued: int = 0  # ... and not encoded yet
    working: bool = False  # ... and a pass due or in flight


class RemoteScheduler(RemoteFiles):
    """The engine of another process, as the session layer uses a `Scheduler` (see the module
    docstring). `engine` is itself: `queued_frames`, `working_on`, `ready_sessions` from the mirror;
    `asr` the engine's model as far as the APIs need it (`LinkedModel`). No aligner (word timings
    are refused with --workers)."""

    aligner = None

    def __init__(self, writer: asyncio.StreamWriter, max_sessions: int, asr: LinkedModel | None = None):
        self._writer = writer
        self.max_sessions = max_sessions
        self.asr = asr
        self._init_files(HEAD)
        self.engine_sessions = 0  # the engine's sessions at its last status (every front end's)
        self._changes = 0  # opens and closes sent
        self._unseen: list[tuple[int, int]] = []  # (change number, +1 open / -1 close) not in that count yet
        self.sessions: dict[int, _Mirror] = {}
        self._handles: dict[str, int] = {}
        self._next_handle = 1
        self._tick_waiters: list[asyncio.Future] = []
        self.error: BaseException | None = None
        self.failed = asyncio.Event()  # the engine failed, or the link to it broke

    @property
    def engine(self) -> RemoteScheduler:
        return self

    # what the sessions ask of the engine
    def open_session(self, options: Any, session_id: str | None = None) -> tuple[str, asyncio.Queue]:
        if self.error is not None:
            raise self.error
        if len(self.sessions) >= self.max_sessions or self.engine_full():
            raise Overloaded(f"the engine serves {self.max_sessions} sessions at most")
        assert session_id is not None  # the session table names every session
        h = self._next_handle
        self._next_handle += 1
        m = _Mirror(session_id, asyncio.Queue())
        self.sessions[h], self._handles[session_id] = m, h
        self._change(+1)
        self._send(("open", h, session_id, options))
        return session_id, m.queue

    def close_session(self, sid: str) -> None:
        h = self._handles.pop(sid, None)
        if h is not None:
            del self.sessions[h]
            self._change(-1)
            self._send(("close", h))

    def engine_full(self) -> bool:
        """The engine's sessions as the mirror counts them (its last status, plus this front end's
        opens and closes since) at its maximum."""
        return self.engine_sessions + sum(d for _, d in self._unseen) >= self.max_sessions

    def _change(self, delta: int) -> None:
        self._changes += 1
        self._unseen.append((self._changes, delta))

    def ingest(self, sid: str, segment_id: int, first_frame: int, frames: np.ndarray, segment_start: bool = False,
               segment_end: bool = False, running_max_log10: float | None = None) -> int:
        """Send the frames; -> the frames sent (the count the in-process engine gives serves the
        aligner only, which --workers has not)."""
        h = self._handle(sid)
        m = self.sessions[h]
        k = frames.shape[1]
        m.sent += k
        self._writer.write(frames_message(h, segment_id, first_frame, frames, segment_start, segment_end,
                                          running_max_log10))
        return k

    def finalize(self, sid: str) -> None:
        self._send(("finalize", self._handle(sid)))

    def configure(self, sid: str, context: str) -> None:
        self._send(("configure", self._handle(sid), context))

    def align(self, *args, **kwargs) -> None:
        raise RuntimeError("this scheduler has no aligner")

    async def next_tick(self) -> None:
        """Until the engine's next status (after its next tick, or STATUS_EVERY_S)."""
        waiter = asyncio.get_running_loop().create_future()
        self._tick_waiters.append(waiter)
        await waiter

    # the mirror
    def queued_frames(self, sid: str) -> int:
        m = self.sessions[self._handle(sid)]
        return m.queued + max(0, m.sent - m.received)

    def working_on(self, sid: str) -> bool:
        h = self._handles.get(sid)
        if h is None:
            return False
        m = self.sessions[h]
        return m.working or m.sent > m.received

    def ready_sessions(self) -> int:
        return sum(1 for m in self.sessions.values() if m.working)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def _handle(self, sid: str) -> int:
        h = self._handles.get(sid)
        if h is None:
            raise SessionNotFound(f"no session {sid!r}")
        return h

    def _send(self, message: tuple) -> None:
        if not self._writer.is_closing():
            self._writer.write(_control(message))

    def _write(self, data: bytes) -> None:
        if self.error is not None or self._writer.is_closing():
            raise self.error or EngineFailed("the link to the engine process closed")
        self._writer.write(data)

    # what the engine says
    async def run(self, reader: asyncio.StreamReader) -> None:
        """Read the engine's messages until the link closes; then every session fails."""
        try:
            while True:
                kind, body = await read_message(reader)
                if kind == CONTROL:
                    self._on(pickle.loads(body))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            if self.error is None:
                self._fail(EngineFailed("the link to the engine process closed"))

    def _on(self, message: tuple) -> None:
        what = message[0]
        if what == "events":
            for h, item in message[1]:
                m = self.sessions.get(h)
                if m is not None:
                    m.queue.put_nowait(item)
        elif what == "file":
            self._on_file(message)
        elif what == "status":
            for h, (received, queued, working) in message[1].items():
                m = self.sessions.get(h)
                if m is not None:
                    m.received, m.queued, m.working = received, queued, working
            self.engine_sessions, seen = message[2], message[3]
            self._unseen = [(n, d) for n, d in self._unseen if n > seen]
            waiters, self._tick_waiters = self._tick_waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)
        elif what == "engine failed":
            self._fail(message[1])

    def _fail(self, error: BaseException) -> None:
        self.error = error
        for m in self.sessions.values():
            m.queue.put_nowait(error)
        self._fail_files(error)
        for w in self._tick_waiters:
            if not w.done():
                w.set_result(None)
        self.failed.set()


# ---- the engine process's side ------------------------------------------------------------------

class _LinkQueue:
    """Stands in for a session's asyncio.Queue in the engine process's `Scheduler`: what the
    scheduler puts goes to the front end (batched per loop turn)."""

    def __init__(self, link: EngineLink, handle: int):
        self.link, self.handle = link, handle

    def put_nowait(self, item: Any) -> None:
        self.link.outbox.append((self.handle, item))
        self.link.flush_soon()


@dataclass
class EngineLink:
    """One front end as the engine process sees it."""

    index: int
    writer: asyncio.StreamWriter
    sids: dict[int, str] = field(default_factory=dict)  # handle -> engine session id
    received: dict[int, int] = field(default_factory=dict)  # handle -> frames taken
    outbox: list = field(default_factory=list)
    changes: int = 0  # opens and closes taken (the front end's mirror counts them too)
    files: LinkFiles | None = None
    _flush: asyncio.Handle | None = None

    def send(self, message: tuple) -> None:
        if not self.writer.is_closing():
            self.writer.write(_control(message))

    def flush_soon(self) -> None:
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._flush = None
        if self.outbox:
            events, self.outbox = self.outbox, []
            self.send(("events", events))


class EngineLinks:
    """The engine process's end of every front end's link, on its one `Scheduler`."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.links: dict[int, EngineLink] = {}
        self.statuses = 0  # status rounds sent
        self._status_task: asyncio.Task | None = None

    def start(self) -> None:
        self._status_task = asyncio.get_running_loop().create_task(self._statuses(), name="link-status")

    async def stop(self) -> None:
        if self._status_task is not None:
            self._status_task.cancel()
            await asyncio.wait([self._status_task])

    async def serve(self, index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    on_message: Callable[[tuple], bool] = lambda m: False) -> None:
        """Apply one front end's messages until its socket closes; then close its sessions.
        `on_message` sees each control message first (True: taken, e.g. the front end's "ready")."""
        link = self.links[index] = EngineLink(index, writer)
        files = link.files = LinkFiles(self.scheduler, link.send)
        if self.scheduler.error is not None:
            link.send(("engine failed", self.scheduler.error))
        try:
            while True:
                kind, body = await read_message(reader)
                if kind == FRAMES:
                    self._ingest(link, body)
                elif kind == FILE:
                    files.file(body)
                elif kind == CONTROL:
                    message = pickle.loads(body)
                    if not on_message(message) and not files.control(message):
                        self._control(link, message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            files.close()
            if self.links.get(index) is link:
                del self.links[index]
            for sid in link.sids.values():
                self._close(sid)
            writer.close()

    def _ingest(self, link: EngineLink, body: bytes) -> None:
        h, segment_id, first_frame, frames, start, end, running = parse_frames(body)
        sid = link.sids.get(h)
        if sid is None:
            return  # refused at open, or closed: the front end has its failure
        link.received[h] = link.received.get(h, 0) + frames.shape[1]
        try:
            self.scheduler.ingest(sid, segment_id, first_frame, frames, start, end, running)
        except Exception as e:  # noqa: BLE001 - this session's input (the front end checked its order): it fails
            self._refuse(link, h, e)

    def _control(self, link: EngineLink, message: tuple) -> None:
        what, h = message[0], message[1]
        if what in ("open", "close"):
            link.changes += 1
        if what == "open":
            sid, options = message[2], message[3]
            try:
                self.scheduler.open_session(options, sid)
            except Exception as e:  # noqa: BLE001 - Overloaded, a policy too long: the session's failure
                link.outbox.append((h, e))
                link.flush_soon()
                return
            link.sids[h] = sid
            self.scheduler.queues[sid] = _LinkQueue(link, h)
            return
        sid = link.sids.get(h)
        if sid is None:
            return
        try:
            if what == "close":
                del link.sids[h]
                link.received.pop(h, None)
                self._close(sid)
            elif what == "finalize":
                self.scheduler.finalize(sid)
            elif what == "configure":
                self.scheduler.configure(sid, message[2])
        except Exception as e:  # noqa: BLE001 - as for frames
            self._refuse(link, h, e)

    def _refuse(self, link: EngineLink, h: int, error: BaseException) -> None:
        sid = link.sids.pop(h, None)
        if sid is not None:
            self._close(sid)
        link.outbox.append((h, error))
        link.flush_soon()

    def _close(self, sid: str) -> None:
        try:
            self.scheduler.close_session(sid)
        except SessionNotFound:
            pass

    def engine_failed(self, error: BaseException) -> None:
        for link in self.links.values():
            link.flush()
            link.send(("engine failed", error))

    async def _statuses(self) -> None:
        """After each tick (or every STATUS_EVERY_S): each front end's sessions' frames taken,
        queued and whether a pass is due or in flight."""
        engine = self.scheduler.engine
        while True:
            try:
                await asyncio.wait_for(self.scheduler.next_tick(), STATUS_EVERY_S)
            except asyncio.TimeoutError:
                pass
            total = len(engine.sessions)
            for link in list(self.links.values()):
                link.flush()  # events first: a status never runs ahead of the events it follows
                status = {}
                for h, sid in link.sids.items():
                    try:
                        status[h] = (link.received.get(h, 0), engine.queued_frames(sid), engine.working_on(sid))
                    except SessionNotFound:
                        continue
                # (empty too: it answers the front end's next_tick)
                link.send(("status", status, total, link.changes))
            self.statuses += 1
