"""Word timings in the clients: the SDK (`TranscriptionClient.stream(..., word_timings=True)`, feature
and thin clients, gRPC and the WebRTC data channel) and `harken stream --server ... --json --word-timings` / `--format vtt --word-cues`,
against `harken serve --aligner tiny` (tiny random model and aligner: the plumbing is tested, not the
times). A server without an aligner says so (`stats.word_timings` False, one line on the CLI's stderr)
and the transcript goes on.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys

import pytest
import webvtt

from harken.cloud.model.aligner import split_words
from harken.edge.client.grpc_client import ClientOptions, SegmentTimings, TranscriptEvent, TranscriptionClient, audio_pieces
from signals import write_wav
from transport_helpers import LANGUAGE, REPO, THIN, serving
from transport_helpers import audio  # module fixture: pytest finds it here


def check(items: list) -> None:
    """One SegmentTimings per final segment, right after it; its words are the segment's words."""
    text: dict[int, str] = {}
    finals = [i for i, e in enumerate(items) if isinstance(e, TranscriptEvent) and e.is_final]
    assert len(finals) >= 2
    for e in items:
        if isinstance(e, TranscriptEvent):
            text[e.segment_id] = text.get(e.segment_id, "") + e.committed_delta
    timed = [e for e in items if isinstance(e, SegmentTimings)]
    assert [t.segment_id for t in timed] == [items[i].segment_id for i in finals]
    for t in timed:
        final = next(e for e in items if isinstance(e, TranscriptEvent) and e.is_final and e.segment_id == t.segment_id)
        assert items.index(t) > items.index(final)
        assert [w.text for w in t.words] == split_words(text[t.segment_id])
        times = [x for w in t.words for x in (w.start_s, w.end_s)]
        assert times == sorted(times) and all(final.start_s - 1e-6 <= x <= final.end_s + 1e-6 for x in times)


@pytest.mark.parametrize("options", [ClientOptions(), THIN], ids=["features", "thin"])
def test_the_sdk_yields_each_final_segments_timings_after_it(asr, audio, options):
    async def main():
        async with serving(asr, aligner="tiny") as server:
            client = TranscriptionClient(server.address, language=LANGUAGE, options=options)
            timed = [e async for e in client.stream(audio_pieces(audio), word_timings=True)]
            plain = [e async for e in client.stream(audio_pieces(audio))]
            return timed, plain, client.stats

    timed, plain, stats = asyncio.run(main())
    check(timed)
    assert stats.word_timings is None  # the last stream did not ask
    assert not any(isinstance(e, SegmentTimings) for e in plain)
    finals = [(e.segment_id, e.start_s, e.end_s) for e in plain if e.is_final]
    assert [(e.segment_id, e.start_s, e.end_s) for e in timed if isinstance(e, TranscriptEvent) and e.is_final] == finals


def test_the_webrtc_client_gets_them_over_the_data_channel(asr, audio):
    from harken.edge.client.webrtc_client import WebRTCTranscriptionClient

    async def main():
        async with serving(asr, aligner="tiny", http_port=0) as server:
            client = WebRTCTranscriptionClient(f"http://127.0.0.1:{server.http_port}", language=LANGUAGE)
            items = [e async for e in client.stream(audio_pieces(audio), word_timings=True)]
            return items, client.stats

    items, stats = asyncio.run(main())
    check(items)
    assert stats.word_timings is True


def test_the_sdk_says_when_the_server_has_no_aligner(asr, audio):
    async def main():
        async with serving(asr) as server:
            client = TranscriptionClient(server.address, language=LANGUAGE)
            items = [e async for e in client.stream(audio_pieces(audio), word_timings=True)]
            return items, client.stats

    items, stats = asyncio.run(main())
    assert stats.word_timings is False and stats.word_timings_received == 0
    assert all(isinstance(e, TranscriptEvent) for e in items) and sum(e.is_final for e in items) >= 2


def test_cli_stream_server_prints_word_timings_and_word_cues(asr, audio, tmp_path):
    wav = write_wav(tmp_path / "in.wav", audio, subtype="FLOAT")

    async def run(server, *extra):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "harken", "stream", str(wav), "--server", server.address, "--language", LANGUAGE,
            *extra, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO, env=dict(os.environ))
        out, err = await proc.communicate()
        return proc.returncode, out.decode(), err.decode()

    async def main():
        async with serving(asr, aligner="tiny") as server:
            as_json = await run(server, "--json", "--word-timings")
            cues = await run(server, "--format", "vtt", "--word-cues")
        async with serving(asr) as server:
            without = await run(server, "--json", "--word-timings")
        return as_json, cues, without

    (rc, out, err), (cues_rc, cues_out, cues_err), (no_rc, no_out, no_err) = asyncio.run(main())
    assert rc == 0 and cues_rc == 0 and no_rc == 0, err + cues_err + no_err
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[-1]["final"] is True
    items = [SegmentTimings(x["word_timings"]["segment_id"], ()) if "word_timings" in x
             else TranscriptEvent(**x) for x in lines[:-1] if "type" not in x]  # (turn events aside)
    finals = [e.segment_id for e in items if isinstance(e, TranscriptEvent) and e.is_final]
    timed = [x["word_timings"] for x in lines if "word_timings" in x]
    assert [t["segment_id"] for t in timed] == finals and len(finals) >= 2
    words = [w["text"] for t in timed for w in t["words"]]
    assert words == split_words(lines[-1]["text"])
    assert all(list(w) == ["text", "start", "end"] for t in timed for w in t["words"])
    parsed = webvtt.from_buffer(io.StringIO(cues_out))
    assert [c.text for c in parsed] == words  # one cue per word, in order
    assert "no word timings" in no_err and not any("word_timings" in line for line in no_out.splitlines())
    assert json.loads(no_out.splitlines()[-1])["text"] == lines[-1]["text"]
