"""`harken bench wer` and its pieces: espeak-ng word timing against the audio itself, per-word latency
and partial churn on scripted events with known answers, and a fast run of every path."""

import math
import subprocess

import numpy as np
import pytest

from harken.bench.wer import (PATHS, AudioClock, WerBenchOptions, bench_wer, load_utterances, paced_pieces, run_served,
                              stream_timed)
from harken.training import speech
from harken.training.espeak_word_ends import WordTime, synthesize, word_ends, word_ends_dry
from harken.bench.word_latency import TimedEvent, final_latencies, finalize_latency, partial_churn, word_latencies
from harken.shared.errors import HarkenError
from harken.shared.transcript import TranscriptEvent

# ---- word timing ----------------------------------------------------------------------------------


def _island_ends(x: np.ndarray, rate_hz: int, min_gap_s: float = 0.15, floor_db: float = -30.0) -> list[float]:
    """Ends of the sounding stretches of `x` separated by at least `min_gap_s` of near silence
    (10 ms frames more than `floor_db` below the loudest): the reference the events are checked on."""
    hop = rate_hz // 100
    peaks = np.array([np.abs(x[i:i + hop]).max() for i in range(0, x.size - hop + 1, hop)])
    loud = peaks > peaks.max() * 10 ** (floor_db / 20)
    ends, i = [], 0
    while i < loud.size:
        if loud[i] and (i + 1 == loud.size or not loud[i + 1]):
            j = i + 1
            while j < loud.size and not loud[j]:
                j += 1
            if j == loud.size or j - i - 1 >= min_gap_s * 100:
                ends.append((i + 1) * hop / rate_hz)
            i = j
        else:
            i += 1
    return ends


@pytest.mark.parametrize("voice,variant,rate", [("en-us", "", 120), ("en-gb", "m3", 200), ("en-029", "f2", 160),
                                                ("en-us-nyc", "m7", 220)])
def test_library_synthesis_is_the_espeak_command(voice, variant, rate):
    """The timed audio is exactly what `espeak-ng` (the corpus's synthesiser) writes, including a
    voice named by language + variant (en-gb+m3), which needs the command's fallback."""
    text = "Alpha. We spent $12,929 on it."
    pcm, rate_hz, _ = synthesize(text, voice, variant, rate, 40)
    v = f"{voice}+{variant}" if variant else voice
    wav = subprocess.run(["espeak-ng", "-v", v, "-s", str(rate), "-p", "40", "--stdout", "--", text],
                         capture_output=True, check=True).stdout
    assert rate_hz == int.from_bytes(wav[24:28], "little")
    assert pcm == wav[44:]
    # a second synthesis in this process gives the same (the library alone would not)
    assert synthesize(text, voice, variant, rate, 40)[0] == pcm


@pytest.mark.parametrize("voice,variant,rate", [("en-us", "", 120), ("en-gb", "m3", 200), ("en-029", "f2", 160),
                                                ("en-us-nyc", "m7", 220)])
def test_word_ends_are_where_each_word_falls_silent(voice, variant, rate):
    """Words of known length: each spoken alone between sentence pauses, so where it ends can be
    read off the waveform. A number is one token however many words espeak-ng says for it."""
    text = "Alpha. Seventeen. 956. Bravo."
    pcm, rate_hz, _ = synthesize(text, voice, variant, rate, 50)
    reference = _island_ends(np.frombuffer(pcm, "<i2").astype(np.float32), rate_hz)
    words = word_ends_dry(text, voice, variant, rate, 50)
    assert [w.word for w in words] == text.split()
    assert len(reference) == len(words)
    for w, end in zip(words, reference):
        assert abs(w.end_s - end) <= 0.025, (w, end)


def test_word_ends_follow_the_rendered_recipe():
    """Tempo and leading silence move the words in `speech.render`'s audio; the times follow."""
    recipe = speech.Recipe(text="Alpha. Seventeen. Bravo.", voice="en-gb", variant="f2", rate=150, pitch=60,
                           tempo=1.08, lead_s=0.63, trail_s=0.2, gain_db=-6.0, seed=3)
    audio = speech.render(recipe)
    words = word_ends(recipe)
    assert words is not None
    reference = _island_ends(audio, speech.SAMPLE_RATE)
    assert len(reference) == 3
    for w, end in zip(words, reference):
        assert abs(w.end_s - end) <= 0.025, (w, end)
    assert word_ends(speech.Recipe(text="Alpha.", voice=speech.PIPER, rate=1.0)) is None


# ---- latency and churn on scripted events -----------------------------------------------------------

def _ev(segment_id, committed, partial, final=False):
    return TranscriptEvent(segment_id, committed, partial, 0.5, 0.0, 0.0, "English", final)


def _scripted():
    """Reference "The cat sat. On the mat." (ends 0.5, 1.0, 1.5 | 2.5, 3.0, 3.5); two segments.
    Segment 0 shows "the cap" (a wrong partial), then commits "The", then "cat sat."; segment 1
    shows "on a" partly, commits "On the", and ends with "mat!" (punctuation differs) — and an
    extra word "yes" the reference does not have."""
    words = [WordTime("The", 0.5), WordTime("cat", 1.0), WordTime("sat.", 1.5),
             WordTime("On", 2.5), WordTime("the", 3.0), WordTime("mat.", 3.5)]
    events = [
        TimedEvent(1.2, _ev(0, "", "the cap")),
        TimedEvent(2.2, _ev(0, "The", " cat")),
        TimedEvent(2.4, _ev(0, " cat sat.", "", final=True)),
        TimedEvent(3.1, _ev(1, "", "On a")),
        TimedEvent(3.4, _ev(1, "On", " the mat")),
        TimedEvent(4.0, _ev(1, " the", " mat! yes")),
        TimedEvent(4.6, _ev(1, " mat! yes", "", final=True)),
    ]
    return words, events


def test_word_latency_on_scripted_events():
    words, events = _scripted()
    got = {(w.word, w.end_s): (w.partial_s, w.commit_s) for w in word_latencies(events, words)}
    expected = {
        ("The", 0.5): (1.2 - 0.5, 2.2 - 0.5),   # shown as "the" at 1.2 (case and punctuation aside)
        ("cat", 1.0): (2.2 - 1.0, 2.4 - 1.0),   # "cap" at 1.2 was not it
        ("sat.", 1.5): (2.4 - 1.5, 2.4 - 1.5),  # first appears committed
        ("On", 2.5): (3.1 - 2.5, 3.4 - 2.5),
        ("the", 3.0): (3.4 - 3.0, 4.0 - 3.0),   # "a" at 3.1 was not it
        ("mat.", 3.5): (3.4 - 3.5, 4.6 - 3.5),  # guessed before its end: negative
    }
    assert got.keys() == expected.keys()
    for key, (p, c) in expected.items():
        assert got[key][0] == pytest.approx(p) and got[key][1] == pytest.approx(c), key


def test_partial_churn_on_scripted_events():
    """Partial words shown: segment 0 {(0,the), (1,cap), (1,cat)}, segment 1 {(0,on), (1,a),
    (1,the), (2,mat), (2,mat!)->mat, (3,yes)}: (1,cap) and (1,a) changed: 2 of 8."""
    _, events = _scripted()
    churn = partial_churn(events)
    assert (churn.shown, churn.changed) == (3 + 5, 2)
    assert churn.share == pytest.approx(2 / 8)


def test_unrecognised_words_have_no_latency():
    words = [WordTime("hello", 0.4), WordTime("world", 0.9)]
    events = [TimedEvent(1.5, _ev(0, "hello there", "", final=True))]
    got = word_latencies(events, words)
    assert got[0].commit_s == pytest.approx(1.1) and got[1].partial_s is None and got[1].commit_s is None
    assert word_latencies([], words)[0].commit_s is None
    assert partial_churn([]).share is None


def test_final_and_finalize_latency_on_scripted_events():
    words = [WordTime("one", 0.5), WordTime("two", 1.0), WordTime("three", 2.6)]
    seg = lambda sid, start, end, final: TranscriptEvent(sid, "x", "", 1.0, start, end, "English", final)  # noqa: E731
    events = [TimedEvent(0.9, seg(0, 0.3, 0.8, False)), TimedEvent(1.6, seg(0, 0.3, 1.2, True)),
              TimedEvent(3.0, seg(1, 2.2, 2.9, True)), TimedEvent(3.5, seg(2, 3.1, 3.4, True))]
    # segment 0's last word ends at 1.0 s, segment 1's at 2.6 s; segment 2 holds no reference word
    assert final_latencies(events, words) == pytest.approx([0.6, 0.4])
    assert finalize_latency(events, 2.8) == pytest.approx(0.2)  # the first final after the request
    assert finalize_latency(events, 3.6) is None  # every final came before it


def test_a_finalize_request_goes_in_right_after_the_audio_up_to_its_time():
    from harken.edge.client.front_end import FINALIZE

    clock, requested = AudioClock(), []
    audio = np.zeros(16000, np.float32)
    items = [(clock.now(), x) for x in paced_pieces(audio, clock, 0.0, finalize_at_s=0.45, requested=requested)]
    sizes = [x.size if isinstance(x, np.ndarray) else "F" for _, x in items]
    assert sizes == [1600] * 4 + [800, "F", 800] + [1600] * 5
    assert requested == [pytest.approx(0.45)] and items[5][1] is FINALIZE


def test_fake_clock_hands_pieces_over_at_their_capture_time():
    clock = AudioClock()
    audio = np.zeros(16000 * 2 + 800, np.float32)  # 2.05 s
    times = []
    for piece in paced_pieces(audio, clock, 0.0):
        times.append((clock.now(), piece.size))
    assert [round(t, 6) for t, _ in times] == [round(0.1 * (k + 1), 6) for k in range(20)] + [2.05]
    assert sum(n for _, n in times) == audio.size


# ---- the bench ------------------------------------------------------------------------------------

def test_bench_wer_runs_every_path(tmp_path):
    """Two short held-out utterances (a Piper one, an espeak-ng one) down every path with the tiny
    random model (its words mean nothing, so only the shape of the result is checked here)."""
    from harken.training import corpus

    lines = corpus.HELD_OUT_FILE.read_text(encoding="utf-8").splitlines()
    recipes = tmp_path / "two.jsonl"
    recipes.write_text("\n".join(lines[1:3]) + "\n", encoding="utf-8")
    out = bench_wer(WerBenchOptions(model="tiny", held_set=str(recipes), realtime=False))
    for path in PATHS:
        assert isinstance(out[f"wer_{path}"], float) and 0.0 <= out[f"wer_{path}"] <= 50.0, path
        assert f"kbps_{path}" in out
    for key in ("partial_latency_p50_s", "partial_latency_p95_s", "commit_latency_p50_s", "commit_latency_p95_s",
                "final_latency_p50_s", "final_latency_p95_s", "finalize_latency_p50_s", "finalize_latency_p95_s",
                "partial_churn"):
        assert key in out and (out[key] is None or math.isfinite(out[key]))
    assert out["n_words"] == sum(len(u.recipe.text.split()) for u in corpus.read_held_out(recipes))
    assert out["n_utterances"] == 2 and out["n_timed_utterances"] == 1
    assert out["kbps_offline"] is None
    assert out["stream_policy"] == {"update_interval_s": 1.0, "rollback_tokens": 5, "agreement": "local-agreement"}
    assert out["kbps_served_audio"] == pytest.approx(256.0)
    assert out["kbps_served_features_low"] < out["kbps_served_features_balanced"] < out["kbps_served_features_hifi"]
    assert out["kbps_webrtc"] == pytest.approx(out["kbps_served_features_balanced"])
    for kbps in (16, 24, 32):
        assert 0.5 * kbps < out[f"kbps_opus_{kbps}"] < 1.5 * kbps


def test_served_paths_read_the_same_at_any_concurrency(tmp_path, asr):
    """Utterances sent at once share the server's batched passes: each text, and the bytes sent,
    must be what it is one at a time."""
    import asyncio

    from harken.training import corpus

    lines = corpus.HELD_OUT_FILE.read_text(encoding="utf-8").splitlines()
    recipes = tmp_path / "three.jsonl"
    recipes.write_text("\n".join(lines[4:7]) + "\n", encoding="utf-8")
    utterances = load_utterances(str(recipes), None)
    paths = ["served_features_balanced", "served_audio"]
    alone = asyncio.run(run_served(asr, utterances, paths, "English", lambda s: None, concurrency=1))
    together = asyncio.run(run_served(asr, utterances, paths, "English", lambda s: None, concurrency=3))
    for path in paths:
        assert together[path].hyps == alone[path].hyps and any(alone[path].hyps), path
        assert together[path].payload_bytes == alone[path].payload_bytes > 0, path
        assert not alone[path].errors and not together[path].errors


def test_unknown_path_is_a_clear_error():
    with pytest.raises(HarkenError, match="unknown path"):
        WerBenchOptions(model="tiny", paths=("offline", "carrier_pigeon"))
    with pytest.raises(HarkenError, match="--concurrency"):
        WerBenchOptions(model="tiny", concurrency=0)
    with pytest.raises(HarkenError, match="--update-interval"):
        WerBenchOptions(model="tiny", update_interval_s=0.0)
    policy = WerBenchOptions(model="tiny", update_interval_s=0.5, rollback_tokens=2).stream_policy()
    assert (policy.update_interval_s, policy.rollback_tokens) == (0.5, 2)


def test_the_stream_path_updates_on_the_policy_s_boundaries(tmp_path, asr):
    # every non-final event covers audio up to an update boundary of its item: whole multiples of
    # the interval from the segment's start (its items are shorter than the 30-s segment limit here)
    from harken.cloud.inference.commit import CommitPolicy
    from harken.training import corpus

    lines = corpus.HELD_OUT_FILE.read_text(encoding="utf-8").splitlines()
    recipes = tmp_path / "one.jsonl"
    recipes.write_text(lines[6] + "\n", encoding="utf-8")
    utterance = load_utterances(str(recipes), None)
    for interval in (0.5, 1.0):
        events = stream_timed(utterance[0].audio, _engine(asr, CommitPolicy(update_interval_s=interval)),
                              _options(CommitPolicy(update_interval_s=interval)), AudioClock())
        spans = [round((t.event.end_s - t.event.start_s) / interval, 6) for t in events if not t.event.is_final]
        assert spans and all(s == int(s) for s in spans), (interval, spans)
        if interval == 0.5:
            assert any(int(s) % 2 for s in spans)  # a boundary the 1-s policy does not have


def _engine(asr, policy):
    from harken.cloud.inference.engine import Engine, EngineConfig

    return Engine(asr, EngineConfig(max_sessions=1, max_batch=1, slot_policy=policy))


def _options(policy):
    from harken.cloud.inference.decoder_stream import SessionOptions

    return SessionOptions(language="English", policy=policy)
