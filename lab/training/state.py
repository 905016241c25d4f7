"""synth-en's training state, small enough to live in the repo, so one run continues on any machine.

`harken train synth-en OUTDIR` saves its full state to OUTDIR/state.pt (fp32 weights, optimiser
moments, RNG). That is ~100 MB: too big to commit. The warm-start state is what a run needs to go
on elsewhere, in `lab/training/warmstart/`:

    state.safetensors.zst   every trained tensor (the encoder, the decoder's layers, the trained
                            vocabulary rows, the training-only CTC heads) in bf16 (format 2; fp16
                            in format 1, still read), each tensor's bytes split into a high-byte
                            and a low-byte plane (the sign/exponent bytes then compress well),
                            zstd level 19
    state.json              step, audio hours seen, held-out WER at that step, the recipe and seed,
                            the machine kind it came from, the vocabulary rows and phoneme table,
                            and the evaluation history of every session (the learning curve)

The optimiser's moments do not fit in the 16 MB the repo grants (they would triple the size): a run
resumed from the warm-start state starts a fresh AdamW and warms its learning rate up again over
the first steps (`train.py`'s `rewarm_from`). bf16 rounding moves a weight by at most 2^-8 of its
value: ~2e-4 for a matrix weight of typical size (0.05), about one AdamW step at the learning rate
the run is at (~2.5e-4), and the matrices are what its bf16 autocast multiplies with anyway. bf16
packs in 10.8 bits a weight where fp16 took 13.6 (step 77,606's 8.8M weights: 11.9 against 15.0
MB), which made room for a deeper decoder (`growth.py`). Where the run keeps an average of its
weights (`averaging.py`), the average is packed: it is what the evaluations measured and exported.

    harken train synth-en OUTDIR --pack    OUTDIR/state.pt (+ log.jsonl) -> lab/training/warmstart/
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harken.shared.errors import HarkenError

WARMSTART_DIR = Path(__file__).with_name("warmstart")
WEIGHTS_FILE = "state.safetensors.zst"
META_FILE = "state.json"
FORMAT = 2  # bf16 planes; format 1 (fp16 planes) is still read
READS = {1: torch.float16, 2: torch.bfloat16}
MAX_BYTES = 16 * 1024 * 1024  # what the repo grants the warm-start state, both files together
ZSTD_LEVEL = 19


class WarmStartError(HarkenError):
    pass


def machine_kind(device: str) -> str:
    """'cpu (N cores)' or 'cuda (NVIDIA H100 ...)': where a state's last steps ran."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"gpu ({torch.cuda.get_device_name(0)})"
    return f"cpu ({os.cpu_count()} cores, {platform.machine()})"


# --- packing ------------------------------------------------------------------------------------

def _planes(t: torch.Tensor) -> bytes:
    """A 16-bit tensor -> its high bytes, then its low bytes (little-endian halves)."""
    raw = t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().reshape(-1, 2)
    return raw[:, 1].tobytes() + raw[:, 0].tobytes()


def _unplanes(data: bytes, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    n = int(np.prod(shape)) if shape else 1
    buf = np.frombuffer(data, np.uint8)
    pairs = np.empty((n, 2), np.uint8)
    pairs[:, 1], pairs[:, 0] = buf[:n], buf[n:]
    return torch.from_numpy(pairs.reshape(-1)).view(dtype).reshape(shape).clone()


def pack(state: dict[str, Any], meta: dict[str, Any], out_dir: Path = WARMSTART_DIR,
         fmt: int = FORMAT) -> tuple[Path, int]:
    """Write the warm-start files of `state` (as train.py saves it) into `out_dir`; `meta` adds the
    run's facts (step, WER, recipe, history, ...). Returns the directory and the bytes written. A
    state over `MAX_BYTES` is an error, not a silent truncation. `fmt` 1 writes the fp16 planes of
    earlier sessions (for the tests that read them)."""
    from harken.cloud.base import zstd

    model: dict[str, torch.Tensor] = state["model"]
    index, blobs, offset = {}, [], 0
    for name in sorted(model):
        t = model[name]
        if not t.is_floating_point():
            raise WarmStartError(f"{name}: not a floating tensor ({t.dtype})")
        half = t.detach().float().cpu().to(READS[fmt])
        if not torch.isfinite(half).all():
            raise WarmStartError(f"{name}: not finite in {READS[fmt]} (max |x| {t.abs().max().item():.3g})")
        blob = _planes(half)
        index[name] = {"shape": list(t.shape), "offset": offset, "bytes": len(blob)}
        blobs.append(blob)
        offset += len(blob)
    data = zstd.compress(b"".join(blobs), ZSTD_LEVEL)
    full = {"format": fmt, **meta, "step": int(state["step"]), "frames_seen": int(state.get("frames_seen", 0)),
            "vocab": [int(i) for i in state["vocab"]], "phones": [list(p) for p in state["phones"]],
            "tensors": index, "sha256": hashlib.sha256(data).hexdigest()}
    text = (json.dumps(full, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    total = len(data) + len(text)
    if total > MAX_BYTES:
        raise WarmStartError(f"the warm-start state is {total / 2**20:.1f} MiB, over the {MAX_BYTES / 2**20:.0f} MiB "
                             f"the repo grants it")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, blob in ((WEIGHTS_FILE, data), (META_FILE, text)):
        tmp = out_dir / (name + ".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, out_dir / name)
    return out_dir, total


def read_meta(src: Path = WARMSTART_DIR) -> dict[str, Any] | None:
    """state.json of a warm-start directory, or None where there is none."""
    path = Path(src) / META_FILE
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise WarmStartError(f"{path}: unreadable ({e})") from e
    if meta.get("format") not in READS:
        raise WarmStartError(f"{path}: format {meta.get('format')!r}, this harken reads formats "
                             f"{', '.join(map(str, READS))}")
    return meta


def load(src: Path = WARMSTART_DIR) -> dict[str, Any] | None:
    """The warm-start state as a train.py state dict without optimiser or RNG ("model" in fp32,
    "step", "frames_seen", "vocab", "phones", plus "meta": state.json), or None where `src` has none."""
    from harken.cloud.base import zstd

    meta = read_meta(src)
    if meta is None:
        return None
    path = Path(src) / WEIGHTS_FILE
    try:
        data = path.read_bytes()
    except OSError as e:
        raise WarmStartError(f"{path}: missing ({e}); restore it from git") from e
    if hashlib.sha256(data).hexdigest() != meta["sha256"]:
        raise WarmStartError(f"{path}: corrupted (its sha256 does not match {META_FILE}); restore it from git")
    raw = zstd.decompress(data)
    dtype = READS[meta["format"]]
    model = {name: _unplanes(raw[d["offset"]:d["offset"] + d["bytes"]], d["shape"], dtype).float()
             for name, d in meta["tensors"].items()}
    return {"model": model, "step": meta["step"], "frames_seen": meta.get("frames_seen", 0),
            "vocab": meta["vocab"], "phones": [tuple(p) for p in meta["phones"]], "meta": meta}


def config_of(meta: dict[str, Any]) -> str:
    """Which model a state is of: "synth-en" or "tiny" (the smoke tests')."""
    return str(meta.get("config") or meta.get("recipe", {}).get("config") or "synth-en")


def history(meta: dict[str, Any] | None) -> list[dict[str, Any]]:
    return list(meta.get("history", [])) if meta else []


def pack_run(out: Path, warmstart_dir: Path = WARMSTART_DIR, recipe: dict[str, Any] | None = None) -> dict[str, Any]:
    """`harken train synth-en OUTDIR --pack`: OUTDIR/state.pt and the evaluations in OUTDIR/log.jsonl
    -> the warm-start files. Returns what state.json says about the run (no tensors, no vocabulary)."""
    state_path = out / "state.pt"
    if not state_path.exists():
        raise WarmStartError(f"{state_path}: no training state to pack (run `harken train synth-en {out}` first)")
    state = torch.load(state_path, map_location="cpu", weights_only=False)
    log_path = out / "log.jsonl"
    evals = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()] if log_path.exists() else []
    last = evals[-1] if evals else {}
    meta = {
        "step": state["step"],
        "audio_hours_seen": round(state.get("frames_seen", 0) / 360000, 2),
        "heldout_wer": last.get("heldout_wer"),
        "heldout_wer_step": last.get("step"),
        "audio_gain": last.get("audio_gain"),
        "eval_n": state.get("eval_n"),
        "machine": state.get("machine", "unknown"),
        "recipe": recipe if recipe is not None else state.get("recipe", {}),
        "seed": state.get("recipe", {}).get("seed", 0),
        "history": evals,
    }
    if state.get("average"):  # the weights each evaluation measured and exported (`averaging.py`)
        state = state | {"model": state["model"] | state["average"]["params"]}
        meta["weights"] = f"average (decay {state['average']['decay']})"
    _, total = pack(state, meta, warmstart_dir)
    return {k: v for k, v in meta.items() if k != "history"} | {"bytes": total, "dir": str(warmstart_dir),
                                                                  "evaluations": len(evals)}


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16, per /proc/cpuinfo): there
    bf16 autocast is faster than fp32; elsewhere it is emulated and slower."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags
