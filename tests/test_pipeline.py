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
