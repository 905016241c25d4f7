"""Find and read a Qwen3-ASR checkpoint: `--model` -> directory -> config + encoder/decoder tensors.

`--model` is a local directory, a Hugging Face id (default `Qwen/Qwen3-ASR-0.6B`, fetched with
huggingface_hub: the local cache first, then the network), `tiny` (a cached tiny random
checkpoint built on first use) or `synth-en` (harken's own small English model, shipped compressed
in lab/training and unpacked to the cache on first use). Weights come from `model.safetensors` or a
sharded `model.safetensors.index.json`, read with safetensors and split by prefix:

    thinker.audio_tower.*              -> encoder (prefix stripped)
    thinker.model.*, thinker.lm_head.* -> decoder (`thinker.` stripped)

The transformers-native `-hf` layout (top-level `audio_config`/`text_config`; weights under
`model.audio_tower.*`, `model.language_model.*`, `lm_head.*`) is mapped onto the same names.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import Qwen3ASRConfig
from .shipped import ensure_synth_en
from .tiny import ensure_tiny_model
from ...shared.errors import ModelError

DEFAULT_MODEL = "Qwen/Qwen3-ASR-0.6B"
TINY = "tiny"
TINY_UNTIED = "tiny-untied"  # a tiny random model that never says end-of-text (for benchmarks)
SYNTH_EN = "synth-en"
ACCEPTED = f"a checkpoint directory, a Hugging Face id, '{TINY}', '{TINY_UNTIED}' or '{SYNTH_EN}'"
_HUB_FILES = ["*.json", "*.safetensors", "merges.txt", "vocab.json", "*.jinja"]

# (checkpoint prefix, destination, new prefix); first match wins
_PREFIXES = (
    ("thinker.audio_tower.", "encoder", ""),
    ("thinker.model.", "decoder", "model."),
    ("thinker.lm_head.", "decoder", "lm_head."),
    ("model.audio_tower.", "encoder", ""),
    ("model.language_model.", "decoder", "model."),
    ("audio_tower.", "encoder", ""),
    ("language_model.", "decoder", "model."),
    ("lm_head.", "decoder", "lm_head."),
)
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
           "float32": torch.float32, "float": torch.float32, "fp64": torch.float64,
           "float64": torch.float64}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None -> cuda when available, else cpu. ModelError for CUDA without a GPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ModelError(f"unknown device {device!r} (cpu, cuda, cuda:N)") from e
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} asked for, but no CUDA GPU is available")
    return d


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None -> bf16 on CUDA, fp32 on CPU. Accepts bf16/fp16/fp32 (and fp64, for tests)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ModelError(f"unknown dtype {dtype!r} (bf16, fp16, fp32)") from None


def resolve_model_dir(model: str) -> Path:
    """`--model` -> a local directory holding the checkpoint (downloading or unpacking it if need be).
    Accepts a checkpoint directory, a Hugging Face id, 'tiny' or 'synth-en'."""
    if model == TINY:
        return ensure_tiny_model()
    if model == TINY_UNTIED:
        return ensure_tiny_model(head="untied")
    if model == SYNTH_EN:
        return ensure_synth_en()
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"{path}: not a Qwen3-ASR checkpoint (no config.json)")
        return path
    if path.exists():
        raise ModelError(f"{path}: is a file; --model takes {ACCEPTED}")
    if _looks_like_path(model) or model.count("/") != 1:
        raise ModelError(f"{model}: no such model directory (--model takes a checkpoint directory, "
                         f"a Hugging Face id such as {DEFAULT_MODEL}, '{TINY}' or '{SYNTH_EN}')")
    return Path(_download(model))


def _looks_like_path(model: str) -> bool:
    return model.startswith((".", "/", "~")) or model.endswith("/") or "\\" in model


def _download(repo_id: str) -> str:
    """The snapshot from the local Hugging Face cache, else from the Hub."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_FILES, local_files_only=True)
    except Exception:  # noqa: BLE001 - any cache miss falls through to the network attempt
        pass
    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_FILES)
    except Exception as e:  # noqa: BLE001 - network, auth, offline mode, unknown repo: one line
        name = type(e).__name__
        if "RepositoryNotFound" in name or "RevisionNotFound" in name:
            raise ModelError(f"{repo_id}: no such model on the Hugging Face Hub (or it needs a token); "
                             f"--model takes {ACCEPTED}") from e
        raise ModelError(
            f"cannot get {repo_id}: not in the Hugging Face cache and the Hub is unreachable ({name}); "
            f"download it where there is network (huggingface-cli download {repo_id}) and copy the "
            f"cache over, or pass --model /path/to/checkpoint, --model synth-en or --model tiny") from e


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory and its parsed config."""

    path: Path
    config: Qwen3ASRConfig
    raw_config: dict

    @classmethod
    def open(cls, model: str) -> "Checkpoint":
        path = resolve_model_dir(model)
        try:
            raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ModelError(f"{path / 'config.json'}: unreadable ({e})") from e
        model_type = raw.get("model_type", "")
        if model_type and "qwen3_asr" not in model_type:
            raise ModelError(f"{path}: model_type {model_type!r} is not a Qwen3-ASR checkpoint")
        try:
            config = Qwen3ASRConfig.from_dict(raw)
        except TypeError as e:
            raise ModelError(f"{path / 'config.json'}: unexpected config ({e})") from e
        return cls(path, config, raw)

    def weight_files(self) -> list[Path]:
        single = self.path / "model.safetensors"
        if single.exists():
            return [single]
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise ModelError(f"{index}: unreadable shard index ({e})") from e
            files = [self.path / f for f in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise ModelError(f"{self.path}: missing weight shards {', '.join(missing[:3])}")
            return files
        raise ModelError(f"{self.path}: no model.safetensors or model.safetensors.index.json")

    def load_state_dicts(self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
                         ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(encoder, decoder) tensors under harken's names, cast to `dtype` on `device`.
        Tensors of neither part (e.g. a talker) are ignored."""
        from safetensors import SafetensorError, safe_open

        encoder: dict[str, torch.Tensor] = {}
        decoder: dict[str, torch.Tensor] = {}
        for f in self.weight_files():
            try:
                with safe_open(str(f), framework="pt", device="cpu") as st:
                    for key in st.keys():
                        dest = _route(key)
                        if dest is None:
                            continue
                        part, name = dest
                        t = st.get_tensor(key).to(device=device, dtype=dtype)
                        (encoder if part == "encoder" else decoder)[name] = t
            except (SafetensorError, OSError) as e:
                raise ModelError(f"{f}: unreadable safetensors file ({e})") from e
        if not encoder or not decoder:
            raise ModelError(f"{self.path}: no Qwen3-ASR weights found (expected thinker.audio_tower.* "
                             f"and thinker.model.* tensors)")
        return encoder, decoder


def _route(key: str) -> tuple[str, str] | None:
    for prefix, part, new in _PREFIXES:
        if key.startswith(prefix):
            return part, new + key[len(prefix):]
    return None
