"""A file as a session of the serving engine, fed ahead of real time: the subtitle formats' source.

    events = await stream_file_events(scheduler, audio, SessionOptions(language="English"))

`harken transcribe --format srt|vtt` takes a file through the edge pipeline and a streaming engine on
audio time (cloud/embedded.py `stream_audio`: 100-ms pieces, the engine caught up after each), its
cues the engine's segments. The file APIs' `srt`, `vtt` and `verbose_json` are the same, in the
serving engine: each piece goes in as the edge would send it, and the next one after the engine owes
the session nothing more, so the session's passes (and its events) are those `stream_audio` gives,
whoever else the engine serves. The session runs ahead of real time, so live ones go first
(cloud/inference/priority.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..inference.decoder_stream import EngineEvent, SessionOptions
from ...edge.pipeline import FeatureStream
from ...edge.vad import VadOptions
from ...shared.codec import DEFAULT_MODE
from ...shared.features_spec import SAMPLE_RATE

if TYPE_CHECKING:
    from ..inference.scheduler import Scheduler

PIECE_SECONDS = 0.1  # as `stream_audio`


async def stream_file_events(scheduler: Scheduler, audio: np.ndarray, options: SessionOptions = SessionOptions()
                             ) -> list[EngineEvent]:
    """The events `stream_audio(audio, engine, options)` gives, from a session of `scheduler`'s engine
    (Overloaded when the engine is full). The session is closed at the end, or when cancelled. A
    --workers front end's `RemoteScheduler` has the session run in the engine process, by this
    function there (its `stream_file`, cloud/hosting/file_link.py)."""
    forward = getattr(scheduler, "stream_file", None)
    if forward is not None:
        return await forward(audio, options)
    edge = FeatureStream(VadOptions(), mode=DEFAULT_MODE)
    sid, queue = scheduler.open_session(options)
    events: list[EngineEvent] = []
    step = max(1, int(round(PIECE_SECONDS * SAMPLE_RATE)))
    try:
        for i in range(0, len(audio), step):
            await _feed(scheduler, sid, edge.push(audio[i:i + step]), queue, events)
        await _feed(scheduler, sid, edge.flush(), queue, events)
        scheduler.finalize(sid)
        await _caught_up(scheduler, sid, queue, events)
    finally:
        scheduler.close_session(sid)
    return events


async def _feed(scheduler: Scheduler, sid: str, packets, queue, events: list[EngineEvent]) -> None:
    for packet in packets:
        scheduler.ingest_packet(sid, packet)
    await _caught_up(scheduler, sid, queue, events)


async def _caught_up(scheduler: Scheduler, sid: str, queue, events: list[EngineEvent]) -> None:
    """Wait until the engine owes the session nothing (its passes done), taking its events."""
    while scheduler.engine.working_on(sid) or scheduler.ticking:  # a tick in flight: its events too
        if scheduler.error is not None:
            raise scheduler.error
        await scheduler.next_tick()
    while not queue.empty():
        item = queue.get_nowait()
        if isinstance(item, BaseException):
            raise item
        events.append(item)
    error = scheduler.engine.failure(sid)
    if error is not None:
        raise error
