"""Qwen3-ForcedAligner on harken's own encoder and decoder: word start/end times for known text.

The aligner is the Qwen3-ASR network with a classification head in place of the vocabulary head:
`classify_num` time bins of `timestamp_segment_time` ms each. One non-autoregressive pass over

    <|audio_start|> <|audio_pad|> x N <|audio_end|> word1 <timestamp><timestamp> word2 <timestamp><timestamp> ...

(no chat turns, no system prompt) gives, at each `<timestamp>` position, the argmax bin: the first of a
word's two is its start, the second its end. The bins go through the official monotonic repair
(`fix_timestamp`: the longest non-decreasing subsequence stays, short runs of outliers take a
neighbour's value, longer runs are interpolated) and become milliseconds, then seconds rounded to the
millisecond, exactly as the official `Qwen3ForcedAligner.align` (qwen-asr 0.0.6) reports them.

Checkpoint: the official layout (`Qwen/Qwen3-ForcedAligner-0.6B`, or a local directory): top-level
`timestamp_token_id` / `timestamp_segment_time`, `thinker_config.model_type` "qwen3_forced_aligner"
with `classify_num`, weights `thinker.audio_tower.*`, `thinker.model.*` and a `thinker.lm_head.weight`
of [classify_num, hidden] (never tied to the embeddings).

Batches: every item is encoded on its own windows (as the recogniser's encoder does) and the prompts go
through the decoder as one packed pass (`forward_packed` over a scratch KV cache), so an item's times do
not depend on what else is in its batch.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

from .checkpoint import Checkpoint, resolve_device, resolve_dtype
from .config import Qwen3ASRConfig
from .decoder import Qwen3Decoder
from .encoder import AudioEncoder, as_features
from .kv_cache import KVCache, plan_batch
from .aligner_format import TIMESTAMP, TIMESTAMP_SEGMENT_MS, TIMESTAMP_TOKEN_ID
from .tiny_aligner import ensure_tiny_aligner
from .tokenizer import AUDIO_END, AUDIO_PAD, AUDIO_START, Tokenizer
from ...shared.errors import ModelError

DEFAULT_ALIGNER = "Qwen/Qwen3-ForcedAligner-0.6B"
TINY_ALIGNER = "tiny"  # `--model tiny` for `harken align`: a cached tiny random aligner (tests)
CLASSIFY_NUM = 5000
MAX_ALIGN_SECONDS = 180.0  # the official package's longest aligned chunk (MAX_FORCE_ALIGN_INPUT_SECONDS)
# languages whose words the official package finds with extra tokenizers (nagisa, soynlp)
_DICTIONARY_LANGUAGES = ("japanese", "korean")


# --- words -----------------------------------------------------------------------------------------

def _kept(ch: str) -> bool:
    """Letters, numbers and the apostrophe survive in a word; everything else is dropped."""
    return ch == "'" or unicodedata.category(ch)[0] in ("L", "N")


def _cjk(ch: str) -> bool:
    """A CJK ideograph (unified, extensions A-E, compatibility): one aligned unit each."""
    c = ord(ch)
    return (0x4E00 <= c <= 0x9FFF or 0x3400 <= c <= 0x4DBF or 0x20000 <= c <= 0x2A6DF
            or 0x2A700 <= c <= 0x2B73F or 0x2B740 <= c <= 0x2B81F or 0x2B820 <= c <= 0x2CEAF
            or 0xF900 <= c <= 0xFAFF)


def split_words(text: str, language: str = "English") -> list[str]:
    """The units the aligner times, as the official package cuts them for every language but Japanese
    and Korean: whitespace-separated pieces with all but letters, digits and `'` removed (pieces left
    empty vanish), and inside a piece each CJK ideograph is a unit of its own."""
    if language.strip().lower() in _DICTIONARY_LANGUAGES:
        raise ModelError(f"{language}: word splitting for Japanese and Korean needs dictionary tokenizers "
                         f"(nagisa, soynlp) that harken does not ship; space-separated languages and "
                         f"Chinese are supported")
    words: list[str] = []
    for piece in text.split():
        cleaned = "".join(ch for ch in piece if _kept(ch))
        run: list[str] = []
        for ch in cleaned:
            if _cjk(ch):
                if run:
                    words.append("".join(run))
                    run = []
                words.append(ch)
            else:
                run.append(ch)
        if run:
            words.append("".join(run))
    return words


# --- the monotonic repair ----------------------------------------------------------------------------

def fix_timestamp(values: Sequence[float] | np.ndarray) -> list[int]:
    """The official repair of the predicted times (same results, element for element).

    The longest non-decreasing subsequence is kept (of equally long ones: each element's earliest
    predecessor, and the earliest end). Each run of other values is replaced: a run of one or two by
    the nearer kept neighbour (the left one on a tie; the only one at an edge), a longer run by a
    straight line between its kept neighbours (or the one neighbour it has). Results are truncated
    to int as the official code does.
    """
    data = [float(v) for v in (values.tolist() if isinstance(values, np.ndarray) else values)]
    n = len(data)
    if n == 0:
        return []
    arr = np.asarray(data, dtype=np.float64)
    dp = np.ones(n, dtype=np.int64)
    parent = np.full(n, -1, dtype=np.int64)
    for i in range(1, n):
        ok = arr[:i] <= arr[i]
        if ok.any():
            cand = np.where(ok, dp[:i], 0)
            j = int(cand.argmax())  # the first j with the longest chain
            if cand[j] + 1 > 1:
                dp[i], parent[i] = cand[j] + 1, j
    normal = [False] * n
    idx = int(dp.argmax())
    while idx != -1:
        normal[idx] = True
        idx = int(parent[idx])

    result: list[float | None] = list(data)
    i = 0
    while i < n:
        if normal[i]:
            i += 1
            continue
        j = i
        while j < n and not normal[j]:
            j += 1
        left = next((result[k] for k in range(i - 1, -1, -1) if normal[k]), None)
        right = next((result[k] for k in range(j, n) if normal[k]), None)
        run = j - i
        for k in range(i, j):
            if run <= 2:
                if left is None:
                    result[k] = right
                elif right is None:
                    result[k] = left
                else:
                    result[k] = left if (k - (i - 1)) <= (j - k) else right
            elif left is not None and right is not None:
                result[k] = left + (right - left) / (run + 1) * (k - i + 1)
            elif left is not None or right is not None:
                result[k] = left if left is not None else right
        i = j
    assert all(r is not None for r in result)  # every run has a kept neighbour
    return [int(r) for r in result if r is not None]


# --- results -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AlignedWord:
    """One aligned unit: its text and its start / end in seconds (millisecond resolution) from the
    start of the aligned audio."""

    text: str
    start: float
    end: float

    def as_dict(self) -> dict:
        return {"text": self.text, "start": self.start, "end": self.end}


def words_from_bins(words: list[str], bins: Sequence[int], segment_ms: float) -> list[AlignedWord]:
    """Bins at the 2 * len(words) `<timestamp>` positions -> repaired word times (seconds)."""
    if len(bins) != 2 * len(words):
        raise ValueError(f"{len(bins)} timestamp bins for {len(words)} words")
    ms = fix_timestamp([b * segment_ms for b in bins])
    return [AlignedWord(w, round(ms[2 * i] / 1000.0, 3), round(ms[2 * i + 1] / 1000.0, 3))
            for i, w in enumerate(words)]


# --- config and prompt -------------------------------------------------------------------------------

@dataclass(frozen=True)
class AlignerConfig:
    """The Qwen3-ASR network's config plus the aligner's head and timestamp fields."""

    base: Qwen3ASRConfig
    classify_num: int = CLASSIFY_NUM
    timestamp_token_id: int = TIMESTAMP_TOKEN_ID
    timestamp_segment_time: float = TIMESTAMP_SEGMENT_MS

    @classmethod
    def from_dict(cls, raw: dict) -> "AlignerConfig":
        """Read an official aligner config.json (the timestamp fields at the top level or in
        thinker_config). ModelError for a recogniser's config (no classification head)."""
        thinker = raw.get("thinker_config", raw)
        kind = str(thinker.get("model_type", raw.get("model_type", "")))
        if "forced_aligner" not in kind and "classify_num" not in thinker:
            raise ModelError(f"model_type {kind!r}: not a Qwen3-ForcedAligner checkpoint (a recogniser? "
                             f"`harken align` needs {DEFAULT_ALIGNER} or a checkpoint in its layout)")
        base = Qwen3ASRConfig.from_dict(raw)
        base = replace(base, tie_word_embeddings=False)  # the classification head is its own matrix

        def field(name, default):
            return thinker.get(name, raw.get(name, default))

        return cls(base=base, classify_num=int(field("classify_num", CLASSIFY_NUM)),
                   timestamp_token_id=int(field("timestamp_token_id", TIMESTAMP_TOKEN_ID)),
                   timestamp_segment_time=float(field("timestamp_segment_time", TIMESTAMP_SEGMENT_MS)))


@dataclass(frozen=True)
class AlignerPrompt:
    ids: list[int]
    audio_start: int  # index of the first <|audio_pad|>
    audio_len: int
    words: list[str]
    timestamp_index: list[int]  # positions of the <timestamp> tokens, 2 per word


def build_aligner_prompt(tokenizer: Tokenizer, n_audio: int, words: list[str], timestamp_id: int) -> AlignerPrompt:
    """The aligner's input ids: audio block then each word followed by two `<timestamp>` tokens.

    Tokenised as the official processor does its one string: the added tokens cut the text, so each
    word is encoded on its own, without a leading space."""
    ids = [tokenizer.token_id(AUDIO_START)] + [tokenizer.token_id(AUDIO_PAD)] * n_audio + [tokenizer.token_id(AUDIO_END)]
    stamps: list[int] = []
    for w in words:
        ids += tokenizer.encode(w)
        stamps += [len(ids), len(ids) + 1]
        ids += [timestamp_id, timestamp_id]
    return AlignerPrompt(ids=ids, audio_start=1, audio_len=n_audio, words=words, timestamp_index=stamps)


# --- the model -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AlignRequest:
    """One item: normalised log-mel [128, T] (as WhisperFeatureExtractor gives), its text and language."""

    features: np.ndarray | torch.Tensor
    text: str
    language: str = "English"


class Qwen3ForcedAligner:
    """A loaded aligner: `Qwen3ForcedAligner.load(DEFAULT_ALIGNER).align(features, "the text")`."""

    def __init__(self, config: AlignerConfig, encoder: AudioEncoder, decoder: Qwen3Decoder, tokenizer: Tokenizer):
        self.config = config
        self.encoder = encoder.eval()
        self.decoder = decoder.eval()
        self.tokenizer = tokenizer
        self.source = ""
        self._cache: KVCache | None = None
        got = tokenizer.token_id(TIMESTAMP) if TIMESTAMP in tokenizer.added else config.timestamp_token_id
        if got != config.timestamp_token_id:
            raise ModelError(f"tokenizer's {TIMESTAMP} is id {got}, the config says {config.timestamp_token_id}")

    @classmethod
    def load(cls, model: str = DEFAULT_ALIGNER, dtype: str | torch.dtype | None = None,
             device: str | torch.device | None = None) -> "Qwen3ForcedAligner":
        """Load an aligner checkpoint: a local directory, a Hugging Face id (default
        Qwen/Qwen3-ForcedAligner-0.6B, from the local cache or the Hub) or `tiny`."""
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        if model == TINY_ALIGNER:
            model_dir = str(ensure_tiny_aligner())
        else:
            model_dir = model
        ckpt = Checkpoint.open(model_dir)
        cfg = AlignerConfig.from_dict(ckpt.raw_config)
        tokenizer = Tokenizer.from_dir(ckpt.path)
        enc_sd, dec_sd = ckpt.load_state_dicts(dtype=dt, device=dev)
        a, t = cfg.base.audio, cfg.base.text
        if a.output_dim != t.hidden_size:
            raise ModelError(f"{ckpt.path}: encoder output_dim {a.output_dim} != decoder hidden_size {t.hidden_size}")
        with torch.device(dev):
            encoder = AudioEncoder(a).to(dt)  # as the recogniser builds it (its sinusoid table included)
        with torch.device("meta"):  # every decoder tensor is about to be overwritten: no random init
            decoder = Qwen3Decoder(t, tie_word_embeddings=False)
            decoder.lm_head = nn.Linear(t.hidden_size, cfg.classify_num, bias=False)
        decoder = decoder.to_empty(device=dev).to(dt)
        try:
            encoder.load_state_dict(enc_sd, strict=True)
            decoder.load_official_state_dict(dec_sd)
        except (RuntimeError, ValueError) as e:
            raise ModelError(f"{ckpt.path}: weights do not fit the aligner config "
                             f"({str(e).splitlines()[0][:200]})") from e
        aligner = cls(cfg, encoder, decoder, tokenizer)
        aligner.source = model
        return aligner

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.dtype

    def _features(self, features: np.ndarray | torch.Tensor) -> torch.Tensor:
        return as_features(features, self.config.base.audio.num_mel_bins, self.device, self.dtype)

    @torch.no_grad()
    def align(self, features: np.ndarray | torch.Tensor, text: str, language: str = "English") -> list[AlignedWord]:
        """Word times of `text` in one utterance's features ([128, T])."""
        return self.align_batch([AlignRequest(features, text, language)])[0]

    @torch.no_grad()
    def align_batch(self, requests: Sequence[AlignRequest]) -> list[list[AlignedWord]]:
        """Align several items in one encoder batch and one decoder pass; each item's result is what
        `align` gives it alone. Items whose text has no words get [] (and cost nothing)."""
        words = [split_words(r.text, r.language) for r in requests]
        todo = [i for i, w in enumerate(words) if w]
        out: list[list[AlignedWord]] = [[] for _ in requests]
        if not todo:
            return out
        feats = [self._features(requests[i].features) for i in todo]
        audio = self.encoder.encode_items(feats)  # [N_i, hidden] each
        prompts = [build_aligner_prompt(self.tokenizer, a.shape[0], words[i], self.config.timestamp_token_id)
                   for a, i in zip(audio, todo)]
        bins = self.timestamp_bins(prompts, audio)
        seg = self.config.timestamp_segment_time
        for i, p, b in zip(todo, prompts, bins):
            out[i] = words_from_bins(p.words, b, seg)
        return out

    @torch.no_grad()
    def prompt_embeddings(self, prompt: AlignerPrompt, audio: torch.Tensor) -> torch.Tensor:
        ids = torch.tensor(prompt.ids, device=self.device)
        embeds = self.decoder.embed(ids).clone()
        embeds[prompt.audio_start:prompt.audio_start + prompt.audio_len] = audio.to(embeds.dtype)
        return embeds

    @torch.no_grad()
    def timestamp_bins(self, prompts: Sequence[AlignerPrompt], audio: Sequence[torch.Tensor]) -> list[list[int]]:
        """One packed decoder pass over the prompts -> the argmax bin at each `<timestamp>` position."""
        return [logits.argmax(-1).tolist() for logits in self.timestamp_logits(prompts, audio)]

    @torch.no_grad()
    def timestamp_logits(self, prompts: Sequence[AlignerPrompt], audio: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """[2 * words, classify_num] head outputs per prompt (one packed pass, no padding)."""
        embeds = [self.prompt_embeddings(p, a) for p, a in zip(prompts, audio)]
        lengths = [e.shape[0] for e in embeds]
        cache = self._cache_for(len(prompts), max(lengths))
        slots = [cache.allocate() for _ in prompts]
        try:
            layout = plan_batch(cache, slots, lengths)
            hidden = self.decoder.forward_packed(torch.cat(embeds), layout, cache)  # [N, hidden]
        finally:
            for s in slots:
                cache.free(s)
        starts = np.cumsum([0] + lengths[:-1])
        index = torch.tensor([int(s) + j for s, p in zip(starts, prompts) for j in p.timestamp_index],
                             device=hidden.device, dtype=torch.long)
        logits = self.decoder.lm_head(hidden[index])  # [sum 2 * words, classify_num]
        return list(logits.split([len(p.timestamp_index) for p in prompts]))

    def _cache_for(self, slots: int, length: int) -> KVCache:
        """A scratch cache for one pass (kept, and regrown only when a batch needs more)."""
        c = self._cache
        if c is None or c.max_slots < slots or c.max_len < length:
            size = max(256, 1 << (length - 1).bit_length(), c.max_len if c else 0)
            self._cache = KVCache.for_config(self.config.base.text, max_slots=max(slots, c.max_slots if c else 1),
                                             max_len=size, dtype=self.dtype, device=self.device)
            c = self._cache
        return c


def describe_words(words: list[AlignedWord]) -> str:
    """Human-readable lines: `  0.240   0.720  word`."""
    return "\n".join(f"{w.start:8.3f} {w.end:8.3f}  {w.text}" for w in words)


def read_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
