"""`make bench-device` (deploy/device/bench.sh), the command a lent GPU runs, exercised here on the CPU
at toy size so that it cannot rot before a GPU comes: the CPU variant of one CUDA test, the model
bench and two levels of the engine-load bench run through the same script, with nothing carried
(the device image has what it needs), and the JSON and the plot come back in $OUT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

from harken.bench.engine_load_plot import _raster_plot
from harken.training import state as warm

ROOT = Path(__file__).resolve().parents[1]
CARRY_LIMIT = 60 * 2**20  # the device takes 64 MiB of working tree; keep a margin


def test_bench_device_runs_at_toy_size(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(["bash", "deploy/device/bench.sh"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PY": sys.executable, "TOY": "1", "OUT": str(out),
                              "PREFIX": str(tmp_path / "prefix"), "CARRY": str(tmp_path / "nothing-carried")})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert {"bench-device.json", "engine-load.png", "device.txt", "test-gpu.log", "bench.log"} <= {
        p.name for p in out.iterdir()}
    assert len(list(out.iterdir())) <= 8  # what the device tool brings back
    assert (out / "engine-load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "torch:" in (out / "device.txt").read_text()  # what it ran on
    result = json.loads((out / "bench-device.json").read_text())
    assert {name: s["exit"] for name, s in result["steps"].items()} == {"test-gpu": 0, "bench-model": 0,
                                                                        "engine-load": 0}
    assert result["tests"]["passed"] and not result["tests"]["failed"]
    assert result["model"]["models"]["tiny"]["decoder"]["decode_batch4_ms_per_step"] > 0
    # read from the file bench model rewrites after each part (a cap's kill keeps the parts done)
    assert set(result["model"]["part_seconds"]) == {"tiny.encoder", "tiny.decoder"}
    load = result["engine_load"]
    assert [lv["streams"] for lv in load["levels"]] == [1, 2]
    for key in ("gpu", "torch", "cuda", "kv_mib_per_stream", "kv_capacity_streams", "max_streams_ok",
                "gpu_s_per_stream_hour_at_max", "cut", "decode_step", "graph_capture_s"):
        assert key in load
    for lv in load["levels"]:
        for key in ("p50_update_ms", "p95_update_ms", "p50_first_partial_ms", "p95_first_partial_ms",
                    "p50_final_ms", "busy_fraction", "gpu_s_per_stream_hour", "batching_gain",
                    "sessions_per_tick", "mib_per_stream", "undrained", "feeder_max_lag_ms", "ok"):
            assert key in lv
        assert lv["updates"] > 0 and lv["p95_update_ms"] > 0
    assert load["levels"][0]["batching_gain"] == 1.0
    assert "N=    2" in run.stdout  # the summary


def test_the_plot_without_matplotlib(tmp_path):
    """The fallback raster (no matplotlib): a valid 640x400 RGB PNG."""
    path = tmp_path / "p.png"
    _raster_plot([1, 8, 64, 512], [40.0, 60.0, 150.0, 420.0], 300.0, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert int.from_bytes(data[16:20], "big") == 640 and int.from_bytes(data[20:24], "big") == 400
    idat = data.index(b"IDAT")
    n = int.from_bytes(data[idat - 4:idat], "big")
    assert len(zlib.decompress(data[idat + 4:idat + 4 + n])) == 400 * (1 + 640 * 3)


def test_the_tree_alone_fits_the_device_call():
    """bench.sh needs nothing carried: the working tree (the warm-start state counted at its cap)
    stays under 60 MiB of the 64 the device takes."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    files = [ROOT / p.decode() for p in listed if p]
    tree = sum(p.stat().st_size for p in files if p.is_file() and not p.is_symlink())
    ws_now = sum(p.stat().st_size for p in warm.WARMSTART_DIR.glob("*")) if warm.WARMSTART_DIR.exists() else 0
    assert tree - ws_now + warm.MAX_BYTES < CARRY_LIMIT, f"tree {tree / 2**20:.1f} MiB"


def test_sample_features_without_soundfile(monkeypatch):
    """The device image has no soundfile: the sample read by the standard library's wave module
    gives the same features and segments."""
    import numpy as np

    from harken.bench import engine_load

    raw, segments = engine_load.sample_features()
    monkeypatch.setitem(sys.modules, "soundfile", None)  # import soundfile -> ImportError
    raw2, segments2 = engine_load.sample_features()
    assert segments2 == segments and np.array_equal(raw2, raw)


def _fake_python(tmp_path: Path) -> Path:
    """A `PY` for bench.sh whose steps are stand-ins (no model runs): the tests and the model bench
    pass at once; engine-load writes its JSON (indented, as lab/bench/engine_load.py does after each
    level) and a plot into --out, then hangs until the step's cap kills it. Anything else is the
    real Python."""
    level = {"streams": 1, "ok": True, "p50_update_ms": 10.0, "p95_update_ms": 20.0, "p95_first_partial_ms": 5.0,
             "busy_fraction": 0.1, "batching_gain": 1.0, "mib_per_stream": None}
    partial = {"bench": "engine-load", "levels": [level], "cut": [], "target_p95_update_ms": 300.0,
               "max_streams_ok": 1, "gpu_s_per_stream_hour_at_max": 3600.0}
    (tmp_path / "partial.json").write_text(json.dumps(partial, indent=1) + "\n")
    script = tmp_path / "fake-python"
    script.write_text(f"""#!/usr/bin/env bash
case "$*" in
  *"-m pytest"*) echo "PASSED tests/test_gpu.py::test_x"; echo "1 passed in 0.01s"; exit 0 ;;
  *"bench model"*) echo '{{"models": {{}}}}'; exit 0 ;;
  *"bench engine-load"*)
    out=; prev=
    for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done
    mkdir -p "$out" && cp {tmp_path / "partial.json"} "$out/engine-load.json"
    printf '\\x89PNG\\r\\n\\x1a\\n' > "$out/engine-load.png"
    echo "engine-load: N = 1: p95 update 20.0 ms, busy 0.1, ok"
    exec sleep 60 ;;
  *) exec {sys.executable} "$@" ;;
esac
""")
    script.chmod(0o755)
    return script


def test_an_engine_load_cut_at_its_cap_keeps_the_levels_it_wrote(tmp_path):
    """engine-load killed at LOAD_S (a level or the profile running long) after it wrote its
    levels: bench-device.json still carries them, and the plot comes back. bench.sh read the
    indented engine-load.json line by line (`last_json`), which never parses, so only the JSON
    printed at a clean end was ever seen."""
    out = tmp_path / "out"
    run = subprocess.run(["bash", "deploy/device/bench.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PY": str(_fake_python(tmp_path)), "TOY": "1", "OUT": str(out),
                              "PREFIX": str(tmp_path / "prefix"), "CARRY": str(tmp_path / "nothing-carried"),
                              "LOAD_S": "3"})
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]  # a step was cut: not a clean run
    result = json.loads((out / "bench-device.json").read_text())
    assert result["steps"]["engine-load"]["exit"] == 124 and result["steps"]["engine-load"]["cut"]
    assert result["engine_load"] is not None and [lv["streams"] for lv in result["engine_load"]["levels"]] == [1]
    assert (out / "engine-load.png").exists()
    assert "N=    1" in run.stdout  # the summary has the level


def test_a_failed_profile_keeps_the_levels(tmp_path, monkeypatch):
    """The profile (torch.profiler, after the levels) failing must not lose the levels: they are
    returned and written, with the profile's error said."""
    from harken.bench import engine_load

    def broken(*a, **kw):
        raise RuntimeError("CUPTI_ERROR_INSUFFICIENT_PRIVILEGES")

    monkeypatch.setattr(engine_load, "profile_level", broken)
    opts = engine_load.EngineLoadOptions(levels=(1,), more=False, seconds=1.0, model="tiny", device="cpu",
                                         threads=1, drain_s=1.0, profile_s=1.0, out_dir=str(tmp_path))
    result = engine_load.bench_engine_load(opts)
    assert [lv["streams"] for lv in result["levels"]] == [1]
    assert "CUPTI" in result["profile_error"]
    written = json.loads((tmp_path / "engine-load.json").read_text())
    assert [lv["streams"] for lv in written["levels"]] == [1] and "CUPTI" in written["profile_error"]
    assert (tmp_path / "engine-load.png").exists()


def test_the_profile_takes_the_largest_level_that_kept_up():
    """engine-load profiles the largest level with nothing undrained, at most 64 streams (the first
    GPU run profiled a fallen-behind N = 512 past its step's cap), else the smallest that ran."""
    from harken.bench.engine_load import profile_streams

    def lv(n: int, undrained: int = 0) -> dict:
        return {"streams": n, "undrained": undrained}

    assert profile_streams([]) is None
    assert profile_streams([lv(1), lv(8), lv(16), lv(64), lv(128), lv(512, 512)]) == 64
    assert profile_streams([lv(1), lv(8), lv(16, 3)]) == 8
    assert profile_streams([lv(8, 1), lv(64, 9)]) == 8


def test_random_weights_are_forced_to_english():
    """Unforced, a random model never writes <asr_text>, so no partial is ever sent (the first GPU
    run measured 0 updates at every level): the 0.6B-dims random weights and the tiny checkpoints
    are forced to English; a trained model's language is detected."""
    from harken.bench.engine_load import EngineLoadOptions, forced_language
    from harken.cloud.model.asr import Qwen3ASR

    tiny = Qwen3ASR.load("tiny", dtype="fp32", device="cpu")
    assert forced_language(EngineLoadOptions(model="real-dims"), tiny) == "English"
    assert forced_language(EngineLoadOptions(model="tiny"), tiny) == "English"
