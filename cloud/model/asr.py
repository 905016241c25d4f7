"""Qwen3-ASR assembled: checkpoint -> encoder + decoder + tokenizer, and one-pass transcription.

    features [128, T] -> AudioEncoder -> audio embeddings [N, hidden]
    prompt ids (N x <|audio_pad|>) -> embed -> audio written over the pads
    -> prefill (KV cache) -> greedy decode to <|im_end|>/<|endoftext|> -> parse

The same steps as the official `Qwen3ASRModel.transcribe` (transformers backend) for one audio
item, on harken's own encoder, decoder and tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .checkpoint import (DEFAULT_MODEL, SYNTH_EN, TINY, TINY_UNTIED, Checkpoint,
                                           resolve_device, resolve_dtype)
from .config import Qwen3ASRConfig
from .decode_limits import DecodeLimits
from .decoder import Qwen3Decoder, greedy_decode, prefill
from .encoder import AudioEncoder, as_features
from .kv_cache import KVCache
from .prompt import Prompt, build_prompt, forced_language, parse_transcript
from .tokenizer import ENDOFTEXT, IM_END, Tokenizer
from ...shared.errors import ModelError
from ...shared.features_spec import FRAMES_PER_SECOND

MAX_NEW_TOKENS = 512  # the official package's default


@dataclass(frozen=True)
class AsrResult:
    """One transcription. `token_ids` are the generated ids without the final EOS."""

    text: str
    language: str  # canonical name ("English"), "" when unknown or silent
    token_ids: list[int]


class Qwen3ASR:
    """A loaded model: `Qwen3ASR.load("Qwen/Qwen3-ASR-0.6B").transcribe(features)`."""

    def __init__(self, config: Qwen3ASRConfig, encoder: AudioEncoder, decoder: Qwen3Decoder,
                 tokenizer: Tokenizer, max_new_tokens: int = MAX_NEW_TOKENS):
        self.config = config
        self.encoder = encoder.eval()
        self.decoder = decoder.eval()
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.eos_ids = (tokenizer.token_id(IM_END), tokenizer.token_id(ENDOFTEXT))
        self._cache: KVCache | None = None  # one slot, regrown only when a request needs more
        self.source = ""  # what it was loaded from (`--model`: "tiny", a Hub id, a dir); "" if built here
        # whether a stream's earlier committed text may go into its next item's context: synth-en
        # was trained with an empty system turn only, and context text throws it off
        self.reads_context = True

    @classmethod
    def load(cls, model: str = DEFAULT_MODEL, dtype: str | torch.dtype | None = None,
             device: str | torch.device | None = None, max_new_tokens: int = MAX_NEW_TOKENS) -> "Qwen3ASR":
        """Load a checkpoint (local dir, Hugging Face id, `tiny` or `synth-en`). dtype: bf16/fp16/fp32,
        default bf16 on CUDA and fp32 on CPU; device: cpu/cuda, default cuda when available."""
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        ckpt = Checkpoint.open(model)
        tokenizer = Tokenizer.from_dir(ckpt.path)
        enc_sd, dec_sd = ckpt.load_state_dicts(dtype=dt, device=dev)
        cfg = ckpt.config
        if cfg.audio.output_dim != cfg.text.hidden_size:
            raise ModelError(f"{ckpt.path}: encoder output_dim {cfg.audio.output_dim} != decoder "
                             f"hidden_size {cfg.text.hidden_size}")
        with torch.device(dev):
            encoder = AudioEncoder(cfg.audio).to(dt)
        decoder = _empty_decoder(cfg, dev, dt)
        try:
            encoder.load_state_dict(enc_sd, strict=True)
            decoder.load_official_state_dict(dec_sd)
        except (RuntimeError, ValueError) as e:
            raise ModelError(f"{ckpt.path}: weights do not fit the config ({str(e).splitlines()[0][:200]})") from e
        asr = cls(cfg, encoder, decoder, tokenizer, max_new_tokens=max_new_tokens)
        asr.source = model
        asr.reads_context = model != SYNTH_EN
        return asr

    def describe(self) -> dict:
        """Which model this is, for users: `{"model", "kind", "test_model", "note"}`. kind "tiny" /
        "tiny-untied" (random weights, test_model true: a tiny checkpoint by name, or any checkpoint
        with the tiny preset's dims, e.g. from `make-tiny-model`), "synth-en" or "qwen3-asr"."""
        tiny = Qwen3ASRConfig.tiny()
        t = self.config.text
        tiny_dims = self.config.audio == tiny.audio and (t.hidden_size, t.num_hidden_layers, t.intermediate_size) == (
            tiny.text.hidden_size, tiny.text.num_hidden_layers, tiny.text.intermediate_size)
        if self.source in (TINY, TINY_UNTIED) or tiny_dims:
            kind = self.source if self.source in (TINY, TINY_UNTIED) else TINY
            return {"model": self.source or kind, "kind": kind, "test_model": True,
                    "note": "a tiny checkpoint with random weights, for tests: its transcripts are meaningless"}
        if self.source == SYNTH_EN:
            return {"model": SYNTH_EN, "kind": SYNTH_EN, "test_model": False,
                    "note": "harken's own small English model, trained on synthetic speech"}
        return {"model": self.source, "kind": "qwen3-asr", "test_model": False, "note": ""}

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.dtype

    # -- the pieces of one pass, public for tests and the benchmark --

    def as_features(self, features: np.ndarray | torch.Tensor) -> torch.Tensor:
        """[128, T] normalised log-mel (numpy or torch) -> a tensor in the model's dtype/device."""
        return as_features(features, self.config.audio.num_mel_bins, self.device, self.dtype)

    @torch.no_grad()
    def prompt_embeddings(self, features: np.ndarray | torch.Tensor, language: str | None = None,
                          context: str = "") -> tuple[Prompt, torch.Tensor]:
        """Encode the audio and build the decoder input: (prompt, embeddings [L, hidden])."""
        feats = self.as_features(features)
        audio = self.encoder(feats)  # [N, hidden]
        prompt = build_prompt(self.tokenizer, audio.shape[0], context, forced_language(language))
        ids = torch.tensor(prompt.ids, device=self.device)
        embeds = self.decoder.embed(ids).clone()  # [L, hidden]
        embeds[prompt.audio_start:prompt.audio_start + prompt.audio_len] = audio.to(embeds.dtype)
        return prompt, embeds

    @torch.no_grad()
    def transcribe(self, features: np.ndarray | torch.Tensor, language: str | None = None,
                   context: str = "", max_new_tokens: int | None = None,
                   limits: DecodeLimits | None = None) -> AsrResult:
        """Transcribe one utterance's features ([128, T], normalised as WhisperFeatureExtractor
        does). `language` forces the output language (e.g. "english"); `context` goes into the
        system turn (hot words, previous text). `limits`: also bound the decode by the audio's
        length and stop a hallucination loop (what the commands use); None decodes exactly as the
        official package does, up to `max_new_tokens`."""
        forced = forced_language(language)
        prompt, embeds = self.prompt_embeddings(features, forced, context)
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if limits is not None:
            budget = min(budget, limits.budget(features.shape[-1] / FRAMES_PER_SECOND))
        cache = self._cache_for(len(prompt.ids) + budget)
        slot = cache.allocate()
        try:
            logits = prefill(self.decoder, cache, [slot], [embeds])
            new = greedy_decode(self.decoder, cache, [slot], logits, budget, self.eos_ids,
                                loop_cut=limits.loop_cut if limits is not None else None)[0]
        finally:
            cache.free(slot)
        if new and new[-1] in self.eos_ids:
            new = new[:-1]
        raw = self.tokenizer.decode(new, skip_special_tokens=True)
        parsed = parse_transcript(raw, forced)
        return AsrResult(text=parsed.text, language=parsed.language, token_ids=new)

    def _cache_for(self, length: int) -> KVCache:
        if self._cache is None or self._cache.max_len < length:
            # round up so that slightly longer requests do not reallocate every time
            size = max(256, 1 << (length - 1).bit_length())
            self._cache = KVCache.for_config(self.config.text, max_slots=1, max_len=size,
                                             dtype=self.dtype, device=self.device)
        return self._cache


def _empty_decoder(cfg: Qwen3ASRConfig, device: torch.device, dtype: torch.dtype) -> Qwen3Decoder:
    """The decoder with uninitialised storage: every tensor is about to be overwritten by the
    checkpoint, and the random init of a 0.6B decoder alone takes seconds on a CPU."""
    with torch.device("meta"):
        decoder = Qwen3Decoder(cfg.text, tie_word_embeddings=cfg.tie_word_embeddings)
    decoder = decoder.to_empty(device=device).to(dtype)
    if decoder.tied:  # to_empty gives each module its own storage: tie the head again
        decoder.lm_head.weight = decoder.model.embed_tokens.weight
    return decoder
