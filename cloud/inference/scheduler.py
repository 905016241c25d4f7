"""The asyncio owner of an `Engine` (cloud/inference/engine.py): one task steps it in a worker thread.

API:

    scheduler = Scheduler(engine); await scheduler.start()
    sid, events = scheduler.open_session(options)       # asyncio.Queue of EngineEvent; an
                                                        # Exception instead = the session failed
    scheduler.ingest(sid, ...) / ingest_packet / finalize / close_session(sid)
    scheduler.align(sid, segment_id, features, text, start_s, language)   # with an aligner: word
                                                        # timings (a SegmentWords on the queue later)
    await scheduler.next_tick()                         # until the next tick has ended
    text = (await scheduler.transcribe(audio, language)).text       # a file: `harken transcribe`'s
    async for piece in scheduler.pieces(audio, language): ...       # ... pass by pass
    ticket = scheduler.admit_file()                     # a place for a file (Overloaded: 429)
    ticket = await scheduler.file_place()               # ... as the file APIs take it
    await scheduler.stop()

With a `SegmentAligner` (`harken serve --aligner`), each tick also runs one bounded aligner pass when
segments wait for their word timings, in the same worker thread after the engine's passes: the model
work of a tick stays on one thread, off the event loop, and timings wait at most one tick behind.

Files (`transcribe`, `pieces`) are `harken transcribe`'s offline passes run by the same thread in
units of bounded cost (cloud/inference/file_passes.py): after each tick one unit, and more only
while no live work is due, so a live pass waits at most one unit for them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from typing import TYPE_CHECKING

import numpy as np

from .engine import Engine, TickFailed
from .decoder_stream import SessionOptions
from .file_passes import FileConfig, FileJob, FileListener, FilePasses, FileRequest, FileTicket
from .offline import OfflinePiece, OfflineTranscript

if TYPE_CHECKING:
    from .word_timings import SegmentAligner


class Scheduler:
    """The asyncio owner of an Engine: one task runs `step()` in a worker thread, one tick at a
    time, whenever input has made work; each session's events arrive on its own asyncio.Queue as
    soon as its pass has finished (mid-tick: a long pass of another session does not hold them).

    Failures: a session whose own processing raises gets that exception on its queue instead of
    further events (the others carry on). A tick that fails as a whole (the model: out of memory,
    a device error) is retried after a pause; after `MAX_TICK_FAILURES` in a row the scheduler
    stops, `error` holds the exception and every queue receives it.
    """

    MAX_TICK_FAILURES = 3
    FILE_ROUND_S = 0.05  # file units run back to back (no live work due) at most this long per round

    def __init__(self, engine: Engine, aligner: SegmentAligner | None = None, files: FileConfig = FileConfig()):
        self.engine = engine
        self.aligner = aligner  # word timings of final segments (None: this server has no aligner)
        self.files = FilePasses(engine.asr, files)  # whole files' offline passes, between ticks
        self.file_units = 0  # file units run so far
        self.queues: dict[str, asyncio.Queue] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stopping = False
        self._reported: set[str] = set()  # failed sessions whose queue has the exception
        self._tick_waiters: list[asyncio.Future] = []
        self.ticking = False  # a round is in the worker thread (its events are not all out yet)
        self.error: BaseException | None = None

    async def start(self) -> None:
        """Start the owner task (again after `stop`, if need be)."""
        if self._task is None:
            self._stopping = False
            self._wake.set()  # work that came in while stopped is due now
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="harken-engine")
            self._task = asyncio.create_task(self._run(), name="harken-scheduler")

    async def stop(self) -> None:
        """Finish the tick in flight, then stop (the worker thread cannot be interrupted mid-tick)."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:
                await self._task
            finally:
                self._task = None
                if self._executor is not None:  # set with the task
                    self._executor.shutdown(wait=True)
                self._executor = None
                self.files.fail_all(RuntimeError("the server is stopping"))

    def open_session(self, options: SessionOptions = SessionOptions(), session_id: str | None = None
                     ) -> tuple[str, asyncio.Queue]:
        sid = self.engine.open_session(options, session_id)
        self.queues[sid] = asyncio.Queue()
        return sid, self.queues[sid]

    def close_session(self, sid: str) -> None:
        self.queues.pop(sid, None)
        self._reported.discard(sid)
        if self.aligner is not None:
            self.aligner.drop(sid)
        self.engine.close_session(sid)

    def ingest(self, sid: str, *args, **kwargs) -> int:
        n = self.engine.ingest(sid, *args, **kwargs)
        self._wake.set()
        return n

    def ingest_packet(self, sid: str, packet) -> int:
        n = self.engine.ingest_packet(sid, packet)
        self._wake.set()
        return n

    def finalize(self, sid: str) -> None:
        self.engine.finalize(sid)
        self._wake.set()

    def configure(self, sid: str, context: str) -> None:
        self.engine.configure(sid, context)

    def align(self, sid: str, segment_id: int, features: np.ndarray | None, text: str, start_s: float,
              language: str) -> None:
        """Queue a final segment for its word timings (`SegmentAligner.submit`): a later tick puts a
        `SegmentWords` on the session's queue. Only with an aligner."""
        if self.aligner is None:
            raise RuntimeError("this scheduler has no aligner")
        self.aligner.submit(sid, segment_id, features, text, start_s, language)
        self._wake.set()

    # -- files ---------------------------------------------------------------------------------

    def admit_file(self) -> FileTicket:
        """A place for one file among `max_files + queue` (`FilePasses.admit`): Overloaded past them."""
        return self.files.admit()

    async def file_place(self) -> FileTicket:
        """`admit_file` as the file APIs take it: awaited, as a --workers front end asks the engine
        process for it (cloud/hosting/file_link.py)."""
        return self.admit_file()

    async def transcribe(self, audio, language: str | None = None, context: str = "", *,
                         decode_limits: bool = True, max_pass_s: float | None = None,
                         ticket: FileTicket | None = None) -> OfflineTranscript:
        """`harken transcribe`'s transcript of 16 kHz mono `audio` (`transcribe_audio`), from the
        serving engine's thread. Cancelled (the client left): the file leaves at the next unit."""
        out: OfflineTranscript | None = None
        async for item in self._file(FileRequest(audio, language, context, decode_limits, max_pass_s), ticket):
            if isinstance(item, OfflineTranscript):
                out = item
        assert out is not None  # _file ends with the transcript or raises
        return out

    async def pieces(self, audio, language: str | None = None, context: str = "", *, decode_limits: bool = True,
                     max_pass_s: float | None = None, ticket: FileTicket | None = None
                     ) -> AsyncIterator[OfflinePiece]:
        """The same passes' pieces, each as soon as it is done (`transcript_text` joins them)."""
        async for item in self._file(FileRequest(audio, language, context, decode_limits, max_pass_s), ticket):
            if isinstance(item, OfflinePiece):
                yield item

    async def _file(self, request: FileRequest, ticket: FileTicket | None):
        if self.error is not None:
            raise self.error
        queue: asyncio.Queue = asyncio.Queue()
        job: FileJob = self.files.submit(request, _QueueListener(asyncio.get_running_loop(), queue), ticket)
        self._wake.set()
        done = False
        try:
            while True:
                kind, item = await queue.get()
                if kind == "failed":
                    done = True
                    raise item
                yield item
                if kind == "done":
                    done = True
                    return
        finally:
            if not done:
                self.files.cancel(job)
                self._wake.set()

    # -- the worker thread ------------------------------------------------------------------------

    def _has_work(self) -> bool:
        return self._live_work() or self.files.has_work()

    def _live_work(self) -> bool:
        return self.engine.has_work() or (self.aligner is not None and self.aligner.pending() > 0)

    def _tick(self, emit) -> list:
        """One round, in the worker thread: the engine's passes (each pass's events go to `emit` as
        it finishes), then one aligner pass if segments wait, then file units: one, and more while
        no live work is due (for at most FILE_ROUND_S)."""
        events = []
        if self.engine.has_work():
            emit(self.engine.step(emit))  # the tick's last passes: out before the aligner's pass
        if self.aligner is not None and self.aligner.pending():
            events = self.aligner.step()
        if self.files.has_work():
            emit(events)
            events = []
            t0 = time.perf_counter()
            while self.files.has_work():
                try:
                    moved = self.files.step()
                except Exception as e:  # noqa: BLE001 - a fault of the files' own code: theirs only
                    logging.getLogger(__name__).exception("file passes failed")
                    self.files.fail_all(e)
                    break
                self.file_units += moved is not None
                if moved is None or self._live_work() or time.perf_counter() - t0 > self.FILE_ROUND_S:
                    break
        return events

    async def next_tick(self) -> None:
        """Wait until the next tick has ended (queued frames may have gone down by then)."""
        waiter = asyncio.get_running_loop().create_future()
        self._tick_waiters.append(waiter)
        await waiter

    def _ticked(self) -> None:
        waiters, self._tick_waiters = self._tick_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        failures = 0

        def emit(events: list) -> None:  # in the worker thread, mid-tick: onto the loop, in order
            loop.call_soon_threadsafe(self._put, events)

        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            while not self._stopping and self._has_work():
                self.ticking = True
                try:
                    try:
                        events = await loop.run_in_executor(self._executor, self._tick, emit)
                    finally:
                        self.ticking = False
                except TickFailed as e:
                    self._deliver(e.events)
                    self._ticked()
                    failures += 1
                    logging.getLogger(__name__).exception("engine tick failed (%d in a row)", failures)
                    if failures >= self.MAX_TICK_FAILURES:
                        self.error = e.__cause__ or e
                        for q in self.queues.values():
                            q.put_nowait(self.error)
                        self.files.fail_all(self.error)
                        return
                    await asyncio.sleep(0.2 * failures)
                    continue
                failures = 0
                self._deliver(events)
                self._ticked()

    def _put(self, events: list) -> None:
        for sid, event in events:
            q = self.queues.get(sid)
            if q is not None:
                q.put_nowait(event)

    def _deliver(self, events: list) -> None:
        self._put(events)
        for sid, q in self.queues.items():
            if sid not in self._reported and (err := self.engine.failure(sid)) is not None:
                self._reported.add(sid)
                q.put_nowait(err)


class _QueueListener(FileListener):
    """A file's news, from the engine's thread onto its requester's asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue = loop, queue

    def piece(self, piece: OfflinePiece) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("piece", piece))

    def done(self, transcript: OfflineTranscript) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("done", transcript))

    def failed(self, error: BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("failed", error))
