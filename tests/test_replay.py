"""edge/replay: the resend buffers' own rules, one by one (the session's use of them is in
test_client_session.py; the replay filter's tests, against the real server's events, are in
test_transport_lost_sessions.py)."""

from __future__ import annotations

from dataclasses import replace

from harken.edge.client.replay import THIN_REPLAY_ALIGN, THIN_REPLAY_MAX_S, AudioBuffer, FeatureBuffer, align_down
from harken.shared.protocol import Audio, FeaturePacket, Features, SessionSeed


def packet(segment_id: int, first_frame: int, frames: int = 10, start: bool = False, end: bool = False):
    return FeaturePacket(segment_id, first_frame, frames, start, end, b"x" * 10, running_max_log10=1.0)


def test_seqs_are_contiguous_and_a_replacement_counts_from_one():
    b = FeatureBuffer()
    for i in range(4):
        b.add_packet(packet(0, 10 * i, start=i == 0))
    assert [e.seq for e in b.entries] == [1, 2, 3, 4] and b.after(2) is b.entries[2] and b.after(4) is None
    assert b.after(0).message() == Features(1, packet(0, 0, start=True))
    b.drop_segments_through(0)
    assert not b.entries and b.nbytes == 0 and b.after(4) is None
    b.add_packet(packet(1, 90, start=True))
    b.add_packet(packet(1, 100))
    b.on_session_lost()
    assert [e.seq for e in b.entries] == [1, 2] and b.next_seq == 3


def test_a_segments_own_end_is_not_a_split():
    """The final of an ended segment: only a bare zero-frame end packet after its last frame,
    nothing to continue, ids unchanged."""
    b = FeatureBuffer()
    b.add_packet(packet(0, 0, start=True))
    b.add_packet(packet(0, 10, frames=0, end=True))
    b.add_packet(packet(1, 50, start=True))
    assert b.split_segment(0, end_frame=10, still_open=False) == (False, False)
    assert [e.segment_id for e in b.entries] == [0, 0, 1]


def test_an_early_end_at_a_bare_end_packet_of_an_open_segment_reopens_on_the_next_packet():
    """The server ended segment 0 at frame 20, where the buffer holds only a zero-frame packet of
    it: that packet goes, and the edge's next packet of the segment opens segment 1."""
    b = FeatureBuffer()
    b.add_packet(packet(0, 0, start=True, frames=20))
    b.add_packet(packet(0, 20, frames=0))
    b.on_final(0, end_s=0.2, final_through=0, acked_seq=2)
    assert not b.entries and b.nbytes == 0 and b.reopen_segment and b.segment_shift == 1
    entry = b.add_packet(packet(0, 20, frames=10))
    assert isinstance(entry.body, FeaturePacket) and entry.body.segment_id == 1 and entry.body.segment_start
    assert entry.segment_start_s == 0.2


def test_thin_client_audio_is_kept_until_applied_and_behind_the_last_final():
    b = AudioBuffer(piece_samples=1600)
    for i in range(10):
        b.add_audio(bytes(3200))
    assert b.audio_position == 16_000 and b.after(0).message() == Audio(1, bytes(3200), 16_000)
    b.on_final(0, end_s=0.5, final_through=0, acked_seq=3)  # only 3 pieces applied so far
    assert b.entries[0].seq == 4
    assert b.on_ack(10, last_final_segment=0) is None  # audio acks say nothing about finals
    assert b.entries[0].first_sample == 6400 and align_down(8000) == 7680 == 3 * THIN_REPLAY_ALIGN
    # a replacement session gets the audio from the grid point at or before the final's end
    b.on_session_lost()
    assert b.replay_offset_s == 7680 / 16_000 == b.time_offset_s
    assert b.entries[0].first_sample == 7680 and sum(e.end_sample - e.first_sample for e in b.entries) == 8320
    assert all(e.times_sent == 1 for e in b.entries) and [e.seq for e in b.entries] == [1, 2, 3, 4, 5, 6]


def test_thin_client_keeps_audio_from_the_seeds_checkpoint_and_replays_exactly_from_it():
    """A seed with a front-end checkpoint: the audio is kept from its replay point (here before the
    final's end), a replacement gets exactly that audio, the seed goes on whole and times are not
    shifted (the resumed front end counts as the lost one did). The replacement's own seeds count
    from the same zero."""
    b = AudioBuffer(piece_samples=1600)
    for i in range(20):
        b.add_audio(bytes(3200))  # 0.1 s each, 2 s in all
    seed = SessionSeed(1.0, "ctx", 1, front_end_state=b"state", audio_sample=5120)
    b.on_seed(seed)
    b.on_final(0, end_s=0.5, final_through=0, acked_seq=20)
    assert b.checkpoint_sample == 5120 and b.entries[0].first_sample == 4800  # the piece holding 5120
    assert b.on_session_lost(seed) == seed
    assert b.time_offset_s == 0.0 and b.entries[0].first_sample == 5120
    assert sum(e.end_sample - e.first_sample for e in b.entries) == 32_000 - 5120
    assert [e.seq for e in b.entries] == list(range(1, len(b.entries) + 1))
    b.on_seed(replace(seed, audio_sample=7680))
    assert b.checkpoint_sample == 7680


def test_thin_client_without_the_checkpoints_audio_falls_back_to_the_final_end():
    """The checkpoint's audio is gone (older than THIN_REPLAY_MAX_S): the replacement starts a
    fresh front end at the grid point before the last final's end, the seed goes without its
    state, and times shift to the replay's start."""
    b = AudioBuffer(piece_samples=16_000)
    seed = SessionSeed(1.0, "ctx", 1, front_end_state=b"state", audio_sample=0)
    b.on_seed(seed)
    for _ in range(THIN_REPLAY_MAX_S + 5):
        b.add_audio(bytes(32_000))  # 1 s each
    b.on_final(0, end_s=61.0, final_through=0, acked_seq=THIN_REPLAY_MAX_S + 5)
    assert b.entries[0].first_sample == 4 * 16_000  # the piece holding the cap, 60 s back
    plain = b.on_session_lost(seed)
    assert plain == replace(seed, front_end_state=b"", audio_sample=0)
    start = align_down(61 * 16_000)
    assert b.entries[0].first_sample == start and b.time_offset_s == start / 16_000
    assert b.checkpoint_sample is None
