"""The asyncio owner of an `Engine` (cloud/inference/engine.py): one task steps it in a worker thread.

API:

    scheduler = Scheduler(engine); await scheduler.start()
    sid, events = scheduler.open_session(options)       # asyncio.Queue of EngineEvent; an
                                                        # Exception instead = the session failed
    scheduler.ingest(sid, ...) / ingest_packet / finalize / close_session(sid)
    scheduler.align(sid, segment_id, features, text, start_s, language)   # with an aligner: word
                                                        # timings (a SegmentWords on the queue later)
    await scheduler.next_tick()                         # until the next tick has ended
    await scheduler.stop()

With a `SegmentAligner` (`harken serve --aligner`), each tick also runs one bounded aligner pass when
segments wait for their word timings, in the same worker thread after the engine's passes: the model
work of a tick stays on one thread, off the event loop, and timings wait at most one tick behind.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from typing import TYPE_CHECKING

import numpy as np

from .engine import Engine, TickFailed
from .decoder_stream import SessionOptions

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

    def __init__(self, engine: Engine, aligner: SegmentAligner | None = None):
        self.engine = engine
        self.aligner = aligner  # word timings of final segments (None: this server has no aligner)
        self.queues: dict[str, asyncio.Queue] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stopping = False
        self._reported: set[str] = set()  # failed sessions whose queue has the exception
        self._tick_waiters: list[asyncio.Future] = []
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

    def _has_work(self) -> bool:
        return self.engine.has_work() or (self.aligner is not None and self.aligner.pending() > 0)

    def _tick(self, emit) -> list:
        """One tick, in the worker thread: the engine's passes (each pass's events go to `emit` as it
        finishes), then one aligner pass if segments wait."""
        if self.engine.has_work():
            emit(self.engine.step(emit))  # the tick's last passes: out before the aligner's pass
        return self.aligner.step() if self.aligner is not None and self.aligner.pending() else []

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
                try:
                    events = await loop.run_in_executor(self._executor, self._tick, emit)
                except TickFailed as e:
                    self._deliver(e.events)
                    self._ticked()
                    failures += 1
                    logging.getLogger(__name__).exception("engine tick failed (%d in a row)", failures)
                    if failures >= self.MAX_TICK_FAILURES:
                        self.error = e.__cause__ or e
                        for q in self.queues.values():
                            q.put_nowait(self.error)
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
