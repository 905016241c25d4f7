"""What the client keeps so that nothing is lost: the messages to resend, and the filter that
drops committed text a replacement session sends again.

`ResendBuffer` holds every Features/Audio message not yet safe to forget, oldest first, with the
seqs of the current session (contiguous; renumbered from 1 for a replacement session). Feature
messages leave once their segment is final; thin-client audio once applied and behind the end of
the last final segment. `ReplayFilter` turns a replacement session's events, which start its
segments afresh, into what extends the user's text. Plain data, no I/O: edge/transport drives it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from harken.edge.vad import WINDOW_SAMPLES
from harken.proto import harken_pb2 as pb
from harken.shared.features_spec import FRAMES_PER_SECOND, HOP_LENGTH, SAMPLE_RATE

# thin client: a replay starts on a multiple of the log-mel hop and the VAD window (2560 samples),
# so the server's fresh front end sees the audio on the lost session's frame and window grid
THIN_REPLAY_ALIGN = math.lcm(HOP_LENGTH, WINDOW_SAMPLES)


@dataclass
class PendingMessage:
    """One Features/Audio message, kept until its segment is final (its seq is per session)."""

    seq: int
    segment_id: int  # -1 for thin-client audio (the server segments it)
    message: pb.ClientMessage  # seq filled in when written
    nbytes: int
    frames: int  # feature frames (0 for audio)
    first_frame: int = 0  # features: the first frame's index on the stream's timeline
    first_sample: int = 0  # thin client: the audio's position in the stream
    end_sample: int = 0
    segment_start_s: float | None = None  # the segment's start, on its first packet
    times_sent: int = 0


@dataclass
class ResendBuffer:
    """The client's unfinished messages, oldest first, with contiguous seqs."""

    entries: deque[PendingMessage] = field(default_factory=deque)
    next_seq: int = 1
    nbytes: int = 0

    def append(self, entry: PendingMessage) -> None:
        entry.seq = self.next_seq
        self.next_seq += 1
        self.entries.append(entry)
        self.nbytes += entry.nbytes

    def after(self, seq: int) -> PendingMessage | None:
        """The message with seq `seq + 1`, if buffered."""
        if not self.entries:
            return None
        i = seq + 1 - self.entries[0].seq
        return self.entries[i] if 0 <= i < len(self.entries) else None

    def drop_segments_through(self, segment_id: int) -> None:
        while self.entries and 0 <= self.entries[0].segment_id <= segment_id:
            self.nbytes -= self.entries.popleft().nbytes

    def drop_audio_before(self, seq: int, sample: int) -> None:
        """Thin client: drop audio both applied (seq <= `seq`) and ending before `sample`."""
        while self.entries and self.entries[0].seq <= seq and self.entries[0].end_sample <= sample:
            self.nbytes -= self.entries.popleft().nbytes

    def split_segment(self, segment_id: int, end_frame: int, still_open: bool) -> tuple[bool, bool]:
        """The server finalised `segment_id` at `end_frame`. Normally that is the segment's end;
        a server shutting down, though, finalises open segments early. Then the packets of it
        from `end_frame` on continue as a new segment `segment_id + 1` (their first now opens it)
        and every later segment moves up by one. `still_open`: the edge has not ended the segment
        yet. Returns (split, continued here): whether the ids moved up, and whether buffered
        packets continue the segment (else the edge's next packet of it must open it)."""
        rest = [e for e in self.entries if e.segment_id == segment_id and e.first_frame >= end_frame]
        if not still_open and not any(e.frames for e in rest):
            return False, False  # the segment's own end (at most a bare zero-frame end packet)
        continued = False
        kept: deque[PendingMessage] = deque()
        for e in self.entries:
            f = e.message.features
            if e.segment_id == segment_id and e.first_frame >= end_frame:
                if not continued and e.frames == 0:
                    self.nbytes -= e.nbytes  # a bare end of the segment the server ended already
                    continue
                f.segment_start = not continued
                if not continued:
                    e.segment_start_s = e.first_frame / FRAMES_PER_SECOND
                continued = True
                e.segment_id = f.segment_id = segment_id + 1
            elif e.segment_id > segment_id:
                e.segment_id = f.segment_id = e.segment_id + 1
            kept.append(e)
        self.entries = kept
        return True, continued

    def realign_audio(self, final_end_sample: int, audio_position: int, piece_samples: int) -> int:
        """Thin client, for a replacement session: keep the audio from the last final segment's
        end (on the replay grid) in fresh pieces of `piece_samples`, each counted as sent once.
        Returns the sample the replay starts at (the new session's time zero)."""
        if not self.entries:
            return audio_position
        base = self.entries[0].first_sample
        start = max(base, align_down(final_end_sample))
        pcm16 = b"".join(e.message.audio.pcm16 for e in self.entries)[2 * (start - base):]
        self.entries.clear()
        self.nbytes = 0
        for i in range(0, len(pcm16), 2 * piece_samples):
            piece = pcm16[i:i + 2 * piece_samples]
            msg = pb.ClientMessage(audio=pb.Audio(pcm16=piece, sample_rate=SAMPLE_RATE))
            first = start + i // 2
            self.append(PendingMessage(0, -1, msg, len(piece), 0, first_sample=first,
                                       end_sample=first + len(piece) // 2, times_sent=1))
        return start

    def renumber(self) -> None:
        """A replacement session counts from 1 again."""
        for i, e in enumerate(self.entries):
            e.seq = i + 1
        self.next_seq = len(self.entries) + 1


@dataclass
class ReplayFilter:
    """Committed text per segment as the user has it. A replacement session (after the server lost
    the old one) re-sends the committed text of the segments it replays; `filter` passes on only
    what extends what the user has, and the partial text after that. Committed text is never
    retracted: should a replay disagree (`mismatches`), the user's text stands."""

    delivered: dict[int, str] = field(default_factory=dict)  # committed text the user has
    shown_partial: dict[int, str] = field(default_factory=dict)
    session_text: dict[int, str] = field(default_factory=dict)  # committed text this session sent
    dropped_chars: int = 0  # re-sent committed text not passed on
    mismatches: int = 0

    def new_session(self) -> None:
        """The next events come from a replacement session that starts its segments afresh."""
        self.session_text.clear()

    def forget_through(self, segment_id: int) -> None:
        """Segments up to `segment_id` are final and will not be replayed: memory stays flat."""
        for texts in (self.delivered, self.shown_partial, self.session_text):
            for s in [s for s in texts if s <= segment_id]:
                del texts[s]

    def filter(self, segment_id: int, committed_delta: str, partial: str, is_final: bool
               ) -> tuple[str, str] | None:
        """(committed delta, partial) to show for a server event, or None if it shows nothing new."""
        before = self.session_text.get(segment_id, "")
        text = before + committed_delta
        self.session_text[segment_id] = text
        have = self.delivered.get(segment_id, "")
        if not (text.startswith(have) or have.startswith(text)):
            self.mismatches += 1
        delta = text[len(have):] if len(text) > len(have) else ""
        self.dropped_chars += len(committed_delta) - len(delta)
        committed = have + delta
        hypothesis = text + partial
        shown = "" if is_final else hypothesis[len(committed):] if len(hypothesis) > len(committed) else ""
        catching_up = len(before) < len(have)  # a replacement session re-sending what the user has
        if catching_up and not delta and not is_final and \
                (len(hypothesis) <= len(have) or shown == self.shown_partial.get(segment_id, "")):
            return None  # keep showing what the user has until the replay goes past it
        self.delivered[segment_id] = committed
        self.shown_partial[segment_id] = shown
        return delta, shown


def align_down(sample: int) -> int:
    """The replay grid point at or before `sample`."""
    return sample // THIN_REPLAY_ALIGN * THIN_REPLAY_ALIGN
