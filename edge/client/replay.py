"""What the client keeps so that nothing is lost: the messages to resend, and the filter that
drops committed text a replacement session sends again.

A `ResendBuffer` holds every Features/Audio message not yet safe to forget, oldest first, with the
seqs of the current session (renumbered from 1 for a replacement session). What is safe to forget,
and how a lost session is replayed, depends on what the messages carry:

- `FeatureBuffer` (features from the edge's own VAD): a segment's packets leave once the segment
  is final. A final that comes before the segment's end (a server shutting down finalises open
  segments) splits the segment: the rest continues as the next one.
- `AudioBuffer` (thin client: PCM16, the server segments it): audio leaves once applied and behind
  the replay point of the last final's seed (where the server's front-end checkpoint in it is
  replayed from; shared/front_end_checkpoint.py); a replacement session resumes that checkpoint and gets the
  audio from there, its times those of the lost session. A seed without a checkpoint: the audio
  since the last final segment's end, into a fresh front end whose times start at the replay.

`ReplayFilter` turns a replacement session's events, which start its segments afresh, into what
extends the user's text. Plain data, no I/O and no proto: `edge/client/session.py` drives them.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field, replace

from ..vad import WINDOW_SAMPLES
from ...shared.codec import CODEC_NAME
from ...shared.features_spec import FRAMES_PER_SECOND, HOP_LENGTH, SAMPLE_RATE
from ...shared.protocol import Audio, FeaturePacket, Features, SessionSeed

log = logging.getLogger("harken.transport")

# thin client, a seed without a front-end checkpoint: a replay starts on a multiple of the log-mel
# hop and the VAD window (2560 samples), so the server's fresh front end sees the audio on the lost
# session's frame and window grid
THIN_REPLAY_ALIGN = math.lcm(HOP_LENGTH, WINDOW_SAMPLES)
THIN_REPLAY_MAX_S = 60  # thin client: audio kept for a replay after a server restart, at most


@dataclass
class PendingMessage:
    """One Features/Audio message, kept until it is safe to forget (its seq is per session)."""

    seq: int
    segment_id: int  # -1 for thin-client audio (the server segments it)
    body: FeaturePacket | bytes  # the packet as it goes on the wire, or PCM16 audio
    nbytes: int
    frames: int  # feature frames (0 for audio)
    first_frame: int = 0  # features: the first frame's index on the stream's timeline
    first_sample: int = 0  # thin client: the audio's position in the stream
    end_sample: int = 0
    segment_start_s: float | None = None  # the segment's start, on its first packet
    times_sent: int = 0

    def message(self) -> Features | Audio:
        """The message to write, with this entry's seq."""
        if isinstance(self.body, FeaturePacket):
            return Features(self.seq, self.body)
        return Audio(self.seq, self.body, SAMPLE_RATE)


@dataclass
class ResendBuffer:
    """The client's unfinished messages, oldest first, with contiguous seqs. The subclasses say
    what goes in, when it may leave and how a lost session is replayed."""

    entries: deque[PendingMessage] = field(default_factory=deque)
    next_seq: int = 1
    nbytes: int = 0

    codec = ""  # `Start.codec` of a session carrying these messages

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

    def renumber(self) -> None:
        """A replacement session counts from 1 again."""
        for i, e in enumerate(self.entries):
            e.seq = i + 1
        self.next_seq = len(self.entries) + 1

    @property
    def time_offset_s(self) -> float:
        """Where the current session's time zero is on the stream's timeline."""
        return 0.0

    def add_packet(self, packet: FeaturePacket) -> PendingMessage:
        raise TypeError(f"{type(self).__name__} takes no feature packets")

    def add_audio(self, pcm16: bytes) -> PendingMessage:
        raise TypeError(f"{type(self).__name__} takes no audio")

    def on_final(self, segment_id: int, end_s: float | None, final_through: int, acked_seq: int) -> None:
        """Segments up to `final_through` are final; `segment_id` just ended at `end_s` (None:
        learnt from an ack, not from its final event)."""

    def on_ack(self, acked_seq: int, last_final_segment: int) -> int | None:
        """The server applied every seq <= `acked_seq`. Returns the segment through which the ack
        makes segments final here, or None when acks say nothing about finals."""
        return None

    def on_seed(self, seed: SessionSeed) -> None:
        """A final event brought `seed`, the one a replacement session would start from."""

    def on_session_lost(self, seed: SessionSeed | None = None) -> SessionSeed | None:
        """The next messages go to a replacement session, which counts from seq 1. Returns the
        seed it starts from (`seed`, the last final's, or what of it the buffer can replay)."""
        self.renumber()
        return seed


@dataclass
class FeatureBuffer(ResendBuffer):
    """Feature packets of the edge's own segments; a segment's packets leave once it is final."""

    segment_shift: int = 0  # wire segment id - edge segment id (segments the server ended early)
    open_segment: int | None = None  # wire id of the segment the edge has not ended yet
    reopen_segment: bool = False  # the open segment's next packet starts its continuation

    codec = CODEC_NAME

    def add_packet(self, packet: FeaturePacket) -> PendingMessage:
        # segment ids on the wire run ahead of the edge's by one per segment the server ended
        # early (see `split_segment`)
        segment_id = packet.segment_id + self.segment_shift
        opens = packet.segment_start or self.reopen_segment
        self.reopen_segment = False
        self.open_segment = None if packet.segment_end else segment_id
        if (segment_id, opens) != (packet.segment_id, packet.segment_start):
            packet = replace(packet, segment_id=segment_id, segment_start=opens)
        entry = PendingMessage(0, segment_id, packet, len(packet.payload), packet.frame_count,
                               first_frame=packet.first_frame,
                               segment_start_s=packet.first_frame / FRAMES_PER_SECOND if opens else None)
        self.append(entry)
        return entry

    def on_final(self, segment_id: int, end_s: float | None, final_through: int, acked_seq: int) -> None:
        if end_s is not None:
            self._split_open_segment(segment_id, round(end_s * FRAMES_PER_SECOND))
        self.drop_segments_through(final_through)

    def on_ack(self, acked_seq: int, last_final_segment: int) -> int | None:
        # the server's finals come before its Ack on the stream, so they are with us
        return last_final_segment

    def drop_segments_through(self, segment_id: int) -> None:
        while self.entries and 0 <= self.entries[0].segment_id <= segment_id:
            self.nbytes -= self.entries.popleft().nbytes

    def _split_open_segment(self, segment_id: int, end_frame: int) -> None:
        """A final before the segment's end (a server shutting down finalises open segments):
        the rest of the segment continues as a new one, so no frame is lost."""
        still_open = self.open_segment == segment_id
        split, continued = self.split_segment(segment_id, end_frame, still_open)
        if not split:
            return
        log.info("segment %d ended early on the server (frame %d): the rest continues as segment %d",
                 segment_id, end_frame, segment_id + 1)
        self.segment_shift += 1
        if self.open_segment is not None and self.open_segment >= segment_id:
            self.open_segment += 1
        if still_open and not continued:
            self.reopen_segment = True  # the edge's next packet of it opens the continuation

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
            assert isinstance(e.body, FeaturePacket)
            if e.segment_id == segment_id and e.first_frame >= end_frame:
                if not continued and e.frames == 0:
                    self.nbytes -= e.nbytes  # a bare end of the segment the server ended already
                    continue
                if not continued:
                    e.segment_start_s = e.first_frame / FRAMES_PER_SECOND
                e.segment_id = segment_id + 1
                e.body = replace(e.body, segment_id=e.segment_id, segment_start=not continued)
                continued = True
            elif e.segment_id > segment_id:
                e.segment_id += 1
                e.body = replace(e.body, segment_id=e.segment_id)
            kept.append(e)
        self.entries = kept
        return True, continued


@dataclass
class AudioBuffer(ResendBuffer):
    """Thin client: PCM16 pieces; the server runs VAD + features on them and segments them. Kept:
    what the server has not applied, and what a replacement session would be fed: the audio from
    the last seed's checkpoint replay point (or, for a seed without one, from the last final
    segment's end) on, at most the last `THIN_REPLAY_MAX_S`. Positions count samples of the stream."""

    piece_samples: int = SAMPLE_RATE // 10  # a replay's audio per message
    audio_position: int = 0  # samples enqueued so far
    final_end_sample: int = 0  # where the last final segment ended
    checkpoint_sample: int | None = None  # where the last seed's front-end checkpoint replays from
    session_start_sample: int = 0  # the current session's sample 0 (its times count from there)

    @property
    def replay_offset_s(self) -> float:
        """Where the current session's time zero lies in the stream, in seconds."""
        return self.session_start_sample / SAMPLE_RATE

    @property
    def time_offset_s(self) -> float:
        return self.replay_offset_s

    def add_audio(self, pcm16: bytes) -> PendingMessage:
        samples = len(pcm16) // 2
        entry = PendingMessage(0, -1, pcm16, len(pcm16), 0, first_sample=self.audio_position,
                               end_sample=self.audio_position + samples)
        self.audio_position += samples
        self.append(entry)
        return entry

    def on_seed(self, seed: SessionSeed) -> None:
        # the seed counts samples as the session that sent it does
        self.checkpoint_sample = self.session_start_sample + seed.audio_sample if seed.front_end_state else None

    def on_final(self, segment_id: int, end_s: float | None, final_through: int, acked_seq: int) -> None:
        if end_s is not None:
            self.final_end_sample = max(self.final_end_sample,
                                        int(round((end_s + self.replay_offset_s) * SAMPLE_RATE)))
            self._trim(acked_seq)

    def on_ack(self, acked_seq: int, last_final_segment: int) -> int | None:
        self._trim(acked_seq)
        return None

    def on_session_lost(self, seed: SessionSeed | None = None) -> SessionSeed | None:
        """With a checkpoint in `seed` and its audio at hand, replay from its replay point: the
        replacement session resumes the lost one's front end and counts time as it did. Else
        replay from the end of the last final segment into a fresh front end (the seed goes
        without its checkpoint), whose times are relative to that point."""
        held_from = self.entries[0].first_sample if self.entries else self.audio_position
        if seed is not None and seed.front_end_state and self.checkpoint_sample is not None \
                and held_from <= self.checkpoint_sample:
            self.replay_from(self.checkpoint_sample)
            log.info("thin client: resuming the server's front end, replaying the audio from %.2f s",
                     self.checkpoint_sample / SAMPLE_RATE)
        else:
            self.session_start_sample = self.replay_from(max(held_from, align_down(self.final_end_sample)))
            self.checkpoint_sample = None
            log.info("thin client: replaying the audio from %.2f s into a fresh front end", self.replay_offset_s)
            if seed is not None:
                seed = replace(seed, front_end_state=b"", audio_sample=0)
        self.renumber()
        return seed

    def replay_start(self) -> int:
        """Where the audio a replacement session would be fed starts."""
        if self.checkpoint_sample is not None:
            return self.checkpoint_sample
        return align_down(self.final_end_sample)

    def _trim(self, acked_seq: int) -> None:
        keep_from = max(self.replay_start(), align_down(self.audio_position - THIN_REPLAY_MAX_S * SAMPLE_RATE))
        self.drop_audio_before(acked_seq, keep_from)

    def drop_audio_before(self, seq: int, sample: int) -> None:
        """Drop audio both applied (seq <= `seq`) and ending before `sample`."""
        while self.entries and self.entries[0].seq <= seq and self.entries[0].end_sample <= sample:
            self.nbytes -= self.entries.popleft().nbytes

    def replay_from(self, start: int) -> int:
        """For a replacement session: keep the audio from sample `start` (or from the oldest held,
        if later) in fresh pieces of `piece_samples`, each counted as sent once. Returns the sample
        the replay starts at."""
        if not self.entries:
            return self.audio_position
        base = self.entries[0].first_sample
        start = max(base, start)
        pcm16 = b"".join(e.body for e in self.entries if isinstance(e.body, bytes))[2 * (start - base):]
        self.entries.clear()
        self.nbytes = 0
        for i in range(0, len(pcm16), 2 * self.piece_samples):
            piece = pcm16[i:i + 2 * self.piece_samples]
            first = start + i // 2
            self.append(PendingMessage(0, -1, piece, len(piece), 0, first_sample=first,
                                       end_sample=first + len(piece) // 2, times_sent=1))
        return start


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
