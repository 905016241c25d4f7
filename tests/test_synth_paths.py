"""The shipped synth-en model down the paths users take, on held-out speech: a broken path fails here.

`harken bench wer` (lab/bench/wer.py) on three held-out utterances, meeting talk in two espeak-ng
accents and Piper's voice, with the model that `--model synth-en` loads: offline (the exact log-mel,
one pass), stream (the in-process engine, 100 ms pieces; on the bench's audio clock, so no timing
enters the test), stream_finalize (the same with a finalize request 0.2 s after the last word) and
served_features_balanced (a real in-process `harken serve` on a free port and
the SDK, the edge's VAD, log-mel and balanced codec). Each path's WER over the three must be at most
15%, the shipping bar: a path that drops a segment, mangles a feature frame or loses committed text
loses whole words. The utterances are ones the shipped model reads well offline (its held-out
meeting talk is at ~1% WER), so the bar measures the path rather than the model.
"""

from __future__ import annotations

import pytest

from harken.bench.wer import WerBenchOptions, bench_wer
from harken.cloud.model.shipped import META_FILE, SHIPPED_DIR
from harken.training import corpus

ROWS = [6, 21, 46]  # lab/training/heldout.jsonl: en-gb +m1, en-gb-x-rp +m5, piper-joe
PATHS = ("offline", "stream", "stream_finalize", "served_features_balanced")
MAX_WER = 0.15


@pytest.fixture(scope="module")
def result(tmp_path_factory, monkeypatch_module):
    if not (SHIPPED_DIR / META_FILE).exists():
        pytest.fail("this checkout does not carry synth-en's shipped weights (lab/training/synth-en.*)")
    root = tmp_path_factory.mktemp("synth_paths")
    monkeypatch_module.setenv("HARKEN_CACHE", str(root / "cache"))  # unpacked afresh, as on a new machine
    lines = corpus.HELD_OUT_FILE.read_text(encoding="utf-8").splitlines()
    recipes = root / "three.jsonl"
    recipes.write_text("\n".join(lines[i] for i in ROWS) + "\n", encoding="utf-8")
    return bench_wer(WerBenchOptions(model="synth-en", held_set=str(recipes), paths=PATHS, realtime=False,
                                     concurrency=3))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_the_three_utterances_are_the_ones_meant(result):
    held = corpus.read_held_out()
    assert [held[i].source for i in ROWS] == ["meeting"] * 3
    assert {held[i].recipe.voice for i in ROWS} == {"en-gb", "en-gb-x-rp", "piper-joe"}
    assert result["n_utterances"] == 3 and result["n_words"] == sum(len(held[i].recipe.text.split()) for i in ROWS)


@pytest.mark.parametrize("path", PATHS)
def test_synth_en_reads_held_out_speech_on_every_path(result, path):
    assert result["errors"].get(path) is None, result["errors"]
    assert result[f"wer_{path}"] <= MAX_WER, (path, result)


def test_the_balanced_features_are_what_the_codec_promises(result):
    # feature frames cross the wire only during speech, at the balanced mode's rate
    assert result["kbps_offline"] is None
    assert 10.0 < result["kbps_served_features_balanced"] <= 24.0
    assert result["kbps_stream"] == result["kbps_served_features_balanced"]


def test_self_speculation_on_synth_en_decodes_the_same_with_fewer_steps(result, tmp_path):
    # `result` first: synth-en is unpacked into the module's fresh cache. A model that stops: most
    # of each update's tokens are the previous update's uncommitted ones, which the prefill confirms
    from harken.bench.wer import AudioClock, load_utterances, stream_timed
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.inference.decoder_stream import SessionOptions
    from harken.cloud.model.asr import Qwen3ASR

    asr = Qwen3ASR.load("synth-en")
    lines = corpus.HELD_OUT_FILE.read_text(encoding="utf-8").splitlines()
    utterances = load_utterances(str(_rows_file(lines, tmp_path)), None)
    runs = {}
    for speculate in (False, True):
        engine = Engine(asr, EngineConfig(max_sessions=1, max_batch=1, speculate=speculate))
        events = [[t.event for t in stream_timed(u.audio, engine, SessionOptions(), AudioClock())]
                  for u in utterances]
        runs[speculate] = (events, engine)
    (plain, plain_engine), (spec, spec_engine) = runs[False], runs[True]
    assert spec == plain and any(e.committed_delta for evs in spec for e in evs if not e.is_final)
    assert spec_engine.decoded_tokens == plain_engine.decoded_tokens
    assert spec_engine.verified_tokens >= 0.25 * spec_engine.decoded_tokens


def _rows_file(lines: list[str], folder):
    path = folder / "three.jsonl"
    path.write_text("\n".join(lines[i] for i in ROWS) + "\n", encoding="utf-8")
    return path


def test_a_one_window_segment_commits_its_own_offline_pass(result, tmp_path):
    # the engine's final pass over a segment of at most one encoder window, with no intermediate
    # commits, is the offline greedy decode of the same frames (the edge's, as the wire carries them)
    import numpy as np

    from harken.bench.edge import run_stream
    from harken.cloud.inference.commit import CommitPolicy
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.inference.decoder_stream import SessionOptions
    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.model.decode_limits import DecodeLimits
    from harken.bench.wer import load_utterances
    from harken.shared.codec import DEFAULT_MODE, decode_frames

    asr = Qwen3ASR.load("synth-en")
    lines = corpus.HELD_OUT_FILE.read_text(encoding="utf-8").splitlines()
    policy = CommitPolicy(intermediate_commits=False)
    engine = Engine(asr, EngineConfig(max_sessions=1, max_batch=1, slot_policy=policy))
    segments = 0
    for u in load_utterances(str(_rows_file(lines, tmp_path)), None):
        _, packets = run_stream(u.audio, DEFAULT_MODE)
        for seg in sorted({p.segment_id for p in packets}):
            mine = [p for p in packets if p.segment_id == seg]
            frames = np.concatenate([decode_frames(p.payload) for p in mine], axis=1)
            if frames.shape[1] > asr.encoder.window_frames:
                continue
            offline = asr.transcribe((frames + 4.0) / 4.0, limits=DecodeLimits())
            sid = engine.open_session(SessionOptions(policy=policy))
            events = []
            for p in mine:
                engine.ingest_packet(sid, p)
                events += [e for _, e in engine.run_until_idle()]
            engine.close_session(sid)
            finals = [e for e in events if e.is_final]
            assert len(finals) == 1 and list(finals[0].token_ids) == offline.token_ids
            assert "".join(e.committed_delta for e in events).strip() == offline.text.strip()
            segments += 1
    assert segments >= 3


def test_a_finalized_item_commits_its_own_offline_pass(result, tmp_path):
    # a finalize mid-utterance ends the item at the audio given so far: its final, and that of the
    # speech that goes on as the next item, is the offline greedy decode of that item's own frames
    import numpy as np

    from harken.bench.wer import load_utterances
    from harken.cloud.embedded import stream_pieces
    from harken.cloud.inference.commit import CommitPolicy
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.inference.decoder_stream import SessionOptions
    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.model.decode_limits import DecodeLimits
    from harken.edge.client.front_end import FINALIZE
    from harken.shared.codec import decode_frames

    asr = Qwen3ASR.load("synth-en")
    lines = corpus.HELD_OUT_FILE.read_text(encoding="utf-8").splitlines()
    options = SessionOptions(policy=CommitPolicy(intermediate_commits=False))
    engine = Engine(asr, EngineConfig(max_sessions=1, max_batch=1, slot_policy=options.policy))
    cut_items = 0
    for u in load_utterances(str(_rows_file(lines, tmp_path)), None):
        speech = np.flatnonzero(np.abs(u.audio) > 0.05)
        cut = (speech[0] + speech[-1]) // 2 // 1600 * 1600  # mid-speech, on a 100 ms piece boundary
        pieces = [u.audio[i:i + 1600] for i in range(0, cut, 1600)] + [FINALIZE] \
            + [u.audio[i:i + 1600] for i in range(cut, u.audio.size, 1600)]
        packets: list = []
        events = list(stream_pieces(pieces, engine, options, on_packet=packets.append))
        finals = [e for e in events if e.is_final]
        assert [e.from_finalize for e in finals][0] is True and not any(e.from_finalize for e in finals[1:])
        assert len(finals) >= 2  # the speech went on after the cut as an item of its own
        for final in finals:
            mine = [p for p in packets if p.segment_id == final.segment_id]
            frames = np.concatenate([decode_frames(p.payload) for p in mine], axis=1)
            offline = asr.transcribe((frames + 4.0) / 4.0, limits=DecodeLimits())
            assert list(final.token_ids) == offline.token_ids
            text = "".join(e.committed_delta for e in events if e.segment_id == final.segment_id)
            assert text.strip() == offline.text.strip()
        assert packets[[p.finalized for p in packets].index(True)].first_frame + 1 <= cut // 160
        cut_items += 1
    assert cut_items == len(ROWS)
