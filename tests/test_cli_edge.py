"""The edge commands as a user runs them: real processes, exit codes, one-line errors, no torch."""

import json
import subprocess
import sys

import numpy as np
import pytest

from signals import concat, noisy, silence, speech, write_wav

HARKEN = [sys.executable, "-m", "harken"]


def run(*args, check_ok=True):
    r = subprocess.run([*HARKEN, *map(str, args)], capture_output=True, text=True, timeout=300)
    if check_ok:
        assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    x = noisy(concat(silence(0.5), speech("Checking the command line interface."), silence(0.8)), 35)
    import soxr

    files = {
        "speech16k": write_wav(d / "speech16k.wav", x),
        "speech8k": write_wav(d / "speech8k.wav", soxr.resample(x, 16000, 8000).astype(np.float32), 8000),
        "stereo44k": write_wav(d / "stereo44k.wav", soxr.resample(x, 16000, 44100).astype(np.float32),
                               44100, channels=2),
        "empty": write_wav(d / "empty.wav", np.zeros(0, np.float32)),
        "missing": d / "missing.wav",
    }
    (d / "notaudio.wav").write_text("hello, I am text\n")
    files["notaudio"] = d / "notaudio.wav"
    return files


@pytest.mark.parametrize("name", ["speech16k", "speech8k", "stereo44k"])
def test_vad_json(inputs, name):
    out = json.loads(run("vad", inputs[name], "--json").stdout)
    assert set(out) == {"segments", "speech_s"}
    assert len(out["segments"]) == 1
    seg = out["segments"][0]
    assert 0.2 < seg["start_s"] < 0.7 and seg["end_s"] > seg["start_s"] + 1.0
    assert out["speech_s"] == pytest.approx(seg["end_s"] - seg["start_s"], abs=1e-3)


@pytest.mark.parametrize("name", ["speech16k", "speech8k", "stereo44k"])
def test_features_npy(inputs, name, tmp_path):
    out = tmp_path / "f.npy"
    run("features", inputs[name], "-o", out)
    f = np.load(out)
    n_samples = int(round((0.5 + 0.8) * 16000)) + speech("Checking the command line interface.").size
    assert f.dtype == np.float32 and f.shape[0] == 128
    assert abs(f.shape[1] - n_samples // 160) <= 1
    assert np.isfinite(f).all() and f.min() >= f.max() - 2.0  # floored at max - 8 log10 = 2 after /4


@pytest.mark.parametrize("command", [["vad", "--json"], ["features", "-o", "/tmp/harken-x.npy"],
                                     ["demo"], ["bench", "edge", "--json"]])
@pytest.mark.parametrize("name,message", [("missing", "no such file"), ("notaudio", "not a readable audio file"),
                                          ("empty", "no audio samples")])
def test_bad_input_is_one_clear_line(inputs, command, name, message):
    cmd = [command[0], *command[1:2], inputs[name], *command[2:]] if command[0] == "bench" else \
        [command[0], inputs[name], *command[1:]]
    r = run(*cmd, check_ok=False)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_features_output_to_missing_directory(inputs, tmp_path):
    r = run("features", inputs["speech16k"], "-o", tmp_path / "nodir" / "f.npy", check_ok=False)
    assert r.returncode == 2 and "no such directory" in r.stderr and "Traceback" not in r.stderr


def test_edge_demo_reports_segments_frames_bytes_bitrate():
    out = run("demo", "--edge-only").stdout
    assert "segment 0" in out and "frames" in out and "bytes" in out and "kbps" in out


def test_demo_serves_and_streams_the_sample_through_the_sdk():
    """`harken demo`: in-process server + edge agent; one line per final segment, the wire summary."""
    from harken.edge.vad import get_speech_timestamps
    from harken.edge.audio import load_audio
    from harken.commands.options import sample_path as _sample_path

    r = run("demo", "--fast", "--model", "tiny")
    lines = r.stdout.splitlines()
    assert lines[0].startswith("harken demo: server on 127.0.0.1:")
    finals = [line for line in lines if line.startswith("[")]
    assert len(finals) == len(get_speech_timestamps(load_audio(_sample_path())))
    assert f"{len(finals)} segments" in lines[-1] and "kbps during speech" in lines[-1]


def test_help_lists_the_commands():
    out = run("--help").stdout
    for c in ("demo", "vad", "features", "bench"):
        assert c in out


def test_edge_commands_never_import_torch(inputs, tmp_path):
    code = (
        "import sys\n"
        "from harken.cli import main\n"
        f"assert main(['vad', {str(inputs['speech16k'])!r}, '--json']) == 0\n"
        f"assert main(['features', {str(inputs['speech16k'])!r}, '-o', {str(tmp_path / 'f.npy')!r}]) == 0\n"
        f"assert main(['demo', '--edge-only', {str(inputs['speech16k'])!r}]) == 0\n"
        "assert 'torch' not in sys.modules, 'the edge path imported torch'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def _sent_bytes(line: str) -> int:
    """The byte count in a summary line ("... frames in N bytes ...")."""
    import re

    found = re.search(r"frames in (\d+) bytes", line)
    assert found, line
    return int(found.group(1))


def test_codec_flag_reaches_the_edge_and_the_sdk():
    """`--codec` picks the feature codec mode of `demo --edge-only` (`--mode` still works) and of the
    SDK client `demo` streams with: the served demo sends exactly the bytes the edge pipeline
    alone makes in that mode."""
    low = run("demo", "--edge-only", "--codec", "low").stdout.splitlines()[-1]
    assert run("demo", "--edge-only", "--mode", "low").stdout.splitlines()[-1] == low
    hifi = run("demo", "--edge-only", "--codec", "hifi").stdout.splitlines()[-1]
    assert _sent_bytes(low) < _sent_bytes(hifi)
    served = run("demo", "--fast", "--model", "tiny", "--codec", "low").stdout.splitlines()[-1]
    assert _sent_bytes(served) == _sent_bytes(low)
    bad = run("stream", "x.wav", "--codec", "lossless", check_ok=False)
    assert bad.returncode == 2 and "--codec" in bad.stderr
