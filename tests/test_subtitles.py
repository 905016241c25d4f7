"""Subtitles (shared/subtitles.py, `harken transcribe|stream --format srt|vtt`): what harken writes
is read back by independent parsers (the `srt` package for SubRip, `webvtt-py` for WebVTT) as one
cue per finished segment, with the segment's times and its committed text."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from datetime import timedelta

import srt
import webvtt

from harken.shared.subtitles import SubtitleCues, WordCues, cues_of, srt as to_srt, timestamp, vtt as to_vtt
from harken.shared.transcript import SegmentTimings, TimedWord, TranscriptEvent


def _ev(seg: int, delta: str, start: float, end: float, final: bool, partial: str = "") -> TranscriptEvent:
    return TranscriptEvent(seg, delta, partial, 0.5, start, end, "English", final)


EVENTS = [
    _ev(0, "Good morning", 0.54, 2.0, False, partial=" every"),
    _ev(0, " everyone.", 0.54, 3.25, True),
    _ev(1, "", 4.0, 5.0, True),  # a segment with no words: no cue
    _ev(2, "Let's review the budget for the third quarter, starting with travel --> hotels", 3661.0, 3665.1234, False),
    _ev(2, ".", 3661.0, 3666.5, True),
]


def test_cues_are_finished_segments_with_their_times_and_text():
    cues = cues_of(EVENTS)
    assert [(c.index, c.start_s, c.end_s) for c in cues] == [(1, 0.54, 3.25), (2, 3661.0, 3666.5)]
    assert cues[0].text == "Good morning everyone."
    acc = SubtitleCues()
    assert [acc.add(e) is not None for e in EVENTS] == [False, True, False, False, True]
    assert timestamp(3666.5, ",") == "01:01:06,500" and timestamp(0.0016, ".") == "00:00:00.002"
    assert timestamp(float("nan"), ",") == "00:00:00,000"


def test_srt_reads_back_in_an_independent_parser():
    cues = cues_of(EVENTS)
    parsed = list(srt.parse(to_srt(cues)))
    assert [p.index for p in parsed] == [1, 2]
    assert [(p.start, p.end) for p in parsed] == [(timedelta(seconds=0.54), timedelta(seconds=3.25)),
                                                 (timedelta(seconds=3661), timedelta(seconds=3666.5))]
    assert [" ".join(p.content.split()) for p in parsed] == [c.text.replace("-->", "->") for c in cues]
    assert all(len(line) <= 42 for p in parsed for line in p.content.splitlines())


def test_vtt_reads_back_in_an_independent_parser():
    cues = cues_of(EVENTS)
    parsed = webvtt.from_buffer(io.StringIO(to_vtt(cues)))
    assert [(c.start_in_seconds, c.end_in_seconds) for c in parsed] == [(0, 3), (3661, 3666)]  # whole seconds
    assert [c.start for c in parsed] == ["00:00:00.540", "01:01:01.000"]
    assert [c.end for c in parsed] == ["00:00:03.250", "01:01:06.500"]
    assert [" ".join(c.text.split()) for c in parsed] == [c.text.replace("-->", "->") for c in cues]


def test_word_cues_are_a_cue_per_timed_word_and_segment_cues_where_no_timings_come():
    words = SegmentTimings(0, (TimedWord("Good", 0.6, 0.9), TimedWord("morning", 0.9, 1.4),
                               TimedWord("everyone", 1.5, 3.2)))
    acc = WordCues()
    out = []
    for item in EVENTS[:2] + [words] + EVENTS[2:]:
        out += acc.add(item)
    assert [(c.index, c.start_s, c.end_s, c.text) for c in out] == [
        (1, 0.6, 0.9, "Good"), (2, 0.9, 1.4, "morning"), (3, 1.5, 3.2, "everyone")]
    # segment 2's timings never came (a server without an aligner): its segment cue, numbered on
    rest = acc.flush()
    assert [(c.index, c.start_s, c.text[:10]) for c in rest] == [(4, 3661.0, "Let's revi")]
    parsed = list(srt.parse(to_srt(out + rest)))
    assert [p.content for p in parsed[:3]] == ["Good", "morning", "everyone"]
    # timings without words keep the segment's cue; a later segment's timings release earlier held cues
    acc = WordCues()
    assert acc.add(EVENTS[1]) == [] and acc.add(EVENTS[3]) == [] and acc.add(EVENTS[4]) == []
    got = acc.add(SegmentTimings(2, ()))
    assert [(c.index, c.text[:4]) for c in got] == [(1, "ever"), (2, "Let'")]


def _harken(*args: str) -> str:
    run = subprocess.run([sys.executable, "-m", "harken.cli", *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_transcribe_and_stream_write_the_engines_segments_as_subtitles():
    """On a model that writes words (tiny-untied), `transcribe --format srt` and `stream --format vtt`
    give one cue per final segment of `stream --json`, at its times, with its committed text."""
    common = ["--model", "tiny-untied", "--language", "English"]
    lines = [json.loads(line) for line in _harken("stream", "harken/data/sample.wav", *common, "--json").splitlines()]
    events = [e for e in lines if "type" not in e]  # (turn events, {"type": ...}, aside)
    finals = [e for e in events if "segment_id" in e and e["is_final"]]
    texts: dict[int, str] = {}
    for e in events:
        if "segment_id" in e:
            texts[e["segment_id"]] = texts.get(e["segment_id"], "") + e["committed_delta"]
    expected = [(f["start_s"], f["end_s"], texts[f["segment_id"]].strip()) for f in finals
                if texts[f["segment_id"]].strip()]
    assert len(expected) >= 2

    got_srt = list(srt.parse(_harken("transcribe", "harken/data/sample.wav", *common, "--format", "srt")))
    assert [(p.start.total_seconds(), p.end.total_seconds()) for p in got_srt] == \
        [(round(a, 3), round(b, 3)) for a, b, _ in expected]
    assert [" ".join(p.content.split()) for p in got_srt] == [" ".join(t.replace("-->", "->").split())
                                                              for _, _, t in expected]
    got_vtt = webvtt.from_buffer(io.StringIO(_harken("stream", "harken/data/sample.wav", *common, "--format", "vtt")))
    assert [" ".join(c.text.split()) for c in got_vtt] == [" ".join(p.content.split()) for p in got_srt]
    assert [c.start for c in got_vtt] == [timestamp(a, ".") for a, _, _ in expected]


def test_json_and_format_must_agree():
    run = subprocess.run([sys.executable, "-m", "harken.cli", "stream", "harken/data/sample.wav", "--model", "tiny",
                          "--json", "--format", "srt"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--json and --format srt disagree" in run.stderr and "Traceback" not in run.stderr
