"""`harken bench files` (lab/bench/files.py) at toy size: its output contract, and the uploads' texts
equal `harken transcribe`'s. No timing thresholds: the figures are the benchmark's business."""

from __future__ import annotations

import json

import pytest

from harken.bench.files import FilesBenchOptions
from harken.cli import main
from harken.shared.errors import HarkenError

CONTRACT = ("model", "uploads", "seconds", "sequential_s", "together_s", "batching_gain", "texts_equal",
            "texts_total", "file_units", "live_seconds", "live_p95_update_ms_alone", "live_p95_update_ms_with_files",
            "live_p95_ratio", "files_during_live_s", "live_realtime_ok")


def test_bench_files_at_toy_size(capsys):
    assert main(["bench", "files", "--model", "tiny-untied", "--uploads", "2", "--seconds", "3",
                 "--live-seconds", "3", "--live-repeats", "1", "--nonstop", "--json"]) in (0, None)
    out = json.loads(capsys.readouterr().out)
    assert set(CONTRACT) <= set(out)
    assert out["uploads"] == 2 and out["texts_total"] == 4
    assert out["texts_equal"] == out["texts_total"]  # every upload's text is harken transcribe's
    assert out["sequential_s"] > 0 and out["together_s"] > 0 and out["batching_gain"] > 0
    assert out["file_units"] > 0 and out["files_during_live_s"] > 0
    assert out["files_nonstop"] >= 2 and "live_p95_ratio_nonstop" in out


def test_options_refuse_nonsense():
    with pytest.raises(HarkenError):
        FilesBenchOptions(uploads=0)
    with pytest.raises(HarkenError):
        FilesBenchOptions(seconds=0)
