"""`make train-device` (deploy/device/train.sh), the command a lent GPU runs, exercised here on the CPU
at toy size so that a GPU's minutes are never spent on debugging: the carried espeak-ng, texts and
held-out features are what the corpus and the evaluation use, a toy state resumes, the files come
back in $OUT, and what the device call carries stays under the 64 MiB it may take."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harken.training import corpus, speech
from harken.training import state as warm

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / ".device-carry"
CARRY_LIMIT = 60 * 2**20  # the device takes 64 MiB of working tree; keep a margin


@pytest.fixture(scope="module")
def carry() -> Path:
    """`make device-carry` (kept between runs: it only fills in what is missing)."""
    run = subprocess.run(["bash", "deploy/device/carry.sh", str(CARRY)], cwd=ROOT, capture_output=True, text=True,
                         timeout=900, env={**os.environ, "PY": sys.executable})
    assert run.returncode == 0, run.stderr[-3000:]
    return CARRY


def _size(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def test_what_the_device_call_carries_stays_under_60_mib(carry):
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    tree = _size([ROOT / p.decode() for p in listed if p])
    carried = _size(list(carry.rglob("*")))
    assert any((carry / "debs").glob("libjemalloc2_*.deb"))
    assert any((carry / "debs").glob("espeak-ng_*.deb")) and len(list((carry / "wheels").glob("*.whl"))) >= 5
    assert not any((carry / "wheels").glob("zstandard-*.whl"))  # 5.5 MB; backports.zstd's is 0.5
    assert any("cp312" in w.name for w in (carry / "wheels").glob("*.whl"))  # for the device's Python
    # the warm-start state may grow to its 16 MiB cap: count the cap, not today's size
    ws_now = _size(list(warm.WARMSTART_DIR.glob("*"))) if warm.WARMSTART_DIR.exists() else 0
    total = tree - ws_now + warm.MAX_BYTES + carried
    assert total < CARRY_LIMIT, f"tree {tree / 2**20:.1f} MiB + carry {carried / 2**20:.1f} MiB"


def _device_run(tmp: Path, out: Path, carry: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "deploy/device/train.sh"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PY": sys.executable, "CARRY": str(carry), "PREFIX": str(tmp / "prefix"),
                               "RUN": str(tmp / "run"), "OUT": str(out), "TOY": "1", "EVAL_N": "3", **env})


GLIBC = ("linux-vdso.so", "libc.so", "libm.so", "ld-linux-x86-64.so", "libpthread.so", "libdl.so", "librt.so")


def _libraries_outside(prefix: Path) -> list[str]:
    """The libraries the carried espeak-ng, run through its wrapper's LD_LIBRARY_PATH, loads from
    outside the prefix, glibc's own excepted: each is one the device image may lack. (The first GPU
    run stopped at libpulsecommon, which libpulse0 keeps in a private pulseaudio/ folder: this
    machine has it under /usr, so only this check tells.)"""
    wrapper = (prefix / "bin" / "espeak-ng").read_text()
    lib_path = wrapper.split('LD_LIBRARY_PATH="', 1)[1].split('"', 1)[0]
    ldd = subprocess.run(["ldd", str(prefix / "root" / "usr" / "bin" / "espeak-ng")], capture_output=True,
                         text=True, check=True, env={**os.environ, "LD_LIBRARY_PATH": lib_path}).stdout
    outside = []
    for line in ldd.splitlines():
        name = line.split()[0]
        where = line.split("=>", 1)[1].split("(")[0].strip() if "=>" in line else name
        if not where.startswith(str(prefix)) and not os.path.basename(name).startswith(GLIBC):
            outside.append(line.strip())
    return outside


def _speaks_like_the_full_espeak_ng(carried: Path) -> None:
    """The carried espeak-ng, its data cut to English (deploy/device/carry.sh), gives the same audio,
    byte for byte, as this machine's with Debian's whole espeak-ng-data, in every accent the corpus
    speaks and across its variants; and it has no other language."""
    text = "Please add Ravi to the data channel at 11:20 am: $1,234, the 3rd of May."
    for k, accent in enumerate(speech.ESPEAK_ACCENTS):
        for variant in ("", speech.ESPEAK_VARIANTS[1 + k % 7], speech.ESPEAK_VARIANTS[8 + k % 5]):
            voice = f"{accent}+{variant}" if variant else accent
            args = ["-v", voice, "-s", "170", "-p", "40", "--stdout", "--", text]
            here = subprocess.run(["espeak-ng", *args], capture_output=True, check=True).stdout
            there = subprocess.run([str(carried), *args], capture_output=True, check=True).stdout
            assert len(here) > 10_000 and here == there, voice
    assert subprocess.run([str(carried), "-v", "de", "--stdout", "hallo"], capture_output=True).stdout == b""


def test_train_device_runs_at_toy_size_and_resumes_what_it_wrote(tmp_path, carry):
    first = _device_run(tmp_path / "one", tmp_path / "out1", carry)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = tmp_path / "out1"
    assert sorted(p.name for p in out.iterdir()) == ["device.txt", "log.jsonl", "train.log", "warmstart"]
    device = (out / "device.txt").read_text()
    # the carried espeak-ng (unpacked from the .debs into the prefix) spoke the corpus
    assert f"espeak-ng: {tmp_path / 'one' / 'prefix' / 'bin' / 'espeak-ng'}" in device and "torch:" in device
    # and the trainer ran on the carried jemalloc (unpacked there too), as its log says
    assert "train-device: allocator jemalloc" in device
    assert "allocator: jemalloc" in (out / "train.log").read_text()
    assert _libraries_outside(tmp_path / "one" / "prefix") == []
    _speaks_like_the_full_espeak_ng(tmp_path / "one" / "prefix" / "bin" / "espeak-ng")
    # the held-out set there: the Piper-voiced features as carried, the espeak-ng ones rendered there
    # with the carried espeak-ng (English data alone) exactly as here with Debian's whole package
    held = corpus.read_held_out()[:3]
    assert [u.recipe.voice == speech.PIPER for u in held] == [True, True, False]
    with np.load(carry / "heldout-40.npz") as z:
        assert "f2" not in z.files
        carried = {k: z[k] for k in ("f0", "f1")}
    with np.load(tmp_path / "one" / "run" / "heldout-3.npz") as z:
        assert np.array_equal(z["f0"], carried["f0"]) and np.array_equal(z["f1"], carried["f1"])
        assert np.array_equal(z["f2"], corpus.render_features(held[2].recipe).astype(np.float16))
    meta = warm.read_meta(out / "warmstart")
    assert meta is not None and meta["step"] == 2 and meta["heldout_wer_step"] == 2
    assert meta["recipe"]["config"] == "tiny" and meta["machine"].startswith("cpu")
    shards = json.loads((tmp_path / "one" / "run" / "corpus" / "train-00000.jsonl").read_text().splitlines()[0])
    assert shards["recipe"]["voice"] != "piper-joe"  # the device has no Piper voice
    # the next device call starts from what this one brought back
    second = _device_run(tmp_path / "two", tmp_path / "out2", carry, WARMSTART=str(out / "warmstart"), STEPS="3")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed at step 2 from the warm-start state" in (tmp_path / "out2" / "train.log").read_text()
    meta2 = warm.read_meta(tmp_path / "out2" / "warmstart")
    assert meta2 is not None and meta2["step"] == 3
    assert [r["step"] for r in meta2["history"]] == [2, 3]
