"""The meeting SDK: one session per participant track, one merged, time-ordered transcript.

```
meeting = Meeting("transcribe.example.com:443", api_key=KEY, tls=True)
meeting.add_track("alice", "alice.wav")          # a file, an array, or (async) PCM pieces
meeting.add_track("bob", bob_microphone_pieces)
async for line in meeting.lines():
    print(f"[{line.start_s:7.2f}] {line.speaker}: {line.text}")
```

Each track streams through its own `TranscriptionClient` (so each gets resume, replay and the
nothing-lost guarantee on its own); a line is a final segment of one track.

A track of several people (a room's one microphone): `add_track("room", source, diarize=True)` asks the
server for speaker labels, and that track's lines are `room/S1`, `room/S2`, ... beside the named
per-participant tracks. A relabel (the server found a recent segment to be another speaker's) changes
a line still held by the ordering rule; a line already out keeps the label it went out with.

Ordering rule. Lines come out sorted by (start_s, track order): exactly the order a sort of the
complete transcript would give, however the tracks' finals interleave in time. A line is held
until no other track can still produce a line that sorts before it. To know that, every track
reports, in band with its events, a lower bound on the start of any final it has not delivered
yet:

- feature mode: the earliest start among its segments that are open (sent, not final), and the
  earliest start the edge VAD could still give a segment it has not opened yet (the VAD's
  worst-case decision delay behind the newest audio, which `FeatureStream` keeps as look-back);
- thin-client mode (the server segments): just after the start of its last final segment, since a
  track's segments are final in order of their starts;
- a finished track: infinity.

A line (t, i) of track i is released once every other track j has (bound_j, j) > (t, i). Since a
track's own finals arrive in start order, its own later lines cannot sort before. A silent track
therefore holds nobody up for longer than the VAD's decision delay (feature mode), and a track
that has ended holds nobody up at all.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path

from .grpc_client import (AudioSource, ClientOptions, StreamProgress, TranscriptEvent,
                                   TranscriptionClient, TransportStats)
from ...shared.transcript import SpeakerChange


@dataclass(frozen=True)
class MeetingLine:
    """One final segment of one participant: who spoke when, and what they said."""

    speaker: str
    start_s: float
    end_s: float
    text: str
    segment_id: int = 0  # the segment within the speaker's track


@dataclass
class _Track:
    index: int
    speaker: str
    source: AudioSource
    bound_s: float = 0.0  # no line from this track will start before this any more
    client: TranscriptionClient | None = None
    diarize: bool = False  # several people: lines are `speaker/S1`, `speaker/S2`, ...


@dataclass
class _TrackFinal:
    index: int
    line: MeetingLine | None  # None: a final segment without text (it still moves the bound)
    bound_s: float


@dataclass
class _TrackBound:
    index: int
    bound_s: float


@dataclass
class _TrackRelabel:
    index: int
    segment_id: int
    speaker: str


@dataclass
class _TrackEnded:
    index: int


@dataclass
class _TrackFailed:
    index: int
    error: BaseException


@dataclass
class Meeting:
    """Several participant tracks -> one time-ordered transcript (see the module docstring).

    `target`, `api_key`, `tls` and `options` are those of `TranscriptionClient`; every track gets
    a client of its own with a copy of `options`.
    """

    target: str
    api_key: str | None = None
    tls: bool | str | Path | None = None
    options: ClientOptions = field(default_factory=ClientOptions)
    _tracks: list[_Track] = field(default_factory=list, init=False, repr=False)
    _started: bool = field(default=False, init=False, repr=False)

    def add_track(self, speaker: str, source: AudioSource, diarize: bool = False) -> None:
        """Add a participant: `speaker` labels its lines; `source` is anything
        `TranscriptionClient.stream` accepts. Add every track before iterating `lines()`. `diarize`: the
        track holds several people (a room's microphone): its lines are labelled `speaker/S1`,
        `speaker/S2`, ... by the server's speaker labels."""
        if self._started:
            raise RuntimeError("add every track before iterating lines()")
        if any(t.speaker == speaker for t in self._tracks):
            raise ValueError(f"a track named {speaker!r} exists already")
        self._tracks.append(_Track(len(self._tracks), speaker, source, diarize=diarize))

    @property
    def active_speakers(self) -> list[str]:
        """The tracks still streaming (while `lines()` runs)."""
        return [t.speaker for t in self._tracks if t.bound_s != math.inf]

    @property
    def stats(self) -> dict[str, TransportStats]:
        """Per speaker: what that track's client did (reconnects, resends, ...)."""
        return {t.speaker: t.client.stats for t in self._tracks if t.client is not None}

    async def lines(self) -> AsyncIterator[MeetingLine]:
        """Stream all tracks; yield each final line in (start_s, track order) as soon as no other
        track can still produce an earlier one. Returns when every track has ended; the first
        track to fail fails the meeting (the other tracks are stopped). A meeting runs once."""
        if self._started:
            raise RuntimeError("a meeting's lines() can be iterated once (its sources are consumed)")
        self._started = True
        if not self._tracks:
            return
        inbox: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._run_track(t, inbox), name=f"harken-track-{t.speaker}")
                 for t in self._tracks]
        held: list[tuple[float, int, int, MeetingLine]] = []  # heap by (start, track, segment)
        running = len(tasks)
        try:
            while running:
                item = await inbox.get()
                track = self._tracks[item.index]
                if isinstance(item, _TrackFailed):
                    raise item.error
                if isinstance(item, _TrackEnded):
                    track.bound_s = math.inf
                    running -= 1
                elif isinstance(item, _TrackRelabel):  # a line still held takes its better label
                    for i, (start, index, segment_id, line) in enumerate(held):
                        if index == item.index and segment_id == item.segment_id:
                            held[i] = (start, index, segment_id, replace(line, speaker=item.speaker))
                else:
                    if isinstance(item, _TrackFinal) and item.line is not None:
                        heapq.heappush(held, (item.line.start_s, item.index, item.line.segment_id, item.line))
                    track.bound_s = max(track.bound_s, item.bound_s)
                while held and self._releasable(held[0][0], held[0][1]):
                    yield heapq.heappop(held)[3]
            while held:
                yield heapq.heappop(held)[3]
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _releasable(self, start_s: float, index: int) -> bool:
        return all((t.bound_s, t.index) > (start_s, index) for t in self._tracks if t.index != index)

    async def _run_track(self, track: _Track, inbox: asyncio.Queue) -> None:
        track.client = TranscriptionClient(self.target, api_key=self.api_key, tls=self.tls,
                                           options=replace(self.options, diarize=track.diarize))
        committed: dict[int, str] = {}
        try:
            async with aclosing(track.client.stream(track.source, progress=True)) as items:
                async for item in items:
                    if isinstance(item, StreamProgress):
                        inbox.put_nowait(_TrackBound(track.index, item.bound_s))
                        continue
                    if isinstance(item, SpeakerChange):
                        inbox.put_nowait(_TrackRelabel(track.index, item.segment_id, f"{track.speaker}/{item.speaker}"))
                        continue
                    if not isinstance(item, TranscriptEvent):
                        continue
                    event = item
                    committed[event.segment_id] = committed.get(event.segment_id, "") + event.committed_delta
                    if event.is_final:
                        text = committed.pop(event.segment_id).strip()
                        who = f"{track.speaker}/{event.speaker}" if track.diarize and event.speaker else track.speaker
                        line = MeetingLine(who, event.start_s, event.end_s, text, event.segment_id) if text else None
                        # its own later segments start after this one: a bound even in thin-client mode
                        inbox.put_nowait(_TrackFinal(track.index, line, math.nextafter(event.start_s, math.inf)))
        except Exception as e:  # handed to the meeting's owner, which raises it
            inbox.put_nowait(_TrackFailed(track.index, e))
            return
        inbox.put_nowait(_TrackEnded(track.index))
