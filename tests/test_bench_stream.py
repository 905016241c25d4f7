"""`harken bench stream` (lab/bench/stream.py): its input, bookkeeping and output contract.
No timing thresholds: the figures are the benchmark's business, not the tests'."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from harken.bench.stream import (PACKET_FRAMES, BenchStream, StreamBenchOptions, bench_stream,
                                       integrate_sampled, packets_between, tiled_stream, update_growth)
from harken.cli import main

CONTRACT = ("update_growth", "continuous_update_growth", "phase1_speedup", "phase1_method",
            "throughput_rtf", "p50_update_ms", "p95_update_ms", "batching_gain", "transcripts_identical",
            "harken_total_s", "phase1_total_s", "sequential_total_s", "clock", "seconds", "streams",
            "decode_tokens_per_audio_s", "decode_tokens_per_speech_s", "decode_truncated")


def test_packets_cover_each_segment_once_with_its_flags():
    stream = BenchStream(np.zeros((128, 500), np.float32), [(7, 95), (130, 131), (200, 460)])
    packets = []
    for lo in range(0, 500, 200):  # rounds of 2 s, as the benchmark feeds the engine
        packets += packets_between(stream, lo, lo + 200)
    for sid, (s, e) in enumerate(stream.segments):
        mine = [p for p in packets if p[0] == sid]
        assert [f for p in mine for f in range(p[1], p[2])] == list(range(s, e))
        assert [p[3] for p in mine] == [True] + [False] * (len(mine) - 1)
        assert [p[4] for p in mine] == [False] * (len(mine) - 1) + [True]
        assert all(p[2] - p[1] <= PACKET_FRAMES for p in mine)


def test_tiled_stream_repeats_the_sample_segments():
    raw = np.random.default_rng(0).standard_normal((128, 100)).astype(np.float32) - 3
    s = tiled_stream(raw, [(10, 60)], frames=250, offset=30)
    # the sample's segment [10, 60) at 100-frame periods, shifted 30 frames earlier and clipped
    assert s.segments == [(0, 30), (80, 130), (180, 230)]
    assert s.frames == 250 and s.speech_frames == 130
    tiled = raw[:, (np.arange(250) + 30) % 100]
    running = np.maximum.accumulate(tiled.max(axis=0))
    assert np.array_equal(s.log10_mel, np.maximum(tiled, running - 8.0))
    assert tiled_stream(raw, [(10, 60)], frames=250, continuous=True).segments == [(0, 250)]


def test_integrate_sampled_is_exact_for_linear_cost():
    n = 301
    cost = [0.5 + 0.01 * i for i in range(n)]
    idx = sorted(set(range(0, n, 7)) | {n - 1})
    assert math.isclose(integrate_sampled(idx, [cost[i] for i in idx]), sum(cost))
    assert integrate_sampled([0], [2.0]) == 2.0


def test_update_growth_compares_first_and_last_ten_seconds():
    updates = [(t, 1.0 if t <= 10 else 2.0) for t in range(2, 62, 2)]
    assert update_growth(updates, 60.0) == 2.0
    assert update_growth([(30.0, 1.0)], 60.0) is None


@pytest.fixture(scope="module")
def result():
    return bench_stream(StreamBenchOptions(seconds=6.0, streams=2, phase1_max_seconds=0))


def test_bench_reports_the_contract(result):
    for key in CONTRACT:
        assert key in result, key
    assert result["streams"] == 2 and result["seconds"] == 6.0
    assert result["transcripts_identical"] is True
    assert result["phase1_method"] == "full"
    for key in ("harken_total_s", "phase1_total_s", "sequential_total_s", "throughput_rtf",
                "phase1_speedup", "batching_gain", "p50_update_ms", "update_growth"):
        assert result[key] > 0, key
    assert result["p50_update_ms"] <= result["p95_update_ms"]
    assert result["harken_updates"] > 0 and result["phase1_updates"] >= 2
    by_pass = result["decode_tokens_per_speech_s"]  # updates and final passes: all the decode work
    assert set(by_pass) == {"update", "final"}
    assert math.isclose(sum(by_pass.values()) * result["speech_fraction"], result["decode_tokens_per_audio_s"],
                        rel_tol=0.01, abs_tol=0.01)
    json.dumps(result)


def test_phase1_sampling_when_over_budget():
    r = bench_stream(StreamBenchOptions(seconds=6.0, streams=1, phase1_max_seconds=1e-9, continuous=False))
    assert r["phase1_method"].startswith("sampled every ")
    assert r["phase1_total_s"] > 0 and r["batching_gain"] is None


def test_cli_prints_one_json_object(capsys):
    assert main(["bench", "stream", "--seconds", "4", "--streams", "1", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and json.loads(out[0])["streams"] == 1


def test_two_policies_costs_side_by_side(capsys):
    """`--compare-interval`: the batched run again at another update interval, both policies' compute
    per second of speech in one run. Updates twice as often cost more compute and more decode steps
    on the same streams (tiny, English forced)."""
    assert main(["bench", "stream", "--seconds", "8", "--streams", "1", "--update-interval", "1.0",
                 "--compare-interval", "0.5", "--language", "English", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    default, other = r["policies"]
    assert (default["update_interval_s"], other["update_interval_s"]) == (1.0, 0.5)
    assert default["total_s"] == r["harken_total_s"]  # the default policy is the batched run itself
    assert other["decode_steps_per_speech_s"] > default["decode_steps_per_speech_s"] > 0
    assert r["compare_compute_ratio"] == pytest.approx(other["total_s"] / default["total_s"], rel=1e-2)
