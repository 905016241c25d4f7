"""A session's limits (`SessionLimits`: sessions per server and key, grace, idleness, queued audio,
the event log's size) and the pace of a live stream (`AudioPace`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..inference.commit import CommitPolicy


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int = 256
    max_sessions_per_key: int = 64
    grace_s: float = 60.0
    # an attached stream that sends nothing this long while the engine owes it no work is ended
    # (DEADLINE_EXCEEDED) and its session closed
    idle_timeout_s: float = 30.0
    replay_tail: int = 512  # events of final segments kept behind the last one sent
    max_events_held: int = 20_000  # hard cap on the event log of one session
    # Audio received but not yet encoded (feature frames, 100 a second). Past its session's or its
    # key's limit a stream's next message waits (its reader stops reading, so gRPC's flow control
    # holds the client) until the engine has caught up; past the key's limit the key gets no new
    # session. The engine's own `max_queued_frames` bounds them all: a key's limit is kept below
    # it, so one client cannot make the server refuse everyone else.
    max_queued_frames_per_session: int = 100 * 60
    max_queued_frames_per_key: int = 100 * 60 * 4
    policy: CommitPolicy | None = None  # the sessions' commit policy (None: the engine's default)
    # The pace of a live stream (`AudioPace`): audio is taken at most `max_audio_speed` x real time
    # on average, with `audio_burst_s` ahead of that (a reconnect's replay, a file's first seconds);
    # a faster stream is slowed (its reader waits), so a flood costs the others nothing. 0: no pace.
    max_audio_speed: float = 4.0
    audio_burst_s: float = 30.0


class AudioPace:
    """How much audio a stream may send now: a token bucket of audio seconds, filled at `speed`
    seconds per wall-clock second up to `burst_s`. A message is taken while the bucket is not empty
    (it may then go below zero by the message's length, so a message longer than the burst is not
    refused, only paid for); the next waits until the debt is paid. `clock`: monotonic seconds."""

    def __init__(self, speed: float, burst_s: float, clock: Callable[[], float]):
        self.speed, self.burst_s, self.clock = speed, burst_s, clock
        self.tokens, self.at = burst_s, clock()

    def wait_s(self) -> float:
        """Seconds until the stream may send again (0: now)."""
        if self.speed <= 0:
            return 0.0
        now = self.clock()
        self.tokens = min(self.burst_s, self.tokens + (now - self.at) * self.speed)
        self.at = now
        return 0.0 if self.tokens > 0 else -self.tokens / self.speed + 1e-3

    def take(self, audio_s: float) -> None:
        self.tokens -= audio_s
