"""Files over the link of `harken serve --workers N` (cloud/hosting/engine_link.py): a front end's
OpenAI and Deepgram file requests run in the engine process's `Scheduler`, through its file passes,
so files batch with each other and with every front end's live streams, and `--max-files` /
`--file-queue` (429) hold for the whole server.

    front end (RemoteFiles)                             engine process (LinkFiles)
    await file_place()        ("file admit", t)     -->  scheduler.admit_file()
                              <--  ("file", t, "admitted" | "refused", error)
    transcribe / pieces /     FILE: head + pickled control + raw float32 audio
    stream_file               <--  ("file", f, "piece" | "done" | "events" | "failed", item)
    the caller cancelled      ("file cancel", f)    -->  the task cancelled: the file leaves its slot
    ticket.release()          ("file release", t)   -->  the ticket released

A file's audio crosses once, as its float32 bytes behind `FILE_HEAD` (the file's id, its ticket's
id or 0, the control's length) and the pickled control (what to run, language, context, limits):
it is never pickled. A link that closes (the front end died) cancels its files and releases its
tickets in the engine; a front end whose link closes fails its files (their clients get an error).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from ..inference.decoder_stream import EngineEvent, SessionOptions
from ..inference.offline import OfflinePiece, OfflineTranscript
from .file_stream import stream_file_events

log = logging.getLogger("harken.workers")

FILE = 3  # the message kind (engine_link.HEAD)
FILE_HEAD = struct.Struct("<III")  # file id, ticket id (0: none), control length


def file_message(head: struct.Struct, file_id: int, ticket_id: int, control: tuple, audio: np.ndarray) -> bytes:
    """One file as it crosses the link: `FILE_HEAD`, the pickled control, the float32 samples."""
    body = pickle.dumps(control, protocol=pickle.HIGHEST_PROTOCOL)
    data = np.ascontiguousarray(audio, dtype=np.float32).tobytes()
    return head.pack(FILE, FILE_HEAD.size + len(body) + len(data)) + FILE_HEAD.pack(file_id, ticket_id, len(body)) \
        + body + data


def parse_file(body: bytes) -> tuple[int, int, tuple, np.ndarray]:
    file_id, ticket_id, n = FILE_HEAD.unpack_from(body)
    control = pickle.loads(body[FILE_HEAD.size:FILE_HEAD.size + n])
    audio = np.frombuffer(body, dtype=np.float32, offset=FILE_HEAD.size + n)
    return file_id, ticket_id, control, audio


class LinkedModel:
    """What a front end knows of the engine's model: its tokenizer (prompt lengths, logprobs'
    bytes) and `describe()` (the model id the APIs name). Sent once as the front end starts."""

    def __init__(self, tokenizer, description: dict):
        self.tokenizer, self._description = tokenizer, description

    def describe(self) -> dict:
        return dict(self._description)


class RemoteTicket:
    """A place among the engine's `max_files + queue`, held for a front end's request."""

    def __init__(self, files: RemoteFiles, ticket_id: int):
        self._files, self.id = files, ticket_id
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._files._send(("file release", self.id))


class RemoteFiles:
    """The file side of `RemoteScheduler`: `file_place`, `transcribe`, `pieces`, `stream_file` as
    `Scheduler` has them, each a request to the engine process."""

    _send: Callable[[tuple], None]
    _write: Callable[[bytes], None]
    error: BaseException | None

    def _init_files(self, head: struct.Struct) -> None:
        self._head = head  # the link's message head (engine_link.HEAD), which owns the link's framing
        self._file_ids = itertools.count(1)
        self._files: dict[int, asyncio.Queue] = {}  # file or ticket id -> its answers

    async def file_place(self) -> RemoteTicket:
        """A place for one file (Overloaded from the engine: 429)."""
        tid = next(self._file_ids)
        kind, item = await self._ask(tid, ("file admit", tid))
        if kind != "admitted":
            raise item
        return RemoteTicket(self, tid)

    async def transcribe(self, audio, language: str | None = None, context: str = "", *, decode_limits: bool = True,
                         max_pass_s: float | None = None, ticket: RemoteTicket | None = None) -> OfflineTranscript:
        async for kind, item in self._run(("transcribe", language, context, decode_limits, max_pass_s), audio, ticket):
            if kind == "done":
                return item
        raise AssertionError("a file ends with its transcript or its error")

    async def pieces(self, audio, language: str | None = None, context: str = "", *, decode_limits: bool = True,
                     max_pass_s: float | None = None, ticket: RemoteTicket | None = None
                     ) -> AsyncIterator[OfflinePiece]:
        async for kind, item in self._run(("pieces", language, context, decode_limits, max_pass_s), audio, ticket):
            if kind == "piece":
                yield item

    async def stream_file(self, audio, options: SessionOptions = SessionOptions()) -> list[EngineEvent]:
        """`stream_file_events` in the engine process (a session of its engine, ahead of real time)."""
        async for kind, item in self._run(("events", options), audio, None):
            if kind == "events":
                return item
        raise AssertionError("a file ends with its events or its error")

    async def _ask(self, fid: int, message: tuple) -> tuple[str, Any]:
        if self.error is not None:
            raise self.error
        queue: asyncio.Queue = asyncio.Queue()
        self._files[fid] = queue
        try:
            self._send(message)
            return await queue.get()
        finally:
            del self._files[fid]

    async def _run(self, control: tuple, audio, ticket: RemoteTicket | None):
        """Send the file; yield (kind, item) until its last answer (raising its error)."""
        if self.error is not None:
            raise self.error
        fid = next(self._file_ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._files[fid] = queue
        done = False
        try:
            self._write(file_message(self._head, fid, ticket.id if ticket is not None else 0, control, np.asarray(audio)))
            while True:
                kind, item = await queue.get()
                if kind == "failed":
                    done = True
                    raise item
                done = kind in ("done", "events")
                yield kind, item
                if done:
                    return
        finally:
            del self._files[fid]
            if not done:
                self._send(("file cancel", fid))

    def _on_file(self, message: tuple) -> None:
        queue = self._files.get(message[1])
        if queue is not None:
            queue.put_nowait((message[2], message[3]))

    def _fail_files(self, error: BaseException) -> None:
        for queue in self._files.values():
            queue.put_nowait(("failed", error))


class LinkFiles:
    """One front end's files in the engine process: its tickets and the tasks running its files."""

    def __init__(self, scheduler, send: Callable[[tuple], None]):
        self.scheduler, self._send = scheduler, send
        self.tickets: dict[int, Any] = {}  # ticket id -> FileTicket
        self.tasks: dict[int, asyncio.Task] = {}  # file id -> its run

    def control(self, message: tuple) -> bool:
        """A file's control message (True), or not one (False)."""
        what = message[0]
        if what == "file admit":
            tid = message[1]
            try:
                self.tickets[tid] = self.scheduler.admit_file()
            except Exception as e:  # noqa: BLE001 - Overloaded (the front end's 429)
                self._answer(tid, "refused", e)
            else:
                self._answer(tid, "admitted", None)
        elif what == "file release":
            ticket = self.tickets.pop(message[1], None)
            if ticket is not None:
                ticket.release()
        elif what == "file cancel":
            task = self.tasks.get(message[1])
            if task is not None:
                task.cancel()
        else:
            return False
        return True

    def file(self, body: bytes) -> None:
        fid, tid, control, audio = parse_file(body)
        ticket = self.tickets.get(tid) if tid else None
        task = asyncio.get_running_loop().create_task(self._run(fid, control, audio.copy(), ticket),
                                                      name=f"file-{fid}")
        self.tasks[fid] = task
        task.add_done_callback(lambda _: self.tasks.pop(fid, None))

    async def _run(self, fid: int, control: tuple, audio: np.ndarray, ticket) -> None:
        s = self.scheduler
        try:
            if control[0] == "events":
                self._answer(fid, "events", await stream_file_events(s, audio, control[1]))
                return
            _, language, context, decode_limits, max_pass_s = control
            if control[0] == "pieces":
                async for piece in s.pieces(audio, language, context, decode_limits=decode_limits,
                                            max_pass_s=max_pass_s, ticket=ticket):
                    self._answer(fid, "piece", piece)
                self._answer(fid, "done", None)
            else:
                self._answer(fid, "done", await s.transcribe(audio, language, context, decode_limits=decode_limits,
                                                             max_pass_s=max_pass_s, ticket=ticket))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - Overloaded, the model failed on it: the front end's error
            self._answer(fid, "failed", e)

    def _answer(self, fid: int, kind: str, item: Any) -> None:
        try:
            self._send(("file", fid, kind, item))
        except (pickle.PicklingError, TypeError, AttributeError):  # an error that does not pickle
            self._send(("file", fid, "failed", RuntimeError(f"{type(item).__name__}: {item}")))

    def close(self) -> None:
        """The front end is gone: its files leave their slots, its tickets are given back."""
        for task in list(self.tasks.values()):
            task.cancel()
        for ticket in self.tickets.values():
            ticket.release()
        self.tickets.clear()
