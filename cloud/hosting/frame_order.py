"""The one frame order check of the served path (`FrameOrder`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..base.errors import OutOfOrder
from ...shared.protocol import FeaturePacket


@dataclass
class FrameOrder:
    """The frame timeline as far as applied: segments in order, each starting at or after the
    previous one's end, frames contiguous inside one. (The engine checks its own input the same
    way for in-process callers; on the served path this check runs first, before any payload is
    decoded, so the engine never sees frames out of order.)"""

    open_segment: int | None = None
    next_frame: int = 0
    last_segment_id: int = -1
    closed_by_finalize: int | None = None  # audio path: VAD frames of this segment are dropped
    seeded_final: int = -1  # segments up to this one were final before the session began (seed)

    def check(self, f: FeaturePacket) -> bool:
        """Raises OutOfOrder; False for frames of a segment the seed says is final (a replacement
        session ignores them, as the engine does: their text is with the client)."""
        if f.frame_count == 0 and not f.segment_start and not f.segment_end:
            return True  # keep-alive
        if self.open_segment is None and f.segment_id <= self.seeded_final:
            return False
        if self.open_segment is None:
            if not f.segment_start:
                raise OutOfOrder(f"features for segment {f.segment_id} without segment_start: no segment is open")
            if f.segment_id <= self.last_segment_id:
                raise OutOfOrder(f"segment id {f.segment_id} does not increase (last was {self.last_segment_id})")
            if f.first_frame < self.next_frame:
                raise OutOfOrder(f"segment {f.segment_id} starts at frame {f.first_frame}, before the "
                                 f"previous segment's end ({self.next_frame})")
            return True
        if f.segment_start or f.segment_id != self.open_segment:
            raise OutOfOrder(f"segment {self.open_segment} is still open; got frames of segment "
                             f"{f.segment_id}{' with segment_start' if f.segment_start else ''}")
        if f.first_frame != self.next_frame:
            raise OutOfOrder(f"segment {f.segment_id}: frames not contiguous (expected first_frame "
                             f"{self.next_frame}, got {f.first_frame})")
        return True

    def apply(self, f: FeaturePacket) -> None:
        if f.frame_count == 0 and not f.segment_start and not f.segment_end:
            return
        if f.segment_start:
            self.open_segment = f.segment_id
            self.last_segment_id = f.segment_id
        self.next_frame = f.first_frame + f.frame_count
        if f.segment_end:
            self.open_segment = None
