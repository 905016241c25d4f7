"""Which ready sessions a tick serves first: streams at real time before streams running ahead of it.

A live stream sends audio as it is spoken; its passes are what users wait for. A stream that sends
faster than real time (a file streamed as fast as the network goes, a replay after a reconnect, a
client flooding its pace) has passes nobody waits for second by second. When both are ready, a tick
serves the live ones and defers the ahead ones, so their work fills the engine's idle time instead of
lengthening every live tick (on a CPU, or a saturated GPU, a pass's cost is the tick's cost).

    lead = RealTimeLead(now)      # per session
    lead.add(audio_s, now)        # on every ingest
    lead.ahead(now) -> bool       # more than AHEAD_SLACK_S of audio ahead of the wall clock

An ahead session is deferred at most `MAX_DEFER_TICKS` ticks in a row, so a saturated engine still
serves it (slowly), and when no live session is ready it is served like any other. Once its pass
is in flight, it takes no decode step while a live pass decodes (the own decoder on a CPU,
`Engine._advance`; at most `MAX_HOLD_STEPS`): live passes that join the tick run at their own
batch's speed, and the ahead pass goes on when they are done. Priority only
changes when a pass runs, never what it computes: a session's text is the same either way.
"""

from __future__ import annotations

# A live stream's packets arrive a few hundred ms apart, a reconnect's resend within seconds:
# a lead below this is live. Above it the stream is sending faster than it could be spoken.
AHEAD_SLACK_S = 3.0
# Ticks an ahead session may wait in a row while live sessions are served.
MAX_DEFER_TICKS = 8
# Decode steps an ahead session's pass in flight may hold still for live passes (`Engine._advance`):
# a few live passes' worth, so a tick still ends when live sessions keep joining it.
MAX_HOLD_STEPS = 128


class RealTimeLead:
    """Seconds of audio a session has sent ahead of the wall clock: every ingested second adds one,
    every wall-clock second takes one away, never below zero (silence earns no credit for a burst
    later)."""

    def __init__(self, now: float):
        self.lead_s = 0.0
        self.at = now

    def _drain(self, now: float) -> None:
        self.lead_s = max(0.0, self.lead_s - max(0.0, now - self.at))
        self.at = now

    def add(self, audio_s: float, now: float) -> None:
        self._drain(now)
        self.lead_s += audio_s

    def ahead(self, now: float) -> bool:
        self._drain(now)
        return self.lead_s > AHEAD_SLACK_S
