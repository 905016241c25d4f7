"""edge/feature_stream: VAD-gated packets carry exactly the floored log-mel of each segment."""

import numpy as np
import pytest

from harken.shared.front_end_checkpoint import FrontEndCheckpoint
from harken.edge.pipeline import CHECKPOINT_SAMPLES, FeatureStream, replay_lead_samples
from harken.edge.features import log_mel_raw
from harken.edge.vad import VadOptions, get_speech_timestamps
from harken.shared.codec import decode_frames
from harken.shared.features_spec import RunningMaxFloor
from harken.shared.fidelity import feature_error_db
from signals import concat, noisy, silence, speech

# a bound well above every mode's measured RMS error (see README); the point here is the indexing
HIFI_RMS_DB = 0.5


@pytest.fixture(scope="module")
def audio():
    return noisy(concat(silence(0.8), speech("Hello there, this is the first sentence."), silence(1.5),
                        speech("And here comes a second one, a little longer than the first."),
                        silence(1.0)), snr_db=35)


@pytest.fixture(scope="module")
def close_pair():
    """Two utterances 0.1 s apart: the VAD's segments are less than 0.2 s apart, less than the time
    it takes to decide the first one's end."""
    return noisy(concat(silence(0.5), speech("Hello there."), silence(0.1),
                        speech("And here comes a second one."), silence(1.0)), snr_db=35)


def _vad_frames(audio) -> list[tuple[int, int]]:
    """The VAD's segments of the whole recording on the frame grid: the frames centred inside
    each, a start never before the previous segment's end frame."""
    out: list[tuple[int, int]] = []
    for s in get_speech_timestamps(audio, VadOptions()):
        start = max(s.start_sample // 160, out[-1][1] if out else 0)
        out.append((start, -(-s.end_sample // 160)))
    return out


def _spans(packets) -> list[tuple[int, int]]:
    return [(ps[0].first_frame, ps[-1].first_frame + ps[-1].frame_count)
            for _, ps in sorted(_by_segment(packets).items())]


def _run(audio, pieces, **kw):
    stream = FeatureStream(**kw)
    packets, i = [], 0
    for n in pieces:
        packets += stream.push(audio[i:i + n])
        i += n
    packets += stream.push(audio[i:])
    return stream, packets + stream.flush()


def _by_segment(packets):
    segs = {}
    for p in packets:
        segs.setdefault(p.segment_id, []).append(p)
    return segs


def test_packets_cover_each_vad_segment_contiguously(audio):
    _, packets = _run(audio, [1600] * (audio.size // 1600))
    segs = _by_segment(packets)
    truth = get_speech_timestamps(audio, VadOptions())
    assert len(segs) == len(truth) == 2
    for (sid, ps), seg in zip(sorted(segs.items()), truth):
        assert [p.segment_start for p in ps] == [True] + [False] * (len(ps) - 1)
        assert [p.segment_end for p in ps] == [False] * (len(ps) - 1) + [True]
        for a, b in zip(ps, ps[1:]):
            assert a.first_frame + a.frame_count == b.first_frame
        assert ps[0].first_frame == seg.start_sample // 160
        # exactly the VAD's end: no frame of the trailing pause that decided it
        assert ps[-1].first_frame + ps[-1].frame_count == -(-seg.end_sample // 160)
        assert all(p.frame_count == 20 for p in ps[:-1])


def test_decoded_frames_are_the_floored_reference(audio):
    _, packets = _run(audio, [3200] * (audio.size // 3200), mode="hifi")
    reference = RunningMaxFloor()(log_mel_raw(audio))
    for p in packets:
        frames = decode_frames(p.payload)
        assert frames.shape == (128, p.frame_count)
        ref = reference[:, p.first_frame:p.first_frame + p.frame_count]
        if p.frame_count:
            assert feature_error_db(ref, frames).rms_db < HIFI_RMS_DB


@pytest.mark.parametrize("name", ["audio", "close_pair"])
def test_packets_are_a_function_of_the_samples_alone(name, request):
    """The same audio whole, in 20 ms, 100 ms and 1000 ms pieces and in random pieces gives the same
    packets byte for byte (segment ends included, and the running max they carry), and their
    segments are the VAD's segments of the whole recording on the frame grid, none overlapping the
    one before. Before: frames of an open segment left as soon as they were final, so a segment
    ran past the VAD's end by however much audio had arrived when the end was decided: in 20 ms
    pieces `close_pair`'s first segment ran to frame 164, into the second, which starts at 162
    (the engine refuses that: "segment 1 starts at frame 162, before the previous segment's end")."""
    audio = request.getfixturevalue(name)
    whole = _run(audio, [])[1]
    cuts = {f"{ms} ms": [16 * ms] * (audio.size // (16 * ms)) for ms in (20, 100, 1000)}
    cuts["random"] = np.random.default_rng(7).integers(1, 4000, size=200).tolist()
    for label, pieces in cuts.items():
        assert _run(audio, pieces)[1] == whole, label
    spans = _spans(whole)
    assert spans == _vad_frames(audio) and len(spans) == 2
    assert spans[0][1] <= spans[1][0]


def test_silence_sends_nothing():
    _, packets = _run(silence(5.0), [1600] * 50)
    assert packets == []


@pytest.mark.parametrize("n", [0, 1, 200, 201])
def test_a_stream_too_short_for_one_frame_ends_cleanly_with_nothing(n):
    fs = FeatureStream()
    assert fs.push(np.full(n, 0.3, np.float32)) + fs.flush() == []


def test_running_max_is_carried_and_can_seed_a_new_stream(audio):
    stream, packets = _run(audio, [1600] * (audio.size // 1600))
    assert packets[-1].running_max_log10 == pytest.approx(stream.floor.max_log10)
    seeded = FeatureStream(running_max_log10=packets[-1].running_max_log10)
    assert seeded.floor.max_log10 == packets[-1].running_max_log10


def test_memory_is_bounded_over_a_long_stream():
    one = concat(noisy(speech("Testing a long stream with many segments."), 30), silence(1.0))
    stream = FeatureStream()
    peak = 0
    for _ in range(25):  # ~90 s
        for i in range(0, one.size, 1600):
            stream.push(one[i:i + 1600])
            peak = max(peak, len(stream._frames))
    # idle look-back plus one open packet plus the frames a segment end may wait for
    assert peak <= stream.lookback_frames + stream.packet_frames + 60


def _with_checkpoints(audio, stream: FeatureStream):
    """Push `audio` in pieces that end on the checkpoint grid; returns [(checkpoint, the packets the
    stream sent after it)] for every checkpoint it gave, the one at sample 0 included."""
    taken = [(stream.checkpoint(), 0)]
    packets: list = []
    for i in range(0, audio.size, CHECKPOINT_SAMPLES):
        packets += stream.push(audio[i:i + CHECKPOINT_SAMPLES])
        if (c := stream.checkpoint()) is not None:
            taken.append((c, len(packets)))
    packets += stream.flush()
    return [(c, packets[n:]) for c, n in taken]


def _fed(stream: FeatureStream, audio, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out, i = [], 0
    while i < audio.size:
        n = int(rng.integers(1, 5000))
        out += stream.push(audio[i:i + n])
        i += n
    return out + stream.flush()


@pytest.fixture(scope="module")
def noisy_three():
    """Three utterances in noise (20 dB SNR) with short pauses."""
    return noisy(concat(silence(0.3), speech("Hello there, this is a test of the system."), silence(0.5),
                        speech("A second sentence follows now."), silence(0.45),
                        speech("And the third one ends it."), silence(0.5)), snr_db=20)


def test_a_resumed_stream_sends_exactly_what_the_checkpointed_one_sent_after_it(noisy_three):
    """At every quiet point of the checkpoint grid the stream gives a checkpoint; a stream resumed
    from it (through its bytes) and fed the audio from its replay point on, in other pieces, sends
    exactly the packets the first sent after it, and gives the same checkpoint there again. A
    stream started afresh at the same point (what a thin client's replay did before) does not: the
    VAD's state at a pause in noise is not a fresh one's."""
    audio = noisy_three
    taken = _with_checkpoints(audio, FeatureStream())
    assert len(taken) >= 6 and {c.next_segment_id for c, _ in taken} == {0, 1, 2, 3}
    fresh_differs = False
    for c, after in taken:
        assert c.sample % CHECKPOINT_SAMPLES == 0
        assert c.replay_from == max(0, c.sample - replay_lead_samples(VadOptions()))
        resumed = FeatureStream.resume(FrontEndCheckpoint.parse(c.serialize()))
        replay = audio[c.replay_from:]
        lead = c.sample - c.replay_from
        assert resumed.push(replay[:lead]) == []
        assert resumed.checkpoint().serialize() == c.serialize()
        assert resumed.samples == c.sample
        assert _fed(resumed, replay[lead:], seed=c.sample) == after, c.sample
        if c.sample:
            fresh = FeatureStream(running_max_log10=c.running_max_log10, first_segment_id=c.next_segment_id)
            offset = c.replay_from // 160
            fresh_differs |= [(p.segment_id, p.first_frame + offset, p.frame_count, p.payload)
                              for p in _fed(fresh, replay, seed=0)] != \
                             [(p.segment_id, p.first_frame, p.frame_count, p.payload) for p in after]
    assert fresh_differs


def test_a_checkpoint_needs_the_settings_that_made_it(noisy_three):
    c = FeatureStream().checkpoint()
    assert c is not None and c.sample == 0
    with pytest.raises(ValueError, match="other settings"):
        FeatureStream.resume(c, VadOptions(speech_pad_ms=30))
    with pytest.raises(ValueError, match="other settings"):
        FeatureStream.resume(c, packet_frames=10)
    stream = FeatureStream()
    stream.push(noisy_three[:CHECKPOINT_SAMPLES + 100])
    assert stream.checkpoint() is None  # off the grid
    resumed = FeatureStream.resume(_with_checkpoints(noisy_three, FeatureStream())[-1][0])
    assert resumed.flush() == []  # ended before the replay reached the checkpoint: nothing open


# ---- finalize on request (the speaker stopped; push-to-talk released) ------------------------------

def _finalized_at(audio, cut_s: float, piece: int = 1600):
    """Push `audio` in pieces, finalize once `cut_s` of it is in, push the rest, flush: the packets
    before the finalize, those it returned, and all of them."""
    stream = FeatureStream(mode="hifi")
    before, at, i = [], [], 0
    cut = int(cut_s * 16000) // piece * piece
    while i < cut:
        before += stream.push(audio[i:i + piece])
        i += piece
    at = stream.finalize()
    rest = []
    while i < audio.size:
        rest += stream.push(audio[i:i + piece])
        i += piece
    return stream, before, at, before + at + rest + stream.flush()


def test_finalize_mid_speech_ends_the_segment_at_once_and_the_speech_goes_on_in_the_next(audio):
    first = _vad_frames(audio)[0]
    cut_s = (first[0] + first[1]) / 2 / 100  # halfway through the first sentence
    stream, before, at, packets = _finalized_at(audio, cut_s)
    assert at and at[-1].segment_end and at[-1].finalized and not any(p.finalized for p in at[:-1])
    assert all(not p.finalized for p in before)
    end = at[-1].first_frame + at[-1].frame_count
    assert end <= round(cut_s * 100)  # no frame the stream has not computed yet: at once
    segs = _by_segment(packets)
    assert len(segs) == 3  # the first sentence in two, the second whole
    (a, pa), (b, pb), _ = sorted(segs.items())
    assert b == a + 1
    # the speech after the cut is the next segment, on at the very frame the finalized one ended
    assert pb[0].segment_start and pb[0].first_frame == end
    assert pb[-1].first_frame + pb[-1].frame_count == first[1]  # and ends where the VAD ends the sentence
    assert sum(p.finalized for p in packets) == 1
    # the frames are the stream's own (the cut only moves segment bounds)
    reference = RunningMaxFloor()(log_mel_raw(audio))
    for p in pa + pb:
        ref = reference[:, p.first_frame:p.first_frame + p.frame_count]
        assert feature_error_db(ref, decode_frames(p.payload)).rms_db < HIFI_RMS_DB
    assert packets[-1].segment_end  # the second sentence is untouched
    assert _spans(packets)[-1] == _vad_frames(audio)[1]


def test_finalize_in_the_pause_after_speech_ends_the_segment_without_waiting_for_min_silence(audio):
    first = _vad_frames(audio)[0]
    stream, before, at, packets = _finalized_at(audio, first[1] / 100 + 0.05)  # before the VAD decides
    assert not any(p.segment_end for p in before)
    assert at and at[-1].segment_end and at[-1].finalized
    assert len(_by_segment(packets)) == 2  # nothing opened after it: the pause went on
    assert _spans(packets)[0][1] <= first[1]


def test_finalize_with_nothing_open_sends_nothing(audio):
    stream = FeatureStream()
    assert stream.finalize() == []
    assert stream.push(audio[:8000]) == [] and stream.finalize() == []  # 0.5 s of silence
