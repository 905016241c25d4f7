"""`harken bench soak` (lab/bench/soak.py): its bookkeeping and output contract at a tiny scale.
No timing or memory thresholds: the figures are the benchmark's business, not the tests'."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from harken.cli import main
from harken.bench.soak import SoakBenchOptions, SoakRecord, endless_pieces, rss_mb
from harken.shared.errors import HarkenError

CONTRACT = ("minutes", "speed", "sample_s", "samples", "rss_start_mb", "rss_growth_mb", "rss_max_mb",
            "rss_slope_mb_per_hour", "p95_update_ms_first", "p95_update_ms_last", "audio_s", "events", "segments", "errors", "reconnects",
            "wall_s")
SAMPLE = ("t_s", "rss_mb", "updates", "p50_update_ms", "p95_update_ms", "finals", "audio_s", "events_held")


def test_endless_pieces_tile_the_sample_at_the_given_speed():
    sample = np.arange(1000, dtype=np.float32)
    record = SoakRecord(piece_samples=400)

    async def collect():
        import time

        t0 = time.monotonic()
        # 400 samples = 25 ms of audio; at speed 10 a piece is due every 2.5 ms: 8 pieces in 20 ms
        return [p async for p in endless_pieces(sample, record, t0, t0 + 0.0201, speed=10.0)]

    pieces = asyncio.run(collect())
    assert len(pieces) == 8 == len(record.handed)
    joined = np.concatenate(pieces)
    assert np.array_equal(joined, np.arange(3200) % 1000)
    assert record.audio_s == pytest.approx(3200 / 16000)


def test_record_takes_the_latencies_of_each_minute():
    record = SoakRecord(piece_samples=1600)
    record.handed.extend([100.0 + 0.1 * k for k in range(20)])
    record.observe(1.0, False, now=101.2)  # audio to 1.0 s handed with piece 9 at 100.9
    record.observe(1.5, True, now=102.0)
    assert record.take() == (pytest.approx([300.0]), 1)
    assert record.take() == ([], 0)
    assert (record.events, record.segments) == (2, 1)


def test_options_and_rss():
    with pytest.raises(HarkenError):
        SoakBenchOptions(minutes=0)
    assert rss_mb() is None or rss_mb() > 10


def test_soak_reports_samples_and_growth(capsys):
    assert main(["bench", "soak", "--minutes", "0.1", "--sample-s", "2", "--speed", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(CONTRACT) <= set(result)
    assert result["errors"] == {} and result["reconnects"] == 0
    assert len(result["samples"]) == 3
    for s in result["samples"]:
        assert set(SAMPLE) <= set(s)
    assert [s["t_s"] for s in result["samples"]] == pytest.approx([2.0, 4.0, 6.0], abs=0.5)
    assert result["audio_s"] == pytest.approx(12.0, abs=0.2)  # 6 s at twice real time
    assert result["events"] >= result["segments"] >= 1
    if result["rss_start_mb"] is not None:
        assert result["rss_growth_mb"] == pytest.approx(result["samples"][-1]["rss_mb"] - result["samples"][0]["rss_mb"],
                                                        abs=0.11)


def test_rss_slope_is_the_least_squares_trend_per_hour():
    from harken.bench.soak import rss_slope

    samples = [{"t_s": 60.0 * k, "rss_mb": 500.0 + 0.1 * k + (0.05 if k % 2 else -0.05)} for k in range(1, 11)]
    assert rss_slope(samples) == pytest.approx(6.0, abs=0.5)  # 0.1 MB a minute
    assert rss_slope(samples[:1]) is None
