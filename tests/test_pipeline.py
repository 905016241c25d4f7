"""edge/feature_stream: VAD-gated packets carry exactly the floored log-mel of each segment."""

import numpy as np
import pytest

from harken.edge.pipeline import FeatureStream
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
        # frames leave as soon as final, so a segment may overrun the VAD's end by the VAD's
        # end-decision delay (min silence - pad + a window), never fall short of it
        sent_end = ps[-1].first_frame + ps[-1].frame_count
        vad_end = -(-seg.end_sample // 160)
        o = VadOptions()
        assert vad_end <= sent_end <= vad_end + (o.min_silence_duration_ms - o.speech_pad_ms + 64) // 10 + 1
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


def test_packets_do_not_depend_on_piece_sizes(audio):
    """Up to each segment's VAD end the packets are byte-identical whatever the piece sizes; only
    how far the tail overruns the end depends on when the end decision arrives (bounded)."""
    rng = np.random.default_rng(7)
    whole = _by_segment(_run(audio, [])[1])
    pieces = _by_segment(_run(audio, rng.integers(1, 4000, size=200).tolist())[1])
    assert sorted(whole) == sorted(pieces)
    o = VadOptions()
    for sid in whole:
        w, p = whole[sid], pieces[sid]
        full = [x for x in w if x.frame_count == 20 and not x.segment_end]
        assert [(x.first_frame, x.frame_count, x.segment_start, x.payload) for x in full] == \
               [(x.first_frame, x.frame_count, x.segment_start, x.payload) for x in p[:len(full)]]
        w_end = w[-1].first_frame + w[-1].frame_count
        p_end = p[-1].first_frame + p[-1].frame_count
        assert w_end <= p_end <= w_end + (o.min_silence_duration_ms - o.speech_pad_ms + 64) // 10 + 20


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
