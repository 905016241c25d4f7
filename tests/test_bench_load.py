"""`harken bench load` (lab/bench/load.py): its timing bookkeeping and output contract.
No timing thresholds: the figures are the benchmark's business, not the tests'."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harken.cli import main
from harken.bench.load import LoadBenchOptions, StreamRecord, percentiles, sample_audio, sent_at, tiled
from harken.shared.errors import HarkenError
from harken.shared.transcript import TranscriptEvent

CONTRACT = ("streams", "seconds", "p50_update_ms", "p95_update_ms", "first_partial_ms", "final_ms",
            "errors", "events", "segments", "realtime_ok")


def test_sent_at_is_the_piece_holding_the_audio_just_before_t():
    handed = [10.0, 10.1, 10.2, 10.3]  # pieces of 1600 samples (100 ms)
    assert sent_at(0.0, handed, 1600) == 10.0  # nothing needed yet: clamped to the first piece
    assert sent_at(0.1, handed, 1600) == 10.0  # samples [0, 1600): piece 0
    assert sent_at(0.1001, handed, 1600) == 10.1  # one sample more: piece 1
    assert sent_at(0.25, handed, 1600) == 10.2
    assert sent_at(9.0, handed, 1600) == 10.3  # past the end: the last piece


def test_record_times_updates_first_events_and_finals():
    r = StreamRecord(1600, handed=[100.0 + 0.1 * k for k in range(30)])  # piece k at 100.0 + 0.1 k

    def event(end_s, final=False):
        return TranscriptEvent(0, "", "x", 0.5, start_s=0.5, end_s=end_s, language="", is_final=final)

    r.observe(event(1.5), now=101.8)  # audio to 1.5 s handed with piece 14 at 101.4
    r.observe(event(2.5), now=102.7)  # piece 24 at 102.4
    r.observe(event(2.8, final=True), now=103.5)  # piece 27 at 102.7
    assert np.allclose(r.update_ms, [400.0, 300.0])
    assert np.allclose(r.first_ms, [1400.0])  # onset 0.5 s: piece 4 at 100.4
    assert np.allclose(r.final_ms, [800.0])
    assert (r.events, r.finals) == (3, 1)


def test_tiled_repeats_from_the_offset():
    audio = np.arange(16000, dtype=np.float32)  # 1 s
    t = tiled(audio, 2.5, offset_s=0.5)
    assert t.size == 40000 and t[0] == 8000 and t[8000] == 0 and t[-1] == (40000 - 1 + 8000) % 16000


def test_percentiles_and_options():
    assert percentiles([]) == {"p50": None, "p95": None}
    assert percentiles([1.0, 2.0, 3.0]) == {"p50": 2.0, "p95": 2.9}
    with pytest.raises(HarkenError):
        LoadBenchOptions()  # neither a server nor --self-serve
    with pytest.raises(HarkenError):
        LoadBenchOptions(server="localhost:1", self_serve=True)


def test_self_served_load_reports_the_contract(capsys):
    assert main(["bench", "load", "--self-serve", "--model", "tiny", "--streams", "2", "--seconds", "3",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(CONTRACT) <= set(result)
    assert (result["streams"], result["seconds"]) == (2, 3.0)
    assert result["errors"] == {} and result["reconnects"] == 0
    # each 3 s stream holds speech (from 0.54 s; the second starts 10 s into the sample, mid-segment)
    assert result["segments"] >= 2 and result["events"] >= result["segments"]
    assert isinstance(result["realtime_ok"], bool)
    for key in ("first_partial_ms", "final_ms"):
        assert set(result[key]) == {"p50", "p95"}
        assert 0 <= result[key]["p50"] <= result[key]["p95"]
    if result["p50_update_ms"] is not None:
        assert 0 <= result["p50_update_ms"] <= result["p95_update_ms"]
    assert result["wall_s"] >= 3.0  # paced in real time
    # the engine's compute, batched and for stream 0 alone (a second, one-client run)
    assert result["engine_compute_s"] > 0 and result["engine_compute_alone_s"] > 0
    assert result["batching_gain"] == pytest.approx(2 * result["engine_compute_alone_s"]
                                                    / result["engine_compute_s"], rel=1e-2)


def test_levels_run_one_after_the_other_and_name_the_most_that_kept_up(capsys):
    # no --server: an in-process server, as --self-serve
    assert main(["bench", "load", "--model", "tiny", "--streams", "1,2", "--seconds", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [run["streams"] for run in result["levels"]] == [1, 2]
    assert all(set(CONTRACT) <= set(run) and run["server"] == "self-serve" for run in result["levels"])
    ok = [run["streams"] for run in result["levels"]
          if run["realtime_ok"] and run["p95_update_ms"] is not None and run["p95_update_ms"] <= 300.0]
    assert result["target_p95_update_ms"] == 300.0
    assert result["max_streams_ok"] == (max(ok) if ok else None)


@pytest.mark.parametrize("text", ["0", "1,x", ""])
def test_bad_levels_are_a_clear_error(text, capsys):
    assert main(["bench", "load", "--model", "tiny", "--streams", text, "--json"]) != 0
    assert "--streams" in capsys.readouterr().err


def test_replayed_packets_are_the_edges_in_order_each_due_when_its_audio_was_in():
    from harken.bench.replay import stream_packets
    from harken.edge.pipeline import FeatureStream
    from harken.proto import harken_pb2 as pb
    from harken.shared.features_spec import SAMPLE_RATE

    audio = sample_audio()[:5 * SAMPLE_RATE]
    packets = stream_packets(audio)
    edge = FeatureStream()
    expected = [p for i in range(0, audio.size, 1600) for p in edge.push(audio[i:i + 1600])] + edge.flush()
    got = [pb.ClientMessage.FromString(m).features for _, m in packets]
    assert [(f.seq, f.segment_id, f.first_frame, f.payload) for f in got] == \
        [(i + 1, p.segment_id, p.first_frame, p.payload) for i, p in enumerate(expected)]
    due = [d for d, _ in packets]
    assert due == sorted(due) and due[-1] == 5.0
    # a packet is due no earlier than the audio it covers was captured
    assert all(d >= (f.first_frame + f.frame_count) / 100 - 0.01 for d, f in zip(due, got))


def test_replayed_load_splits_the_servers_cpu_into_model_and_host(capsys):
    from harken.bench.load import stream_audios
    from harken.bench.replay import prepared_streams
    from harken.proto import harken_pb2 as pb

    assert main(["bench", "load", "--self-serve", "--model", "tiny", "--streams", "2", "--seconds", "3",
                 "--replay", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["replay"] is True and result["errors"] == {}
    # one final per segment the edge's packets opened, in every stream
    sent = sum(len({pb.ClientMessage.FromString(m).features.segment_id for _, m in stream})
               for stream in prepared_streams(stream_audios(sample_audio(), LoadBenchOptions(self_serve=True, streams=2, seconds=3.0))))
    assert result["segments"] == sent >= 2
    assert result["model_cpu_ms_per_stream_s"] > 0 and result["host_cpu_ms_per_stream_s"] > 0
    assert result["server_cpu_ms_per_stream_s"] == pytest.approx(
        result["model_cpu_ms_per_stream_s"] + result["host_cpu_ms_per_stream_s"], abs=0.002)


def test_finalizing_clients_get_each_segments_final_from_their_request(capsys):
    from harken.bench.load import finalize_points
    from harken.shared.features_spec import SAMPLE_RATE

    assert main(["bench", "load", "--self-serve", "--model", "tiny", "--streams", "1", "--seconds", "15",
                 "--finalize", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # a request at the end of each VAD segment (the edge's own segmentation of the same audio), each
    # answered by the final of the segment it cut: every final of the stream came from a request
    asked = len(finalize_points(sample_audio()[:15 * SAMPLE_RATE]))
    assert result["errors"] == {} and result["finalize_requests"] == asked >= 2
    assert result["finalize_answered"] == result["segments"] == asked
    assert 0 <= result["finalize_ms"]["p50"] <= result["finalize_ms"]["p95"]
