"""synth-en's shipped weights (cloud/model/shipped.py): pack a checkpoint, unpack it into the cache,
and load it as `--model synth-en`.

The checkpoint packed here is a tiny random one shaped like a trained synth-en: the embedding rows
training never touches (ids >= 1000 except the special ids) are exactly zero. It is packed into a
temp dir and unpacked from there, so these tests never read the shipped files (a checkout may not
have them yet).
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from harken.cloud.model.asr import Qwen3ASR
from harken.cloud.model.checkpoint import SYNTH_EN, Checkpoint, resolve_model_dir
from harken.cloud.model import tiny
from harken.cloud.model.tiny import FIRST_SPECIAL_ID, LAST_SPECIAL_ID, make_tiny_model
from harken.cloud.model import shipped as shipped_weights
from harken.cloud.model.shipped import META_FILE, WEIGHTS_FILE, ensure_synth_en, pack
from harken.shared.errors import ModelError

EMBED = "thinker.model.embed_tokens.weight"
TRAINED_ROWS = 1000
MAX_NEW = 16
LEVEL = 3  # the shipped file uses 19; the format is the same and 19 takes seconds here


# --- fixtures -------------------------------------------------------------------------------------


def _rewrite(d, fn) -> None:
    """Replace every tensor t of d/model.safetensors by fn(name, t)."""
    tensors = load_file(str(d / "model.safetensors"))
    save_file({k: fn(k, v).contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})


def _zero_untrained_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    if name != EMBED:
        return t
    keep = torch.zeros(t.shape[0], dtype=torch.bool)
    keep[:TRAINED_ROWS] = True
    keep[FIRST_SPECIAL_ID:LAST_SPECIAL_ID + 1] = True
    return t * keep[:, None]


@pytest.fixture(scope="module", autouse=True)
def real_vocab_once():
    """Qwen's BPE is converted once for the module (seconds each time) though two checkpoint
    directories are written with it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny, "real_vocab", functools.lru_cache(maxsize=1)(tiny.real_vocab))
        yield


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("synth_weights")


@pytest.fixture(scope="module")
def original(root):
    """A tiny fp32 checkpoint whose untrained embedding rows are exactly zero."""
    d = make_tiny_model(root / "original", seed=3)
    _rewrite(d, _zero_untrained_rows)
    return d


@pytest.fixture(scope="module")
def rounded(root, original):
    """The original with every weight rounded to fp16 (and stored back in fp32)."""
    d = root / "rounded"
    shutil.copytree(original, d)
    _rewrite(d, lambda _, t: t.half().float())
    return d


@pytest.fixture(scope="module")
def shipped(root, original):
    """The directory `pack` wrote: what the repo carries in lab/training."""
    out = root / "shipped"
    pack(original, out, level=LEVEL)
    return out


@pytest.fixture(scope="module")
def unpacked(root, shipped):
    return ensure_synth_en(source_dir=shipped, cache_root=root / "cache")


# --- pack / unpack --------------------------------------------------------------------------------


def test_unpacked_tensors_are_the_fp16_rounded_originals_exactly(original, unpacked):
    want = load_file(str(original / "model.safetensors"))
    got = load_file(str(unpacked / "model.safetensors"))
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert got[k].dtype == torch.float32, k
        assert torch.equal(got[k], t.half().float()), k
    assert not got[EMBED][TRAINED_ROWS:FIRST_SPECIAL_ID].any()


def test_unpacked_directory_is_a_complete_checkpoint(original, shipped, unpacked):
    for f in ("config.json", "generation_config.json", "tokenizer.json", "vocab.json", "merges.txt",
              "tokenizer_config.json", "preprocessor_config.json", "chat_template.json"):
        assert (unpacked / f).read_bytes() == (original / f).read_bytes(), f
    meta = json.loads((shipped / META_FILE).read_text())
    assert meta["harken_sha256"] == hashlib.sha256((shipped / WEIGHTS_FILE).read_bytes()).hexdigest()
    assert meta["harken_format"] == shipped_weights.FORMAT_VERSION
    assert unpacked.name == f"synth-en-{meta['harken_sha256'][:12]}"


def test_unpacked_checkpoint_transcribes_like_the_rounded_original(rounded, unpacked):
    ours = Qwen3ASR.load(str(unpacked), dtype="fp32", device="cpu", max_new_tokens=MAX_NEW)
    ref = Qwen3ASR.load(str(rounded), dtype="fp32", device="cpu", max_new_tokens=MAX_NEW)
    rng = np.random.default_rng(0)
    for frames, language in ((300, None), (520, "English")):
        feats = (0.4 * rng.standard_normal((128, frames))).astype(np.float32)
        got, want = ours.transcribe(feats, language=language), ref.transcribe(feats, language=language)
        assert got.token_ids == want.token_ids and got.text == want.text


def test_compressed_weights_are_much_smaller_than_raw(original, shipped):
    raw = (original / "model.safetensors").stat().st_size
    packed = (shipped / WEIGHTS_FILE).stat().st_size
    assert packed < raw / 10, (packed, raw)


def test_second_call_reuses_the_cache(root, shipped, unpacked):
    mtime = (unpacked / "model.safetensors").stat().st_mtime_ns
    assert ensure_synth_en(source_dir=shipped, cache_root=root / "cache") == unpacked
    assert (unpacked / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in (root / "cache").iterdir()] == [unpacked.name]  # no temp dirs left


def test_weights_beyond_fp16_range_refuse_to_pack(root, original):
    d = root / "overflow"
    shutil.copytree(original, d)
    _rewrite(d, lambda k, t: t * 1e6 if k == "thinker.model.norm.weight" else t)
    with pytest.raises(ModelError, match="fp16"):
        pack(d, root / "overflow_out", level=LEVEL)


# --- errors ---------------------------------------------------------------------------------------


def test_corrupted_weights_are_a_model_error(tmp_path, shipped):
    src = tmp_path / "src"
    shutil.copytree(shipped, src)
    data = bytearray((src / WEIGHTS_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (src / WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(ModelError, match="corrupted") as e:
        ensure_synth_en(source_dir=src, cache_root=tmp_path / "cache")
    assert "\n" not in str(e.value)
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half-written left behind


def test_unknown_format_is_a_model_error(tmp_path, shipped):
    src = tmp_path / "src"
    shutil.copytree(shipped, src)
    meta = json.loads((src / META_FILE).read_text())
    (src / META_FILE).write_text(json.dumps({**meta, "harken_format": 99}))
    with pytest.raises(ModelError, match="format 99"):
        ensure_synth_en(source_dir=src, cache_root=tmp_path / "cache")


@pytest.mark.parametrize("present", [[], [META_FILE], [WEIGHTS_FILE]])
def test_missing_shipped_files_are_one_clear_error(tmp_path, shipped, present):
    src = tmp_path / "src"
    src.mkdir()
    for f in present:
        shutil.copy(shipped / f, src / f)
    with pytest.raises(ModelError, match="synth-en weights are not installed") as e:
        ensure_synth_en(source_dir=src, cache_root=tmp_path / "cache")
    assert "\n" not in str(e.value)


# --- --model synth-en -----------------------------------------------------------------------------


def test_model_synth_en_resolves_to_the_unpacked_cache(root, monkeypatch, shipped, unpacked):
    monkeypatch.setattr(shipped_weights, "SHIPPED_DIR", shipped)
    monkeypatch.setenv("HARKEN_CACHE", str(root / "cache"))
    assert resolve_model_dir(SYNTH_EN) == unpacked
    assert Checkpoint.open(SYNTH_EN).path == unpacked


def test_model_synth_en_without_shipped_files_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(shipped_weights, "SHIPPED_DIR", tmp_path / "empty")
    monkeypatch.setenv("HARKEN_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelError, match="weights are not installed"):
        Checkpoint.open(SYNTH_EN)


# --- the packing command --------------------------------------------------------------------------


def test_packing_command_writes_what_pack_writes(root, original, shipped):
    """`python -m harken.cloud.model.shipped CHECKPOINT_DIR OUT_DIR` (what `make ship` and the error
    above name) packs the same tensors as `pack`, at the shipped compression level."""
    import subprocess
    import sys

    out = root / "by_command"
    r = subprocess.run([sys.executable, "-m", "harken.cloud.model.shipped", str(original), str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert str(out / WEIGHTS_FILE) in r.stdout
    meta, want = json.loads((out / META_FILE).read_text()), json.loads((shipped / META_FILE).read_text())
    assert {k: v for k, v in meta.items() if k != "harken_sha256"} == \
        {k: v for k, v in want.items() if k != "harken_sha256"}
    assert meta["harken_sha256"] == hashlib.sha256((out / WEIGHTS_FILE).read_bytes()).hexdigest()
    got = ensure_synth_en(source_dir=out, cache_root=root / "cache_by_command")
    a, b = load_file(str(got / "model.safetensors")), load_file(str(original / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k].half().float()) for k in b)


def test_packing_command_on_a_missing_checkpoint_is_one_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "harken.cloud.model.shipped", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "nope").exists()
