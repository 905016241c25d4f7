"""cloud/inference/word_timings.py: committed segments aligned in bounded batches, times on the stream's timeline."""

from __future__ import annotations

import numpy as np
import pytest

from harken.cloud.model.aligner import AlignedWord, Qwen3ForcedAligner
from harken.cloud.model.tiny_aligner import make_tiny_aligner
from harken.cloud.inference.word_timings import SegmentAligner


@pytest.fixture(scope="module")
def aligner(tmp_path_factory):
    d = make_tiny_aligner(tmp_path_factory.mktemp("wt") / "tiny", seed=2, vocab="small")
    return Qwen3ForcedAligner.load(str(d), dtype="fp64", device="cpu")


def _feats(frames: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (128, frames)).astype(np.float32)


SEGMENTS = [("a", 0, 230, "hello there world", 0.5), ("b", 0, 90, "one", 1.0), ("a", 1, 410, "so, what now?", 3.2),
            ("c", 4, 120, "...", 7.0), ("b", 1, 1600, "a longer segment of speech here", 2.0)]


def test_each_segment_gets_its_own_alignment_shifted_to_the_stream(aligner):
    sa = SegmentAligner(aligner, max_batch=8, max_frames=100_000)
    for i, (key, seg, frames, text, start) in enumerate(SEGMENTS):
        sa.submit(key, seg, _feats(frames, i), text, start)
    out = sa.step()
    assert sa.pending() == 0 and [(k, w.segment_id) for k, w in out] == [(k, s) for k, s, *_ in SEGMENTS]
    for i, ((key, seg, frames, text, start), (_, got)) in enumerate(zip(SEGMENTS, out)):
        alone = aligner.align(_feats(frames, i), text)
        # on the stream: shifted by the segment's start, kept within its audio
        assert list(got.words) == [AlignedWord(w.text, round(start + min(w.start, frames / 100), 3),
                                               round(start + min(w.end, frames / 100), 3)) for w in alone]
        assert all(start <= w.start <= w.end <= start + frames / 100 + 1e-9 for w in got.words)
    assert out[3][1].words == ()  # no words: an empty result
    assert out[0][1].as_dict()["words"][0]["text"] == "hello"


def test_passes_are_bounded_and_first_come_first_served(aligner):
    sa = SegmentAligner(aligner, max_batch=2, max_frames=500)
    for i, (key, seg, frames, text, start) in enumerate(SEGMENTS):
        sa.submit(key, seg, _feats(frames, i), text, start)
    sizes = []
    order = []
    while sa.pending():
        got = sa.step()
        sizes.append(len(got))
        order += [(k, w.segment_id) for k, w in got]
    # 230+90 fit; 410 alone (410+120 > 500); 120 then the 1600-frame segment alone (over the bound)
    assert sizes == [2, 1, 1, 1]
    assert order == [(k, s) for k, s, *_ in SEGMENTS]
    assert sa.step() == []


def test_drop_forgets_a_closed_sessions_segments(aligner):
    sa = SegmentAligner(aligner)
    for i, (key, seg, frames, text, start) in enumerate(SEGMENTS):
        sa.submit(key, seg, _feats(frames, i), text, start)
    assert sa.drop("a") == 2 and sa.pending() == 3
    assert all(k != "a" for k, _ in sa.step())


# --- the embedded live path: `harken stream --json --word-timings` ---------------------------------------

def test_embedded_stream_gets_word_timings_after_each_final_segment_and_the_same_text(aligner, tmp_path):
    from signals import concat, silence, speech

    from harken.cloud.embedded import stream_pieces
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.model.aligner import split_words
    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.inference.decoder_stream import SessionOptions
    from harken.cloud.embedded import stream_with_word_timings
    from harken.cloud.inference.word_timings import SegmentWords

    audio = concat(silence(0.5), speech("hello there, this is a test"), silence(1.0), speech("and a second one"),
                   silence(0.8))
    asr = Qwen3ASR.load("tiny")
    options = SessionOptions(language="English")

    def pieces():
        return (audio[i:i + 1600] for i in range(0, len(audio), 1600))

    def engine():
        return Engine(asr, EngineConfig(max_sessions=1, max_batch=1, slot_policy=options.policy))

    plain = list(stream_pieces(pieces(), engine(), options))
    mixed = list(stream_with_word_timings(pieces(), engine(), options, SegmentAligner(aligner)))
    events = [e for e in mixed if not isinstance(e, SegmentWords)]
    assert events == plain  # timings are an addition: the transcript is untouched
    finals = [e for e in plain if e.is_final]
    assert len(finals) >= 2
    for i, e in enumerate(mixed):
        if isinstance(e, SegmentWords):
            before = mixed[i - 1]
            assert not isinstance(before, SegmentWords) and before.is_final and before.segment_id == e.segment_id
            text = "".join(x.committed_delta for x in plain if x.segment_id == e.segment_id)
            assert [w.text for w in e.words] == split_words(text)
            assert all(w.start >= before.start_s and w.end >= w.start for w in e.words)
    assert [e.segment_id for e in mixed if isinstance(e, SegmentWords)] == [e.segment_id for e in finals]


@pytest.mark.parametrize("extra,message", [([], "goes with --json"), (["--json", "--word-cues"],
                                                                       "goes with --format srt or vtt")])
def test_stream_word_timings_option_errors(tmp_path, extra, message):
    import subprocess
    import sys

    from signals import speech, write_wav

    wav = write_wav(tmp_path / "a.wav", speech("hi"))
    out = subprocess.run([sys.executable, "-m", "harken.cli", "stream", str(wav), "--model", "tiny", "--word-timings",
                          "--aligner", "tiny", *extra], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr
