"""Test vectors for ports of the edge (the TypeScript package edge/web/, and mobile ports): input
WAVs with the features, VAD decisions, codec payloads and wire messages the Python edge computes
from them. tests/test_web_vectors.py checks that the committed files still match the Python edge;
the node tests (edge/web/test/) check the TypeScript port against them.

    python tests/web_vectors.py            rewrite the expectations (and the codec tables) from the WAVs
    python tests/web_vectors.py --wavs     also regenerate the WAVs (espeak-ng; its version shapes them)

Layout of edge/web/vectors/ (documented for other ports in its README.md):

    NAME.wav              16 kHz mono PCM16
    NAME.logmel.f32       raw log10-mel, float32 little-endian, [128, T] row-major (bin-major)
    NAME.json             VAD probabilities and events, per push the frames, events and the VAD's
                          earliest end after it, the pipeline's packets (payload, CRC32C, the
                          serialized `ClientMessage`), all for 100 ms pushes of 1600 samples;
                          "finalize": the same for a stream finalized once `after_samples` are in
                          (halfway through the first segment: FeatureStream.finalize, the entry
                          with "finalize": true in its pushes), its packets ending in a `finalized` one
    codec.json            codec cases: (frames of a vector, floor, mode) -> payload bytes
    edge/web/src/codec_tables.json   constants of the codec format the port loads (not test data)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VECTORS = ROOT / "edge" / "web" / "vectors"
TABLES = ROOT / "edge" / "web" / "src" / "codec_tables.json"
PUSH_SAMPLES = 1600  # the pipeline is fed 100 ms pieces: packet boundaries depend on the push size
PACKET_FRAMES = 20
CODEC_CASES = ((0, 1), (3, 7), (10, 20), (25, 33), (40, 72))  # (offset, frames) inside a packet's span


def make_wavs() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from signals import concat, noisy, silence, speech, tone, write_wav

    VECTORS.mkdir(parents=True, exist_ok=True)
    two = concat(silence(0.3), speech("Hello there."), silence(0.8), speech("Testing vectors.", voice="en-gb"),
                 silence(0.5))
    write_wav(VECTORS / "two_segments.wav", noisy(two, snr_db=30.0, seed=1))
    write_wav(VECTORS / "tone_silence.wav", concat(silence(0.4), tone(440.0, 0.6, 0.3), silence(0.3)))


def codec_tables() -> dict:
    """The codec's format constants as JSON numbers (exact: shortest round-trip reprs)."""
    from harken.shared import codec, entropy

    layout = codec.mel_layout()
    single = layout.ratio_b == 0
    a, b = entropy.class_bit_costs()
    return {
        "format": codec.CODEC_NAME,
        "magic": codec.MAGIC, "version": codec.VERSION,
        "modes": {m: {"id": i + 1, "step": codec._MODE_PARAMS[m].step, "rd_lambda": codec._MODE_PARAMS[m].rd_lambda,
                      "prior_classes": codec._PRIOR_CLASSES[m].tolist()} for i, m in enumerate(codec.MODES)},
        "mel_blocks": list(codec._MEL_BLOCKS),
        "prior_band": codec._prior_band().tolist(),
        "max_time_block": codec.MAX_TIME_BLOCK,
        "floor_margin": codec.FLOOR_MARGIN,
        "shift_limit": codec._SHIFT_LIMIT,
        "basis": layout.basis.tolist(),
        "dependent": layout.dependent.tolist(),
        "source_a": layout.source_a.tolist(),
        "source_b": layout.source_b.tolist(),
        "log_ratio_a": layout.log_ratio_a.tolist(),
        "log_ratio_b": [None if not np.isfinite(v) else float(v) for v in layout.log_ratio_b],  # null: no second source
        "log10_ratio_single": [float(v) if s else None for v, s in zip(layout.log10_ratio_a, single)],
        "floor_sink": layout.floor_sink.tolist(),
        "ln10": codec.LN10,
        "n_classes": entropy.N_CLASSES,
        "class_bit_b": b.tolist(),
        "value_bits": codec._value_bits().tolist(),
        "mag_cap": codec._MAG_CAP,
    }


def entropy_tables() -> dict:
    """Code lengths of every class's Huffman table: a port building the tables checks them here."""
    from harken.shared import entropy

    return {"classes": [{"group": t.group, "radius": t.radius, "lengths": t.lengths.tolist()}
                        for t in entropy.code_book().tables]}


def expected(wav: Path) -> tuple[np.ndarray, dict]:
    """(raw log-mel [128, T], the JSON record) of one vector WAV, from the Python edge."""
    from harken.edge.audio import load_audio
    from harken.edge.features import log_mel_raw
    from harken.edge.vad import WINDOW_SAMPLES, SegmentEnd, SegmentStart, SileroVad
    from harken.shared.codec import DEFAULT_MODE

    audio = load_audio(wav)
    mel = log_mel_raw(audio)
    probs = SileroVad().probabilities(audio)
    pushes, events = replayed_pushes(audio)
    record = {
        "samples": int(audio.size), "frames": int(mel.shape[1]), "push_samples": PUSH_SAMPLES,
        "packet_frames": PACKET_FRAMES, "codec_mode": DEFAULT_MODE,
        "pushes": pushes,
        "vad_probabilities": [float(p) for p in probs],
        "vad_events": vad_event_records(events),
        "packets": packet_records(audio),
    }
    # finalize mid-speech: at the push boundary in the middle half of the first segment (a WAV
    # without speech: of the audio) nearest its middle, preferring one on the VAD's window grid: there
    # the cut is past the frames computed, so the cap at them and the next segment's start at the
    # cut frame both matter
    start = next((e.start_sample for e in events if isinstance(e, SegmentStart)), 0)
    end = next((e.end_sample for e in events if isinstance(e, SegmentEnd)), audio.size)
    middle, quarter = (start + end) // 2, (end - start) // 4
    inside = [c for c in range(0, audio.size, PUSH_SAMPLES) if abs(c - middle) <= quarter]
    cut = min(inside, key=lambda c: (c % WINDOW_SAMPLES != 0, abs(c - middle)),
              default=middle // PUSH_SAMPLES * PUSH_SAMPLES)
    cut_pushes, cut_events = replayed_pushes(audio, finalize_at=cut)
    record["finalize"] = {"after_samples": cut, "pushes": cut_pushes, "vad_events": vad_event_records(cut_events),
                          "packets": packet_records(audio, finalize_at=cut)}
    return mel, record


def replayed_pushes(audio: np.ndarray, finalize_at: int | None = None) -> tuple[list[dict], list]:
    """The pipeline's pushes: frames and VAD events each produced (the last entry is the flush), and
    the segmenter's earliest_end_sample after it (what FeatureStream._open_limit reads). With
    `finalize_at`: a finalize once that many samples are in (an entry with "finalize": true, no frames)."""
    from harken.edge.features import StreamingLogMel
    from harken.edge.vad import StreamingVad

    vad, stream_mel = StreamingVad(), StreamingLogMel()
    events: list = []
    pushes = []

    def entry(new: list, k: int, final: bool, **extra) -> None:
        pushes.append({**extra, "frames": k, "events": list(range(len(events), len(events) + len(new))),
                       "final": final, "earliest_end_sample": vad.segmenter.earliest_end_sample})
        events.extend(new)

    for i in range(0, audio.size, PUSH_SAMPLES):
        if i == finalize_at:
            entry(vad.finalize(), 0, False, finalize=True)
        piece = audio[i:i + PUSH_SAMPLES]
        entry(vad.push(piece), stream_mel.push(piece).shape[1], False)
    entry(vad.flush(), stream_mel.flush(short_ok=True).shape[1], True)
    return pushes, events


def vad_event_records(events: list) -> list[dict]:
    from harken.edge.vad import SegmentEnd

    return [{"kind": "end" if isinstance(e, SegmentEnd) else "start", "segment_id": e.segment_id,
             "start_sample": e.start_sample, "end_sample": getattr(e, "end_sample", None),
             "decided_at_sample": e.decided_at_sample} for e in events]


def packet_records(audio: np.ndarray, finalize_at: int | None = None) -> list[dict]:
    """The pipeline's packets for 100 ms pushes (and a finalize once `finalize_at` samples are in)."""
    from harken.edge.pipeline import FeatureStream
    from harken.shared import wire
    from harken.shared.integrity import payload_crc32c
    from harken.shared.protocol import Features

    stream = FeatureStream(packet_frames=PACKET_FRAMES)
    packets = []
    floors: list[float | None] = []
    encode = stream_floor_recorder(floors)
    for i in range(0, audio.size, PUSH_SAMPLES):
        if i == finalize_at:
            packets += encode(stream, stream.finalize)
        packets += encode(stream, lambda: stream.push(audio[i:i + PUSH_SAMPLES]))
    packets += encode(stream, stream.flush)
    return [{"seq": n + 1, "segment_id": p.segment_id, "first_frame": p.first_frame,
             "frame_count": p.frame_count, "segment_start": p.segment_start, "segment_end": p.segment_end,
             "finalized": p.finalized,
             "running_max_log10": p.running_max_log10, "floor_log10": floor, "payload": p.payload.hex(),
             "crc32c": payload_crc32c(p.payload),
             "message": wire.client_message_to_proto(Features(n + 1, p)).SerializeToString().hex()}
            for n, (p, floor) in enumerate(zip(packets, floors))]


def stream_floor_recorder(floors: list[float | None]):
    """Wraps the pipeline's codec call so the floor each packet was encoded with is recorded."""
    from harken.edge import pipeline

    def run(stream, step):
        original = pipeline.encode_frames

        def recording(frames, mode, floor_log10=None):
            floors.append(floor_log10)
            return original(frames, mode, floor_log10=floor_log10)

        pipeline.encode_frames = recording
        try:
            return step()
        finally:
            pipeline.encode_frames = original
    return run


def floored(mel: np.ndarray) -> np.ndarray:
    """The running-max floor of a whole stream (what the pipeline's packets carry)."""
    from harken.shared.features_spec import RunningMaxFloor

    return RunningMaxFloor()(mel)


def codec_cases(name: str, mel: np.ndarray, record: dict) -> list[dict]:
    """Payloads of every mode for spans inside the WAV's packets, with and without a known floor."""
    from harken.shared.codec import MODES, encode_frames

    x = floored(mel)
    cases = []
    starts = sorted({p["first_frame"] for p in record["packets"]})[:3] or [0]
    for start in starts:
        for offset, k in CODEC_CASES:
            a = min(start + offset, x.shape[1] - k)
            for mode in MODES:
                for floor in (None, float(x[:, a - 1].min()) if a > 0 else None):
                    payload = encode_frames(x[:, a:a + k], mode, floor_log10=floor)
                    cases.append({"wav": name, "first_frame": a, "frame_count": k, "mode": mode,
                                  "floor_log10": floor, "payload": payload.hex()})
    return cases


def wire_cases() -> dict:
    """Messages besides the pipeline's Features, as the Python wire writes them: a port decodes the
    server's and writes the client's Start/End/KeepAlive (and a finalized Features) byte for byte.
    "server_none": server messages the Python client reads as nothing (a Turn of no known kind)."""
    from harken.shared import wire
    from harken.proto import harken_pb2 as pb
    from harken.shared.protocol import End, FeaturePacket, Features, KeepAlive, SessionSeed, Start

    seed = SessionSeed(running_max_log10=1.25, context_tail="hello wörld", next_segment_id=3)
    starts = [Start(codec="harken-mel/1"), Start(language="English", context="names", codec="harken-mel/1"),
              Start(codec="harken-mel/1", session_id="abc123", last_event_seq=7),
              Start(codec="harken-mel/1", seed=seed), Start(codec="harken-mel/1", word_timings=True),
              Start(codec="harken-mel/1", turn_events=True),
              Start(language="English", codec="harken-mel/1", word_timings=True, turn_events=True),
              Start(codec="harken-mel/1", turn_events=True, diarize=True)]

    def seed_json(x: SessionSeed | None) -> dict | None:
        return None if x is None else {"running_max_log10": x.running_max_log10, "context_tail": x.context_tail,
                                       "next_segment_id": x.next_segment_id}

    client = [{"start": {"language": m.language, "context": m.context, "codec": m.codec, "session_id": m.session_id,
                         "last_event_seq": m.last_event_seq, "seed": seed_json(m.seed),
                         **({"word_timings": True} if m.word_timings else {}),
                         **({"turn_events": True} if m.turn_events else {}),
                         **({"diarize": True} if m.diarize else {})},
               "bytes": wire.client_message_to_proto(m).SerializeToString().hex()} for m in starts]
    client.append({"end": {}, "bytes": wire.client_message_to_proto(End()).SerializeToString().hex()})
    client.append({"keep_alive": {}, "bytes": wire.client_message_to_proto(KeepAlive()).SerializeToString().hex()})
    for p in (FeaturePacket(segment_id=3, first_frame=120, frame_count=7, segment_start=False, segment_end=True,
                            payload=bytes.fromhex("a7100305"), running_max_log10=1.25, finalized=True),
              FeaturePacket(segment_id=0, first_frame=0, frame_count=0, segment_start=True, segment_end=True,
                            payload=b"", running_max_log10=-2.5, finalized=True)):
        client.append({"features": {"seq": 9, "segment_id": p.segment_id, "first_frame": p.first_frame,
                                    "frame_count": p.frame_count, "segment_start": p.segment_start,
                                    "segment_end": p.segment_end, "payload": p.payload.hex(),
                                    "running_max_log10": p.running_max_log10, "finalized": p.finalized},
                       "bytes": wire.client_message_to_proto(Features(9, p)).SerializeToString().hex()})
    server = [
        pb.ServerMessage(ready=pb.Ready(session_id="sid-1", resume_after_seq=5, last_final_segment=-1)),
        pb.ServerMessage(ack=pb.Ack(seq=12, last_final_segment=-1)),
        pb.ServerMessage(ack=pb.Ack(seq=300, last_final_segment=2)),
        pb.ServerMessage(transcript=pb.Transcript(segment_id=2, committed_delta="héllo ", partial="wor",
                                                  stability=0.5, start_s=1.25, end_s=2.5, language="English",
                                                  is_final=False, event_seq=9)),
        pb.ServerMessage(transcript=pb.Transcript(segment_id=2, committed_delta="world.", start_s=1.25, end_s=3.0,
                                                  language="English", is_final=True, event_seq=10,
                                                  seed=pb.SessionSeed(present=True, running_max_log10=1.25,
                                                                      context_tail="hello", next_segment_id=3))),
        pb.ServerMessage(error=pb.Error(code="INVALID_ARGUMENT", message="bad payload")),
        pb.ServerMessage(ready=pb.Ready(session_id="sid-2", resume_after_seq=0, last_final_segment=3, keep_alive=True)),
        pb.ServerMessage(ready=pb.Ready(session_id="sid-3", keep_alive=True, word_timings=True)),
        pb.ServerMessage(word_timings=pb.WordTimings(segment_id=2, event_seq=11, words=[
            pb.Word(text="héllo", start_s=1.25, end_s=1.5), pb.Word(text="world", start_s=1.625, end_s=2.75)])),
        pb.ServerMessage(word_timings=pb.WordTimings(segment_id=3, event_seq=12)),
        pb.ServerMessage(ready=pb.Ready(session_id="sid-4", keep_alive=True, turn_events=True)),
        pb.ServerMessage(transcript=pb.Transcript(segment_id=4, committed_delta="stop.", start_s=3.5, end_s=4.25,
                                                  language="English", is_final=True, event_seq=15,
                                                  from_finalize=True)),
        pb.ServerMessage(turn=pb.Turn(segment_id=4, kind=pb.Turn.SPEECH_STARTED, audio_s=3.5, event_seq=13)),
        pb.ServerMessage(turn=pb.Turn(segment_id=4, kind=pb.Turn.UTTERANCE_END, audio_s=4.26, event_seq=14)),
        pb.ServerMessage(turn=pb.Turn(segment_id=0, kind=pb.Turn.SPEECH_STARTED)),
        pb.ServerMessage(ready=pb.Ready(session_id="sid-5", keep_alive=True, diarize=True)),
        pb.ServerMessage(transcript=pb.Transcript(segment_id=6, committed_delta="yes.", start_s=5.0, end_s=5.5,
                                                  language="English", is_final=True, event_seq=20, speaker="S2")),
        pb.ServerMessage(speaker_label=pb.SpeakerLabel(segment_id=5, speaker="S1", event_seq=21)),
    ]
    newer = pb.ServerMessage(turn=pb.Turn(segment_id=5, event_seq=17)).SerializeToString() + bytes.fromhex("32021009")
    unknown = [pb.ServerMessage(), pb.ServerMessage(turn=pb.Turn(segment_id=5, audio_s=1.0, event_seq=16)),
               pb.ServerMessage.FromString(newer)]  # the last: Turn.kind 9, of a newer server
    assert all(wire.server_message_from_proto(m) is None for m in unknown)
    return {"client": client, "server": [{"bytes": m.SerializeToString().hex(),
                                          "kind": m.WhichOneof("kind")} for m in server],
            "server_none": [m.SerializeToString().hex() for m in unknown]}


def compute() -> tuple[dict[str, np.ndarray], dict[str, dict], list[dict]]:
    mels, records, cases = {}, {}, []
    for wav in sorted(VECTORS.glob("*.wav")):
        mel, record = expected(wav)
        mels[wav.stem], records[wav.stem] = mel, record
        cases += codec_cases(wav.stem, mel, record)
    return mels, records, cases


def dumps(obj: object) -> str:
    return json.dumps(obj, indent=1) + "\n"


def main(argv: list[str]) -> None:
    if "--wavs" in argv or not any(VECTORS.glob("*.wav")):
        make_wavs()
    TABLES.write_text(dumps(codec_tables()))
    (VECTORS / "entropy_tables.json").write_text(json.dumps(entropy_tables()) + "\n")
    mels, records, cases = compute()
    for name, mel in mels.items():
        mel.astype("<f4").tofile(VECTORS / f"{name}.logmel.f32")
        (VECTORS / f"{name}.json").write_text(dumps(records[name]))
    (VECTORS / "codec.json").write_text(dumps({"cases": cases}))
    (VECTORS / "wire.json").write_text(dumps(wire_cases()))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(sys.argv[1:])
