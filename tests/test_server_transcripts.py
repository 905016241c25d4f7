"""cloud/server: the transcript through the server, for feature clients and thin clients.

A features client (the edge's packets) gets the in-process engine's transcript for the same audio;
a thin client (PCM16 `Audio` messages, the server runs VAD and features) gets the same, however its
audio is cut into messages and at another sample rate (resampled), and a few samples end cleanly
with no text. Half-closing the request stream counts as End (open segments are finalised), and a
thin client's Finalize (push-to-talk) ends the open segment at once.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import grpc
import numpy as np
import pytest

from harken.shared.codec import CODEC_NAME
from harken.proto import harken_pb2 as pb
from server_helpers import (END, OK, SR, TIMEOUT, audio_msgs, features_msgs, run_stream, serving, start_msg,
                            transcript_of)
from server_helpers import audio, reference  # module fixtures: pytest finds them here
from signals import write_wav


def test_features_client_gets_the_embedded_engines_transcript(asr, packets, reference):
    async def main():
        async with serving(asr) as server:
            return await run_stream(server.address, [start_msg(codec=CODEC_NAME)]
                                    + features_msgs(packets) + [END])

    out = asyncio.run(main())
    assert out.code == grpc.StatusCode.OK, out.details
    assert out.ready.session_id and out.ready.resume_after_seq == 0 and out.ready.last_final_segment == -1
    assert transcript_of(out.events) == transcript_of(reference)
    assert [t.event_seq for t in out.transcripts] == list(range(1, len(out.transcripts) + 1))
    finals = [t for t in out.transcripts if t.is_final]
    assert all(t.seed.present and t.seed.next_segment_id == t.segment_id + 1 for t in finals)
    assert finals[-1].seed.running_max_log10 == pytest.approx(packets[-1].running_max_log10)
    assert out.acks[-1].seq == len(packets) and out.acks[-1].last_final_segment == finals[-1].segment_id


def test_thin_client_audio_gets_the_same_transcript(asr, audio, reference):
    """PCM16 in 100 ms pieces: the server's FeatureStream makes the packets the edge would."""
    async def main():
        async with serving(asr) as server:
            return await run_stream(server.address, [start_msg()] + audio_msgs(audio) + [END])

    out = asyncio.run(main())
    assert out.code == grpc.StatusCode.OK, out.details
    assert transcript_of(out.events) == transcript_of(reference)
    assert out.acks[-1].seq == len(audio_msgs(audio))


def test_thin_client_segments_do_not_depend_on_how_the_audio_is_cut(asr, audio, tmp_path):
    """The same PCM16 in 20 ms, 100 ms and 1000 ms `Audio` messages and in one: the server's VAD
    gives the same segments, so the same transcript, and they are `harken vad`'s segments of the
    same samples as a WAV file. `harken vad` reports samples (to the ms), a transcript reports
    frames (10 ms), so its segments are compared on the frame grid: the frames centred inside
    each, a start not before the previous end. Before, small pieces sent frames of the trailing
    pause past the VAD's end (the end frame depended on how much audio had come when the end was
    decided)."""
    pieces = {"20 ms": 0.02, "100 ms": 0.1, "1000 ms": 1.0, "whole": audio.size / SR}

    async def main():
        async with serving(asr) as server:
            return {label: await run_stream(server.address, [start_msg()] + audio_msgs(audio, piece_s=piece_s) + [END])
                    for label, piece_s in pieces.items()}

    outs = asyncio.run(main())
    wav = tmp_path / "audio.wav"
    write_wav(wav, audio)
    vad = json.loads(subprocess.run([sys.executable, "-m", "harken", "vad", str(wav), "--json"], check=True,
                                    capture_output=True, text=True, timeout=120).stdout)
    expected: list[tuple[float, float]] = []
    end_frame = 0
    for seg in vad["segments"]:
        start, end = round(seg["start_s"] * SR), round(seg["end_s"] * SR)  # whole ms: exact samples
        first = max(start // 160, end_frame)
        end_frame = -(-end // 160)
        expected.append((first / 100, end_frame / 100))
    assert len(expected) == 2
    whole = transcript_of(outs["whole"].events)
    for label, out in outs.items():
        assert out.code == OK, (label, out.details)
        got = transcript_of(out.events)
        assert [(start_s, end_s) for _, _, start_s, end_s, _ in got] == expected, label
        assert got == whole, label


def test_a_client_that_half_closes_without_end_gets_its_finals_and_ok(asr, packets, reference):
    """Half-close = End: the open segment is finalised, its final sent, the stream closed OK (it
    used to hang, the segment never final)."""
    msgs = [start_msg(codec=CODEC_NAME)] + features_msgs(packets)

    async def main():
        async with serving(asr) as server:
            return await asyncio.wait_for(run_stream(server.address, msgs), TIMEOUT)

    out = asyncio.run(main())
    assert out.code == OK, out.details
    assert transcript_of(out.events) == transcript_of(reference)


def test_a_half_close_in_an_open_segment_finalises_it(asr, packets):
    open_segment = [p for p in packets if p.segment_id == 0][:-1]
    assert not open_segment[-1].segment_end

    async def main():
        async with serving(asr) as server:
            return await asyncio.wait_for(
                run_stream(server.address, [start_msg(codec=CODEC_NAME)] + features_msgs(open_segment)), TIMEOUT)

    out = asyncio.run(main())
    assert out.code == OK, out.details
    assert [t.segment_id for t in out.transcripts if t.is_final] == [0]


def test_thin_client_with_a_few_samples_ends_ok_with_no_text(asr):
    """Fewer samples than one log-mel frame needs (201) is valid input: no events, a clean OK."""
    async def main():
        async with serving(asr) as server:
            return [await run_stream(server.address, [start_msg()] + audio_msgs(np.full(n, 0.2, np.float32))
                                     + [END]) for n in (1, 150, 200)]

    for out in asyncio.run(main()):
        assert out.code == grpc.StatusCode.OK, out.details
        assert out.transcripts == [] and out.acks[-1].seq == 1


def test_thin_client_at_48k_is_resampled(asr, audio):
    import soxr

    audio48 = soxr.resample(audio, SR, 48_000).astype(np.float32)

    async def main():
        async with serving(asr) as server:
            return await run_stream(server.address, [start_msg()] + audio_msgs(audio48, rate=48_000) + [END])

    out = asyncio.run(main())
    assert out.code == grpc.StatusCode.OK, out.details
    finals = [t for t in out.transcripts if t.is_final]
    assert [t.segment_id for t in finals] == [0, 1]
    assert finals[0].start_s == pytest.approx(0.25, abs=0.05) and finals[1].end_s == pytest.approx(4.54, abs=0.1)


def test_finalize_closes_the_open_segment_of_a_thin_client(asr, audio):
    """Push-to-talk: Finalize mid-utterance ends the segment at once, at the audio sent so far, and
    its final says `from_finalize`; the rest of that speech is the next segment (nothing lost).
    Turn events, asked for, come in order with the text: each segment's onset first, its end
    before its final."""
    msgs = audio_msgs(audio)
    half = 25  # 2.5 s: inside the second utterance

    async def main():
        async with serving(asr) as server:
            return await run_stream(server.address, [start_msg(turn_events=True)] + msgs[:half]
                                    + [pb.ClientMessage(finalize=pb.Finalize())] + msgs[half:] + [END])

    out = asyncio.run(main())
    assert out.code == OK, out.details
    assert out.ready.turn_events
    finals = [t for t in out.transcripts if t.is_final]
    assert [t.segment_id for t in finals] == [0, 1, 2]
    assert [t.from_finalize for t in finals] == [False, True, False]
    assert finals[1].end_s <= half / 10
    turns = [m.turn for m in out.messages if m.WhichOneof("kind") == "turn"]
    kinds = [(t.segment_id, pb.Turn.Kind.Name(t.kind)) for t in turns]
    assert kinds == [(0, "SPEECH_STARTED"), (0, "UTTERANCE_END"), (1, "SPEECH_STARTED"), (1, "UTTERANCE_END"),
                     (2, "SPEECH_STARTED"), (2, "UTTERANCE_END")]
    assert turns[3].audio_s <= half / 10 and turns[4].audio_s == pytest.approx(turns[3].audio_s)  # no gap
    # in order with the text: a segment's end comes before its final
    seqs = {(m.turn.segment_id, m.turn.kind): m.turn.event_seq for m in out.messages if m.WhichOneof("kind") == "turn"}
    for t in finals:
        assert seqs[(t.segment_id, pb.Turn.UTTERANCE_END)] < t.event_seq
    events = sorted([t.event_seq for t in out.transcripts] + [t.event_seq for t in turns])
    assert events == list(range(1, len(events) + 1))


def test_a_model_whose_vocabulary_is_not_all_byte_level_serves_its_streams(audio, tmp_path):
    """`harken make-tiny-model --vocab small` fills its vocabulary with tokens that are not byte-level
    BPE ("␀unused447"); a random model writes them. Every stream of it ends OK with its text."""
    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.model.tiny import make_tiny_model

    small = Qwen3ASR.load(str(make_tiny_model(tmp_path / "small", vocab="small")))

    async def main():
        async with serving(small) as server:
            return await run_stream(server.address, [start_msg()] + audio_msgs(audio) + [END])

    out = asyncio.run(main())
    assert out.code == OK, out.details
    assert [t.segment_id for t in out.transcripts if t.is_final] == [0, 1]
