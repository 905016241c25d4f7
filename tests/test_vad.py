"""edge/vad.py against silero-vad's own code (the `silero-vad` package, torch in the tests only):
probabilities against `OnnxWrapper`, segments against `get_speech_timestamps` and
`get_speech_timestamps_from_probs`, and segment placement against speech whose edges are known by
construction."""

from __future__ import annotations

import math
import tracemalloc
from dataclasses import fields

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from signals import concat, noise, silence, speech
from silero_vad.utils_vad import OnnxWrapper
from silero_vad.utils_vad import get_speech_timestamps as silero_get_speech_timestamps
from silero_vad.utils_vad import get_speech_timestamps_from_probs

from harken.edge.models import build_silero_vad_windows
from harken.edge.vad import (
    MAX_WINDOWS_PER_RUN, MODEL_PATH, VENDORED_MODEL_PATH, WINDOW_SAMPLES, SegmentEnd, SegmentStart,
    SileroVad, SpeechSegmenter, StreamingVad, VadOptions, get_speech_timestamps, segments_from_events,
)
from harken.shared.errors import AudioError, HarkenError

SR = 16_000
SENTENCE_A = "The quick brown fox jumps over the lazy dog."
SENTENCE_B = "She sells sea shells by the sea shore, every single morning."


@pytest.fixture(scope="module")
def vad() -> SileroVad:
    return SileroVad()


@pytest.fixture(scope="module")
def reference() -> OnnxWrapper:
    return OnnxWrapper(str(VENDORED_MODEL_PATH), force_onnx_cpu=True)


def voiced(text: str, voice: str = "en-us") -> np.ndarray:
    """espeak-ng speech cut to its first and last non-silent sample, so its edges are known."""
    x = speech(text, voice)
    loud = np.flatnonzero(np.abs(x) > 1e-3)
    return x[loud[0]:loud[-1] + 1]


def two_sentences(gap_s: float, voice: str = "en-us") -> tuple[np.ndarray, list[tuple[int, int]]]:
    """1 s silence, sentence A, gap, sentence B, 1 s silence; and the true speech spans."""
    a, b = voiced(SENTENCE_A, voice), voiced(SENTENCE_B, voice)
    lead, gap = SR, int(round(gap_s * SR))
    spans = [(lead, lead + a.size), (lead + a.size + gap, lead + a.size + gap + b.size)]
    return concat(silence(1.0), a, silence(gap_s), b, silence(1.0)), spans


def reference_probabilities(reference: OnnxWrapper, audio: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return reference.audio_forward(torch.from_numpy(audio), SR).numpy()[0]


def random_pieces(audio: np.ndarray, rng: np.random.Generator, max_piece: int = 3000):
    """Cut audio at random points, with one empty and one one-sample piece among them."""
    cuts = rng.integers(0, audio.size, size=max(2, audio.size // (max_piece // 2)))
    return np.split(audio, np.sort(np.concatenate([cuts, [cuts[0], cuts[0] + 1]])))


SIGNALS = {
    "speech": lambda: concat(silence(0.3), speech(SENTENCE_A), silence(0.2), speech(SENTENCE_B, "en-gb")),
    "noise": lambda: noise(3.0, amplitude=0.2, seed=1),
    "silence": lambda: silence(2.0),
    "odd_length": lambda: speech(SENTENCE_B)[:SR + 123],
    # more windows than one model call takes (MAX_WINDOWS_PER_RUN): the state crosses calls
    "long": lambda: np.tile(concat(speech(SENTENCE_A), noise(0.5, 0.05, seed=2)), 12)[:40 * SR + 7],
}


@pytest.mark.parametrize("name", sorted(SIGNALS))
def test_probabilities_equal_silero_onnx_wrapper(name, vad, reference):
    audio = SIGNALS[name]()
    expected = reference_probabilities(reference, audio)
    got = vad.probabilities(audio)
    assert got.shape == (math.ceil(audio.size / WINDOW_SAMPLES),) == expected.shape
    assert name != "long" or got.size > MAX_WINDOWS_PER_RUN
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_probabilities_equal_silero_onnx_wrapper(seed, vad, reference):
    audio = SIGNALS["speech"]()
    expected = reference_probabilities(reference, audio)
    vad.reset()
    got = [vad.push(piece) for piece in random_pieces(audio, np.random.default_rng(seed))]
    got = np.concatenate(got + [vad.flush()])
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


def test_committed_windows_model_is_built_from_the_vendored_model(tmp_path):
    rebuilt = build_silero_vad_windows.export(tmp_path / "windows.onnx", VENDORED_MODEL_PATH)
    assert rebuilt.read_bytes() == MODEL_PATH.read_bytes()


def test_streams_sharing_one_model_keep_their_own_state(vad, reference):
    first, second = SIGNALS["speech"](), SIGNALS["noise"]()
    a, b = vad.new_stream(), vad.new_stream()
    size = 3 * WINDOW_SAMPLES + 100
    got_a, got_b = [], []
    for i in range(0, max(first.size, second.size), size):  # interleaved pushes
        got_a.append(a.push(first[i:i + size]))
        got_b.append(b.push(second[i:i + size]))
    got_a = np.concatenate(got_a + [a.flush()])
    got_b = np.concatenate(got_b + [b.flush()])
    np.testing.assert_allclose(got_a, reference_probabilities(reference, first), rtol=0, atol=1e-5)
    np.testing.assert_allclose(got_b, reference_probabilities(reference, second), rtol=0, atol=1e-5)


def test_integer_pcm_is_scaled_and_multichannel_is_refused(vad):
    audio = speech(SENTENCE_A)
    pcm16 = np.round(audio * 32767).astype(np.int16)
    np.testing.assert_allclose(vad.probabilities(pcm16), vad.probabilities(pcm16 / 32768.0), atol=1e-6)
    with pytest.raises(AudioError):
        vad.push(np.zeros((WINDOW_SAMPLES, 2), dtype=np.float32))


@pytest.mark.parametrize("voice", ["en-us", "en-gb", "de"])
def test_segments_land_on_the_speech(voice, vad):
    options = VadOptions()
    audio, spans = two_sentences(gap_s=1.5, voice=voice)
    segments = get_speech_timestamps(audio, options, vad)
    assert len(segments) == len(spans)
    # silero's decision lags the waveform by up to ~3 windows; the pad comes on top
    tolerance = (options.speech_pad_ms + 100) * SR // 1000
    for seg, (start, end) in zip(segments, spans):
        assert abs(seg.start_sample - start) <= tolerance
        assert abs(seg.end_sample - end) <= tolerance
        assert seg.start_sample <= start and seg.end_sample >= end  # the pad covers the speech
        assert seg.start_s == seg.start_sample / SR and seg.end_s == seg.end_sample / SR


@pytest.mark.parametrize("gap_s", [0.1, 0.2])
def test_a_gap_shorter_than_min_silence_does_not_split(gap_s, vad):
    audio, spans = two_sentences(gap_s=gap_s)
    segments = get_speech_timestamps(audio, VadOptions(min_silence_duration_ms=300), vad)
    assert len(segments) == 1
    assert segments[0].start_sample <= spans[0][0] and segments[0].end_sample >= spans[1][1]


@pytest.mark.parametrize("audio", [silence(5.0), noise(5.0, amplitude=0.01, seed=3),
                                   noise(5.0, amplitude=0.003, seed=4)],
                         ids=["silence", "noise-40dB", "noise-50dB"])
def test_no_segments_without_speech(audio, vad):
    assert get_speech_timestamps(audio, VadOptions(), vad) == []


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_streaming_events_equal_one_push(seed, vad):
    audio, _ = two_sentences(gap_s=0.6)
    audio = concat(audio, voiced(SENTENCE_A)[:SR // 3])  # ends inside speech: flush closes it
    options = VadOptions(min_silence_duration_ms=250, speech_pad_ms=60)
    whole = StreamingVad(options, vad)
    expected = whole.push(audio) + whole.flush()
    stream = StreamingVad(options, vad)
    got = [e for piece in random_pieces(audio, np.random.default_rng(seed)) for e in stream.push(piece)]
    assert got + stream.flush() == expected
    assert len(expected) == 6


@pytest.mark.parametrize("options", [VadOptions(), VadOptions(min_silence_duration_ms=100, speech_pad_ms=30)],
                         ids=["harken-defaults", "silero-defaults"])
def test_agrees_with_silero_get_speech_timestamps(options, vad, reference):
    audio = concat(two_sentences(gap_s=1.5)[0], two_sentences(gap_s=0.8, voice="de")[0])
    ours = [(s.start_sample, s.end_sample) for s in get_speech_timestamps(audio, options, vad)]
    theirs = silero_get_speech_timestamps(
        torch.from_numpy(audio), reference, threshold=options.threshold,
        min_speech_duration_ms=options.min_speech_duration_ms,
        min_silence_duration_ms=options.min_silence_duration_ms, speech_pad_ms=options.speech_pad_ms)
    assert len(ours) == len(theirs) >= 4
    # with min_silence >= 2 * pad the rules are silero's own, so agreement is exact; allow one
    # window for a probability rounding across the threshold
    for (start, end), ref in zip(ours, theirs):
        assert abs(start - ref["start"]) <= WINDOW_SAMPLES and abs(end - ref["end"]) <= WINDOW_SAMPLES


def _segment(probabilities: list[float], total_samples: int, options: VadOptions):
    segmenter = SpeechSegmenter(options)
    split = max(0, len(probabilities) - 1)
    return segmenter.push(probabilities[:split]) + segmenter.finish(probabilities[split:], total_samples)


def _check_event_stream(events, options: VadOptions, total_samples: int) -> None:
    """Starts and ends alternate per segment, segments don't overlap, and every event comes no
    later than the documented look-ahead."""
    pad = options.speech_pad_ms * SR // 1000
    min_speech = options.min_speech_duration_ms * SR // 1000
    min_silence = options.min_silence_duration_ms * SR // 1000
    assert [type(e) for e in events] == [SegmentStart, SegmentEnd] * (len(events) // 2)
    previous_end = 0
    for i, (start, end) in enumerate(zip(events[::2], events[1::2])):
        assert start.segment_id == end.segment_id and start.start_sample == end.start_sample
        assert previous_end <= start.start_sample < end.end_sample <= total_samples
        previous_end = end.end_sample
        if math.isinf(options.max_speech_duration_s):  # a cut at max speech reaches back further
            window_rounding = 2 * WINDOW_SAMPLES
            assert start.decided_at_sample - start.start_sample <= min_speech + min_silence + pad + window_rounding
            assert end.decided_at_sample - end.end_sample <= max(min_silence - pad, 0) + window_rounding
    assert [e.segment_id for e in events[::2]] == sorted({e.segment_id for e in events})


# blocky probability sequences: runs of one value, as real speech/pause gives
probability_runs = st.lists(st.tuples(st.floats(0.0, 1.0, width=32), st.integers(1, 15)), max_size=40)
# the same, never between neg_threshold (0.35) and threshold (0.5): there harken and silero differ
# by design (see SpeechSegmenter)
decisive_runs = st.lists(st.tuples(st.floats(0.0, 1.0, width=32).filter(lambda p: not 0.35 <= p < 0.5),
                                   st.integers(1, 15)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(runs=decisive_runs, tail=st.integers(0, WINDOW_SAMPLES - 1),
       min_speech_ms=st.sampled_from([0, 64, 250]), min_silence_ms=st.sampled_from([0, 100, 300]),
       pad_ms=st.sampled_from([0, 30, 100]), max_speech_s=st.sampled_from([math.inf, 0.6, 1.5]))
def test_segmenter_equals_silero_on_random_probabilities(runs, tail, min_speech_ms, min_silence_ms,
                                                         pad_ms, max_speech_s):
    if not math.isinf(max_speech_s):
        pad_ms = 0  # silero splits short gaps between cut pieces in half; harken gives pad to the earlier
    min_silence_ms = max(min_silence_ms, 2 * pad_ms)  # where silero's padding and ours coincide
    probabilities = [p for p, n in runs for _ in range(n)]
    total = len(probabilities) * WINDOW_SAMPLES - (tail if probabilities else 0)
    options = VadOptions(min_speech_duration_ms=min_speech_ms, min_silence_duration_ms=min_silence_ms,
                         speech_pad_ms=pad_ms, max_speech_duration_s=max_speech_s)
    events = _segment(probabilities, total, options)
    expected = get_speech_timestamps_from_probs(
        probabilities, threshold=options.threshold, min_speech_duration_ms=min_speech_ms,
        min_silence_duration_ms=min_silence_ms, speech_pad_ms=pad_ms,
        max_speech_duration_s=max_speech_s, audio_length_samples=total)
    got = [(s.start_sample, s.end_sample) for s in segments_from_events(events)]
    assert got == [(s["start"], s["end"]) for s in expected]
    _check_event_stream(events, options, total)


@settings(max_examples=200, deadline=None)
@given(runs=probability_runs, pad_ms=st.integers(0, 400), min_silence_ms=st.integers(0, 400),
       min_speech_ms=st.integers(0, 400))
def test_segmenter_invariants_for_any_options(runs, pad_ms, min_silence_ms, min_speech_ms):
    probabilities = [p for p, n in runs for _ in range(n)]
    total = len(probabilities) * WINDOW_SAMPLES
    options = VadOptions(min_speech_duration_ms=min_speech_ms, min_silence_duration_ms=min_silence_ms,
                         speech_pad_ms=pad_ms)
    _check_event_stream(_segment(probabilities, total, options), options, total)


@settings(max_examples=300, deadline=None)
@given(runs=probability_runs, tail=st.integers(0, WINDOW_SAMPLES - 1), pad_ms=st.integers(0, 400),
       min_silence_ms=st.integers(0, 400), min_speech_ms=st.integers(0, 400),
       max_speech_s=st.sampled_from([math.inf, 0.6, 1.5]))
def test_earliest_end_never_exceeds_the_end_that_comes(runs, tail, pad_ms, min_silence_ms, min_speech_ms,
                                                       max_speech_s):
    """After every window, `earliest_end_sample` is set exactly while a segment is open (its start
    emitted, its end not), and the end that segment gets, however the stream goes on, is never
    before it (unless the stream ends first): frames before the bound can leave without running
    past the segment's end."""
    probabilities = [p for p, n in runs for _ in range(n)]
    total = len(probabilities) * WINDOW_SAMPLES - (tail if probabilities else 0)
    options = VadOptions(min_speech_duration_ms=min_speech_ms, min_silence_duration_ms=min_silence_ms,
                         speech_pad_ms=pad_ms, max_speech_duration_s=max_speech_s)
    segmenter = SpeechSegmenter(options)
    open_id: int | None = None
    bounds: dict[int, int] = {}  # segment id -> the highest bound given while it was open

    def apply(events):
        nonlocal open_id
        for e in events:
            if isinstance(e, SegmentStart):
                assert open_id is None
                open_id = e.segment_id
            else:
                # the stream's end cuts a segment short wherever it comes
                assert e.segment_id == open_id and min(bounds.get(e.segment_id, 0), total) <= e.end_sample
                open_id = None

    split = max(0, len(probabilities) - 1)
    for p in probabilities[:split]:
        apply(segmenter.push([p]))
        bound = segmenter.earliest_end_sample
        assert (bound is None) == (open_id is None)
        if bound is not None:
            bounds[open_id] = max(bounds.get(open_id, 0), bound)
    apply(segmenter.finish(probabilities[split:], total))
    assert open_id is None


def test_start_is_decided_within_min_speech_plus_pad_during_continuous_speech():
    options = VadOptions()
    onset_window = 40
    probabilities = [0.0] * onset_window + [0.9] * 60
    events = SpeechSegmenter(options).push(probabilities)
    assert len(events) == 1 and isinstance(events[0], SegmentStart)
    lag = events[0].decided_at_sample - events[0].start_sample
    assert lag <= (options.min_speech_duration_ms + options.speech_pad_ms) * SR // 1000 + WINDOW_SAMPLES


def test_a_pause_hovering_between_the_thresholds_still_ends_the_segment():
    options = VadOptions()
    probabilities = [0.9] * 20 + [0.1] + [0.4] * 60  # below 0.35 once, then between 0.35 and 0.5
    events = SpeechSegmenter(options).push(probabilities)
    assert [type(e) for e in events] == [SegmentStart, SegmentEnd]
    pause_start = 20 * WINDOW_SAMPLES
    pad = options.speech_pad_ms * SR // 1000
    assert events[1].end_sample == pause_start + pad
    min_silence = options.min_silence_duration_ms * SR // 1000
    assert events[1].decided_at_sample - pause_start <= min_silence + 2 * WINDOW_SAMPLES


def test_memory_stays_bounded_over_ten_minutes(vad):
    cycle = concat(voiced(SENTENCE_A), silence(1.0), voiced(SENTENCE_B, "en-gb"), silence(0.7))
    repeats = int(np.ceil(600 * SR / cycle.size))
    stream = StreamingVad(VadOptions(), vad)
    rng = np.random.default_rng(0)
    segments = 0
    tracemalloc.start()
    try:
        for r in range(repeats):
            for piece in np.array_split(cycle, rng.integers(20, 60)):
                segments += sum(isinstance(e, SegmentEnd) for e in stream.push(piece))
                assert stream.vad.buffered_samples < WINDOW_SAMPLES
            if r == 2:
                baseline, _ = tracemalloc.get_traced_memory()
        grown = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    assert stream.samples_seen >= 600 * SR
    assert segments >= 2 * repeats - 1
    assert grown < 64 * 1024
    state = stream.segmenter.state
    assert all(not isinstance(getattr(state, f.name), (list, dict, np.ndarray)) for f in fields(state))


def test_options_defaults_match_the_command_line_and_bad_values_are_rejected():
    options = VadOptions()
    assert (options.threshold, options.min_speech_duration_ms, options.min_silence_duration_ms,
            options.speech_pad_ms) == (0.5, 250, 300, 100)
    assert options.exit_threshold == pytest.approx(0.35) and math.isinf(options.max_speech_duration_s)
    for bad in (dict(threshold=1.5), dict(min_silence_duration_ms=-1), dict(max_speech_duration_s=0),
                dict(neg_threshold=0.9)):
        with pytest.raises(HarkenError):
            VadOptions(**bad)
