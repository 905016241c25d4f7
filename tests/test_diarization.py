"""Live speaker labels (issue 61; cloud/inference/diarization.py) with the real speaker encoder:

- the diarizer's decision on given vectors: a new speaker only past the threshold and the minimum
  duration, names stable, a recent segment moved by a later one (a relabel), a freed name reused;
- real people (Debian's pocketsphinx-testdata, `make sysdeps`): one LibriVox reader keeps one label
  over five clips, another speaker between them gets another;
- live through a real server (gRPC, the SDK's `ClientOptions(diarize=True)`) following two espeak-ng
  voices turn by turn: each final carries its speaker, and with the relabels applied each voice has one
  label of its own; a session that does not ask gets no labels;
- `harken transcribe --diarize` (JSON segments, SRT "S1: ", WebVTT <v S1>);
- Deepgram's SDK (`diarize=True`) live and pre-recorded: words[].speaker, integers from 0;
- the `openai` client's `response_format="diarized_json"`.

Which voice said a segment is read off the turns' times (a segment lies inside one turn). The recogniser
is the tiny random model with English forced (its text plays no part in who spoke).
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from harken.cloud.inference.diarization import Background, DiarizeSettings, SessionDiarizer
from harken.shared.transcript import SpeakerChange, TranscriptEvent
from signals import silence, speech

TURNS = [("en-us", "Good morning everyone, let us start the meeting about the new budget."),
         ("en-gb+f3", "Thank you. I have looked at the numbers from last quarter and they are not good."),
         ("en-us", "What exactly went wrong with the sales in the north region this year?"),
         ("en-gb+f3", "Two of our largest customers moved their orders to the spring."),
         ("en-us", "Then we should plan for a slower winter and keep the hiring freeze."),
         ("en-gb+f3", "I agree, and I will send a new forecast to the whole team by Friday.")]
GAP_S = 1.2


@pytest.fixture(scope="module")
def meeting() -> tuple[np.ndarray, list[tuple[float, float, str]]]:
    """Two voices turn by turn: (16 kHz audio, [(start_s, end_s, voice)])."""
    parts, turns, t = [silence(0.5)], [], 0.5
    for voice, text in TURNS:
        a = speech(text, voice=voice)
        parts += [a, silence(GAP_S)]
        turns.append((t, t + len(a) / 16000, voice))
        t += len(a) / 16000 + GAP_S
    return np.concatenate(parts), turns


def voice_at(turns, start_s: float, end_s: float) -> str:
    middle = (start_s + end_s) / 2
    return min(turns, key=lambda x: 0 if x[0] <= middle <= x[1] else min(abs(middle - x[0]), abs(middle - x[1])))[2]


def check_one_label_per_voice(labelled: list[tuple[float, float, str]], turns) -> None:
    """[(start_s, end_s, speaker)]: every voice's segments share one label, the two voices' differ."""
    by_voice: dict[str, set[str]] = {}
    for start, end, who in labelled:
        by_voice.setdefault(voice_at(turns, start, end), set()).add(who)
    assert len(by_voice) == 2 and all(len(v) == 1 for v in by_voice.values()), by_voice
    assert len(set.union(*by_voice.values())) == 2, by_voice


def finals_with_relabels(items) -> list[tuple[float, float, str]]:
    """A stream's final events with every later SpeakerChange applied: [(start_s, end_s, speaker)]."""
    finals = {e.segment_id: e for e in items if isinstance(e, TranscriptEvent) and e.is_final}
    latest = {c.segment_id: c.speaker for c in items if isinstance(c, SpeakerChange)}
    assert all(e.speaker for e in finals.values()), "every final comes with its speaker"
    return [(e.start_s, e.end_s, latest.get(k, e.speaker)) for k, e in sorted(finals.items())]


# ---- the decision --------------------------------------------------------------------------------

def _unit(*xs: float) -> np.ndarray:
    v = np.zeros(256, np.float32)
    v[:len(xs)] = xs
    return v / np.linalg.norm(v)


def test_the_decision_opens_joins_and_relabels():
    d = SessionDiarizer(None, Background.none(), DiarizeSettings(threshold=0.6, length_term=0.0, min_new_s=2.0, lookback=4))
    a, b = _unit(1, 0, 0), _unit(0, 1, 0)
    assert d.add(0, a, 3.0) == ("S1", [])
    assert d.add(1, _unit(1, 0.1, 0), 3.0) == ("S1", [])  # near A: joins
    assert d.add(2, b, 1.0) == ("S1", [])  # far from A but too short to open a speaker: the nearest
    assert d.add(3, None, 0.05) == ("S1", [])  # nothing to embed: the last segment's speaker
    name, changes = d.add(4, b, 4.0)  # far and long enough: a new speaker, and segment 2 moves to it
    assert name == "S2" and changes == [SpeakerChange(2, "S2")]
    assert d.speakers == 2
    assert d.add(5, _unit(0.1, 1, 0), 3.0) == ("S2", [])


def test_a_freed_name_goes_to_the_next_new_speaker():
    d = SessionDiarizer(None, Background.none(), DiarizeSettings(threshold=0.6, length_term=0.0, min_new_s=2.0, lookback=4))
    a = _unit(1, 0, 0)
    d.add(0, a, 3.0)
    d.add(1, a, 3.0)
    d.add(2, _unit(0.55, 0.835, 0), 2.5)  # cosine 0.55 to A: a new speaker S2 ...
    name, changes = d.add(3, _unit(1, 0.3, 0), 6.0)  # ... until A's centroid leans its way: it joins S1
    assert name == "S1" and changes == [SpeakerChange(2, "S1")] and d.speakers == 1
    assert d.add(4, _unit(0, 0, 1), 3.0)[0] == "S2"  # the name S2 was freed


def test_a_short_segment_must_lie_further_away_to_open_a_speaker():
    d = SessionDiarizer(None, Background.none(), DiarizeSettings(threshold=0.75, length_term=0.8, min_new_s=2.0))
    a, near = _unit(1, 0, 0), _unit(0.55, 0.835, 0)  # cosine 0.55
    d.add(0, a, 5.0)
    assert d.add(1, near, 2.5)[0] == "S1"  # 2.5 s: joins above 0.75 - 0.8 / 2.5 = 0.43
    d = SessionDiarizer(None, Background.none(), DiarizeSettings(threshold=0.75, length_term=0.8, min_new_s=2.0))
    d.add(0, a, 5.0)
    assert d.add(1, near, 10.0)[0] == "S2"  # 10 s: joins only above 0.67


def _centroid_linkage_recomputed(vectors: np.ndarray, threshold: float) -> list[set[int]]:
    """The reference: every step recomputes every pair of clusters' centroid cosine from scratch."""
    clusters = [{i} for i in range(len(vectors))]
    while len(clusters) > 1:
        units = [vectors[sorted(c)].sum(0) / np.linalg.norm(vectors[sorted(c)].sum(0)) for c in clusters]
        pairs = [(float(units[a] @ units[b]), a, b) for a in range(len(clusters)) for b in range(a + 1, len(clusters))]
        sim, a, b = max(pairs)
        if sim < threshold:
            break
        clusters[a] |= clusters.pop(b)
    return sorted(clusters, key=min)


@pytest.mark.parametrize("seed", range(4))
def test_centroid_linkage_equals_a_full_recompute(seed):
    from harken.cloud.inference.diarization import centroid_linkage

    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(4, 16))
    vectors = centres[rng.integers(0, 4, 40)] + 0.8 * rng.normal(size=(40, 16))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for threshold in (0.2, 0.5, 0.8):
        ids = centroid_linkage(vectors, threshold)
        got = sorted(({i for i in range(40) if ids[i] == c} for c in set(ids.tolist())), key=min)
        assert got == _centroid_linkage_recomputed(vectors, threshold)
        assert ids[0] == 0 and all(ids[i] <= max(ids[:i], default=0) + 1 for i in range(40))  # first appearance


def test_reclustering_founds_a_speaker_on_enough_speech_and_relabels_back():
    from harken.cloud.inference.diarization import absorb_short

    settings = DiarizeSettings(threshold=0.6, min_new_s=4.0, recluster=True)
    d = SessionDiarizer(None, Background.none(), settings)
    a, b = _unit(1, 0, 0), _unit(0, 1, 0)
    assert d.add(0, a, 3.0) == ("S1", [])
    assert d.add(1, b, 2.5) == ("S1", [])  # another voice, but 2.5 s of it founds no speaker: the nearest
    assert d.add(2, _unit(1, 0.1, 0), 3.0) == ("S1", [])
    name, changes = d.add(3, _unit(0.1, 1, 0), 2.0)  # 4.5 s of B now: a speaker, and segment 1 moves to it
    assert name == "S2" and changes == [SpeakerChange(1, "S2")] and d.speakers == 2
    assert d.add(4, None, 0.05) == ("S2", [])  # nothing to embed: the last segment's speaker
    assert d.add(5, a, 5.0) == ("S1", [])  # names stay with their speakers
    # absorb_short alone: the short cluster joins the nearest one holding enough speech; none holds enough: one
    vectors = np.stack([a, _unit(1, 0.2, 0), b, _unit(0.2, 1, 0)])
    assert absorb_short(vectors, np.array([0, 1, 2, 2]), np.array([3.0, 1.0, 3.0, 3.0]), 2.0).tolist() == [0, 0, 1, 1]
    assert absorb_short(vectors, np.array([0, 1, 2, 2]), np.array([1.0, 1.0, 0.5, 0.5]), 2.0).tolist() == [0, 0, 0, 0]


def test_cpwer_counts_a_segment_under_the_wrong_label():
    from harken.bench.cpwer import cpwer

    reference = {"alice": ["Good morning, everyone.", "Let us start."], "bob": ["Thank you very much."]}
    right = cpwer(reference, {"S2": ["good morning everyone", "let us start"], "S1": ["thank you very much"]})
    assert right.errors == 0 and right.length == 10
    wrong = cpwer(reference, {"S1": ["good morning everyone", "let us start", "thank you very much"]})
    assert wrong.errors == 8 and wrong.error_rate == pytest.approx(0.8)  # bob's 4 words: missed, and extra at alice
    moved = cpwer(reference, {"S1": ["good morning everyone"], "S2": ["let us start", "thank you very much"]})
    assert moved.errors == 6  # 3 words deleted from alice, inserted at bob


# ---- real people ---------------------------------------------------------------------------------

def test_one_librivox_reader_keeps_one_label_another_speaker_gets_another():
    from harken.bench.real_speakers import interleaved_readers
    from harken.cloud.embedded import speaker_turns

    talk = interleaved_readers()
    if talk is None:
        pytest.fail("Debian's pocketsphinx-testdata is not installed (make sysdeps)")
    audio, truth = talk
    turns = speaker_turns(audio)
    assert len(turns) == len(truth)  # one VAD segment per clip (1.5 s of silence between them)
    reader = {who for (_, _, who), t in zip(turns, truth) if t == "librivox"}
    other = {who for (_, _, who), t in zip(turns, truth) if t == "cmu"}
    assert len(reader) == 1 and len(other) == 1 and reader != other, (reader, other)


# ---- live, through a server ------------------------------------------------------------------------

def test_live_labels_through_a_server_follow_two_voices(asr, meeting):
    from harken.cloud.server import ServerOptions, start_server
    from harken.edge.client import ClientOptions, TranscriptionClient

    audio, turns = meeting

    async def main():
        server = await start_server(asr, ServerOptions(host="127.0.0.1", port=0))
        try:
            labelled = TranscriptionClient(server.address, options=ClientOptions(language="English", diarize=True))
            items = [x async for x in labelled.stream(audio)]
            plain = TranscriptionClient(server.address, options=ClientOptions(language="English"))
            unlabelled = [x async for x in plain.stream(audio[:16000 * 8])]
            return items, labelled.stats, unlabelled
        finally:
            await server.stop(0)

    items, stats, unlabelled = asyncio.run(main())
    assert stats.diarize is True
    check_one_label_per_voice(finals_with_relabels(items), turns)
    assert all(isinstance(e, TranscriptEvent) and not e.speaker for e in unlabelled)


# ---- harken transcribe --diarize ------------------------------------------------------------------

def test_transcribe_diarize_json_srt_and_vtt(meeting, tmp_path, capsys):
    import srt
    import webvtt

    from harken.commands.transcribe import transcribe_command
    from signals import write_wav

    audio, turns = meeting
    wav = tmp_path / "meeting.wav"
    write_wav(wav, audio)
    outs = {}
    for fmt in ("json", "srt", "vtt"):
        transcribe_command(str(wav), "tiny", language="English", output_format=fmt, diarize=True)
        outs[fmt] = capsys.readouterr().out
    doc = json.loads(outs["json"])
    assert doc["speakers"] == 2 and doc["segments"]
    check_one_label_per_voice([(s["start_s"], s["end_s"], s["speaker"]) for s in doc["segments"]], turns)
    subs = list(srt.parse(outs["srt"]))
    assert [c.content.split(":", 1)[0] for c in subs] == [s["speaker"] for s in doc["segments"]]
    (tmp_path / "m.vtt").write_text(outs["vtt"])
    cues = list(webvtt.read(str(tmp_path / "m.vtt")))
    assert [c.voice for c in cues] == [s["speaker"] for s in doc["segments"]]


# ---- Deepgram and OpenAI -------------------------------------------------------------------------

def test_deepgram_sdk_diarize_live_and_prerecorded(meeting, tmp_path):
    import soundfile as sf
    import torch
    from deepgram import AsyncDeepgramClient
    from deepgram.core.events import EventType

    from harken.cloud.embedded import speaker_at, speaker_turns
    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.server import ServerOptions, start_server
    from test_deepgram_api import _environment

    torch.set_num_threads(1)
    words_asr = Qwen3ASR.load("tiny-untied", dtype="fp32", device="cpu")  # a random model that writes words
    audio, turns = meeting
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2")
    wav = tmp_path / "meeting.wav"
    sf.write(str(wav), pcm, 16000, subtype="PCM_16")

    async def main():
        server = await start_server(words_asr, ServerOptions(host="127.0.0.1", port=0, http_port=0))
        try:
            client = AsyncDeepgramClient(api_key="any", environment=_environment(server.http_port))
            got: list = []
            async with client.listen.v1.connect(model="nova-3", encoding="linear16", sample_rate=16000,
                                                language="en", diarize=True) as socket:
                socket.on(EventType.MESSAGE, got.append)
                listening = asyncio.create_task(socket.start_listening())
                for i in range(0, pcm.size, 1600):
                    await socket.send_media(pcm[i:i + 1600].tobytes())
                await socket.send_close_stream()
                await asyncio.wait_for(listening, 120)
            file = await client.listen.v1.media.transcribe_file(request=wav.read_bytes(), model="nova-3",
                                                                language="en", diarize=True)
            return got, file
        finally:
            await server.stop(0)

    got, file = asyncio.run(main())
    finals = [m for m in got if getattr(m, "type", None) == "Results" and m.is_final]
    live = [(w.start, w.end, f"S{w.speaker + 1}") for m in finals for w in m.channel.alternatives[0].words]
    assert live and all(isinstance(w.speaker, int) for m in finals for w in m.channel.alternatives[0].words)
    check_one_label_per_voice(live, turns)
    # pre-recorded: the text is the offline pass's (no segments: the random model's words are spread over
    # the file), each word the speaker of the VAD segment at its middle, as the file's segments are labelled
    words = file.results.channels[0].alternatives[0].words
    assert words and all(isinstance(w.speaker, int) and w.speaker >= 0 for w in words)
    spans = speaker_turns(pcm.astype(np.float32) / 32768.0)
    check_one_label_per_voice(spans, turns)
    assert [w.speaker for w in words] == [int(speaker_at(spans, (w.start + w.end) / 2)[1:]) - 1 for w in words]


def test_openai_client_diarized_json(asr, meeting, tmp_path):
    import openai

    from harken.cloud.server import ServerOptions, start_server
    from signals import write_wav

    audio, turns = meeting
    wav = tmp_path / "meeting.wav"
    write_wav(wav, audio)

    async def main():
        server = await start_server(asr, ServerOptions(host="127.0.0.1", port=0, http_port=0))
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="any", max_retries=0,
                                   timeout=300)

            def create():
                with wav.open("rb") as f:
                    return client.audio.transcriptions.create(model="tiny", file=f, language="en",
                                                              response_format="diarized_json")

            return await asyncio.to_thread(create)
        finally:
            await server.stop(0)

    got = asyncio.run(main())
    assert got.segments and all(s.type == "transcript.text.segment" for s in got.segments)
    assert {s.speaker for s in got.segments} == {"A", "B"}
    check_one_label_per_voice([(s.start, s.end, s.speaker) for s in got.segments], turns)


def test_meeting_room_track_is_labelled_beside_named_tracks(asr, meeting):
    """The meeting SDK: a room's one microphone (`diarize=True`) gives `room/S1`, `room/S2` lines
    beside a participant's own named track."""
    from harken.cloud.server import ServerOptions, start_server
    from harken.edge.client import Meeting
    from harken.edge.client.grpc_client import ClientOptions, audio_pieces

    audio, turns = meeting
    remote = np.concatenate([silence(3.0), speech("I am calling in from the other office.", voice="en-us+m3"),
                             silence(1.0)])

    async def main():
        server = await start_server(asr, ServerOptions(host="127.0.0.1", port=0))
        try:
            m = Meeting(server.address, options=ClientOptions(language="English"))
            m.add_track("room", audio_pieces(audio), diarize=True)
            m.add_track("carol", audio_pieces(remote))
            return [line async for line in m.lines()]
        finally:
            await server.stop(0)

    lines = asyncio.run(main())
    assert {line.speaker for line in lines if not line.speaker.startswith("room/")} == {"carol"}
    room = [(line.start_s, line.end_s, line.speaker) for line in lines if line.speaker.startswith("room/")]
    assert {who for _, _, who in room} == {"room/S1", "room/S2"}
    check_one_label_per_voice(room, turns)
    starts = [line.start_s for line in lines]
    assert starts == sorted(starts)


def test_harken_stream_diarize_json(meeting, tmp_path, capsys):
    """`harken stream IN --diarize --json` (in-process): finals carry "speaker"; relabels are lines of
    their own; with them applied each voice has one label."""
    from harken.commands.stream import stream_command
    from signals import write_wav

    audio, turns = meeting
    wav = tmp_path / "meeting.wav"
    write_wav(wav, audio)
    stream_command(str(wav), "tiny", language="English", output_format="json", diarize=True)
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    finals = [x for x in lines if x.get("is_final")]
    assert finals and all(x["speaker"].startswith("S") for x in finals)
    assert all("speaker" not in x for x in lines if x.get("is_final") is False)
    latest = {x["relabel"]["segment_id"]: x["relabel"]["speaker"] for x in lines if "relabel" in x}
    check_one_label_per_voice([(x["start_s"], x["end_s"], latest.get(x["segment_id"], x["speaker"]))
                               for x in finals], turns)
