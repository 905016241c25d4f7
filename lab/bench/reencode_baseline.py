"""Phase 1: the re-feed-everything streaming baseline that harken's engine must beat.

What the official `qwen-asr` streaming (`init_streaming_state` / `streaming_transcribe` /
`finish_streaming_transcribe`, vLLM backend) and the project's seed systems do, re-implemented on
harken's own model code (same weights, same numerics), one stream at a time:

    every `update_interval_s` of audio (the official `chunk_size_sec`, 2 s):
        encoder(ALL features so far)                  no window cache: O(T)
        prompt + forced prefix -> prefill from empty   fresh KV: O(T) (+ O(T^2) attention)
        greedy decode up to `max_new_tokens` (32)      each step attends over all of it

    forced prefix: nothing for the first `unfixed_chunk_num` (2) updates, then the previous output
    minus its last `unfixed_token_num` (5) tokens, backing off further while the kept tokens end
    inside a UTF-8 character.

So one update costs O(T) and a session O(T^2). 32 new tokens is the official streaming demo's
setting (`Qwen3ASRModel.LLM(max_new_tokens=32)`). Two deliberate differences from the package,
neither of which changes the cost: the input is log-mel frames (harken's cloud receives features,
so re-extracting them is the edge's job and not counted), and the rollback works on token ids
instead of text -> ids -> text -> prompt tokenisation (exact, and checkable token by token).
Prompts longer than `prefill_chunk_tokens` are prefilled in pieces, as vLLM's chunked prefill does,
which bounds memory on long sessions without changing the work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from harken.cloud.model.asr import Qwen3ASR
from harken.cloud.model.decoder import greedy_decode, prefill
from harken.cloud.model.kv_cache import KVCache
from harken.cloud.model.prompt import forced_language, parse_transcript
from harken.cloud.model.tokenizer import Tokenizer
from harken.shared.features_spec import FRAMES_PER_SECOND


@dataclass(frozen=True)
class Phase1Options:
    """The official streaming state's knobs (`init_streaming_state` defaults) plus its demo's token cap."""

    update_interval_s: float = 2.0  # chunk_size_sec
    unfixed_chunk_num: int = 2  # updates decoded without a forced prefix
    unfixed_token_num: int = 5  # tokens of the previous output rolled back before forcing it
    max_new_tokens: int = 32
    language: str | None = None
    context: str = ""
    prefill_chunk_tokens: int = 4096

    @property
    def update_frames(self) -> int:
        return max(1, int(round(self.update_interval_s * FRAMES_PER_SECOND)))


@dataclass(frozen=True)
class Phase1Update:
    """What one update did and produced."""

    index: int  # 0, 1, ... (the official `chunk_id` before the update)
    frames: int  # feature frames re-fed (all of the session so far)
    prefix_ids: list[int]  # forced start of the assistant turn
    new_ids: list[int]  # generated after the prefix, EOS dropped
    text: str
    language: str
    seconds: float  # wall time of the whole update (encode + prefill + decode)

    @property
    def token_ids(self) -> list[int]:
        """The update's whole output: prefix + new tokens."""
        return self.prefix_ids + self.new_ids


def forced_prefix(token_ids: list[int], rollback: int, tokenizer: Tokenizer) -> list[int]:
    """The previous output minus its last `rollback` tokens, and further tokens while what is kept
    decodes to a broken UTF-8 character (U+FFFD), as the official rollback does."""
    k = rollback
    while True:
        end = max(0, len(token_ids) - k)
        if end == 0:
            return []
        kept = token_ids[:end]
        if "\ufffd" not in tokenizer.decode(kept):
            return kept
        k += 1


@dataclass
class Phase1Stream:
    """One stream through the Phase-1 baseline: `push(frames)` as features arrive, `finish()` at
    the end. Every update starts from nothing but the features and the previous output."""

    asr: Qwen3ASR
    options: Phase1Options = field(default_factory=Phase1Options)

    def __post_init__(self):
        self.language = forced_language(self.options.language)
        self.updates: list[Phase1Update] = []
        self._features: list[np.ndarray] = []  # [128, k] pieces as pushed
        self._frames = 0
        self._fed = 0  # frames covered by the last update
        self._token_ids: list[int] = []  # the previous update's output
        self._cache: KVCache | None = None

    @property
    def frames(self) -> int:
        return self._frames

    @property
    def text(self) -> str:
        return self.updates[-1].text if self.updates else ""

    def append(self, frames: np.ndarray) -> None:
        """Append feature frames [128, k] without running an update."""
        frames = np.asarray(frames, dtype=np.float32)
        if frames.ndim != 2 or frames.shape[0] != self.asr.config.audio.num_mel_bins:
            raise ValueError(f"frames must be [{self.asr.config.audio.num_mel_bins}, k], got {list(frames.shape)}")
        if frames.shape[1]:
            self._features.append(frames)
            self._frames += frames.shape[1]

    def push(self, frames: np.ndarray) -> list[Phase1Update]:
        """Append feature frames [128, k]; run an update for every `update_interval_s` completed."""
        self.append(frames)
        out = []
        step = self.options.update_frames
        while self._frames - self._fed >= step:
            out.append(self.update(self._fed + step))
        return out

    def finish(self) -> Phase1Update | None:
        """Re-feed everything once more if frames arrived after the last update (the official
        `finish_streaming_transcribe` on the tail; its rollback there keeps at least one token and
        skips the UTF-8 check, a difference that changes no cost and is not copied)."""
        return self.update(self._frames) if self._frames > self._fed else None

    def update(self, frames: int, index: int | None = None) -> Phase1Update:
        """One Phase-1 update over the session's first `frames` frames, after the previous update's
        output. `index` (default: the number of updates so far) decides whether a prefix is forced;
        the benchmark passes it when it runs only every K-th update of a long session."""
        if not 0 < frames <= self._frames:
            raise ValueError(f"update over {frames} frames: {self._frames} appended")
        t0 = time.perf_counter()
        index = len(self.updates) if index is None else index
        o = self.options
        prefix = [] if index < o.unfixed_chunk_num else forced_prefix(self._token_ids, o.unfixed_token_num,
                                                                     self.asr.tokenizer)
        feats = self._all_features()[:, :frames]
        new = phase1_decode(self.asr, feats, prefix, o.max_new_tokens, self.language, o.context,
                            self._cache_for, o.prefill_chunk_tokens)
        ids = prefix + new
        parsed = parse_transcript(self.asr.tokenizer.decode(ids), self.language)
        seconds = time.perf_counter() - t0
        u = Phase1Update(index, frames, prefix, new, parsed.text, parsed.language, seconds)
        self.updates.append(u)
        self._token_ids = ids
        self._fed = frames
        return u

    def _all_features(self) -> np.ndarray:
        if len(self._features) > 1:  # keep one array: every update reads all of it anyway
            self._features = [np.concatenate(self._features, axis=1)]
        return self._features[0]

    def _cache_for(self, length: int) -> KVCache:
        if self._cache is None or self._cache.max_len < length:
            size = max(256, 1 << (length - 1).bit_length())
            self._cache = None  # release the old storage before allocating the new
            self._cache = KVCache.for_config(self.asr.config.text, max_slots=1, max_len=size,
                                             dtype=self.asr.dtype, device=self.asr.device)
        return self._cache


@torch.no_grad()
def phase1_decode(asr: Qwen3ASR, features: np.ndarray | torch.Tensor, prefix_ids: list[int],
                  max_new_tokens: int, language: str | None = None, context: str = "",
                  cache_for=None, prefill_chunk_tokens: int = 4096) -> list[int]:
    """Encode all `features` from scratch, prefill prompt + `prefix_ids` into an empty KV slot and
    decode greedily: the new token ids, EOS dropped. `cache_for(length)` supplies a KVCache with
    room for `length` positions (default: a new one)."""
    prompt, embeds = asr.prompt_embeddings(features, language, context)  # encoder(all features)
    if prefix_ids:
        forced = asr.decoder.embed(torch.tensor(prefix_ids, device=asr.device))
        embeds = torch.cat([embeds, forced.to(embeds.dtype)])
    length = embeds.shape[0] + max_new_tokens
    cache = cache_for(length) if cache_for else KVCache.for_config(
        asr.config.text, max_slots=1, max_len=length, dtype=asr.dtype, device=asr.device)
    slot = cache.allocate()  # length 0: nothing carried over from the previous update
    try:
        for start in range(0, embeds.shape[0], prefill_chunk_tokens):
            logits = prefill(asr.decoder, cache, [slot], [embeds[start:start + prefill_chunk_tokens]])
        new = greedy_decode(asr.decoder, cache, [slot], logits, max_new_tokens, asr.eos_ids)[0]
    finally:
        cache.free(slot)
    if new and new[-1] in asr.eos_ids:
        new = new[:-1]
    return new
