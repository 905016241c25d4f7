"""Qwen3-ASR configuration as dataclasses, read from an official `config.json`.

Only the fields the official code reads are kept; defaults are the released 0.6B values, but every
field is taken from the checkpoint when present. `tiny()` is the preset tests build from.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

AUDIO_TOKEN_ID = 151676
AUDIO_START_TOKEN_ID = 151669
AUDIO_END_TOKEN_ID = 151670


@dataclass(frozen=True)
class AudioEncoderConfig:
    num_mel_bins: int = 128
    d_model: int = 896
    encoder_layers: int = 18
    encoder_attention_heads: int = 14
    encoder_ffn_dim: int = 3584
    output_dim: int = 1024
    n_window: int = 50  # half a conv chunk, in feature frames: chunks are 2 * n_window = 100 frames
    n_window_infer: int = 800  # attention window, in feature frames (8 s)
    conv_chunksize: int = 500
    downsample_hidden_size: int = 480
    max_source_positions: int = 1500
    activation_function: str = "gelu"
    scale_embedding: bool = False

    @property
    def chunk_frames(self) -> int:
        return 2 * self.n_window

    @property
    def chunks_per_window(self) -> int:
        return self.n_window_infer // self.chunk_frames


@dataclass(frozen=True)
class TextDecoderConfig:
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 65536
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = True


@dataclass(frozen=True)
class Qwen3ASRConfig:
    audio: AudioEncoderConfig = field(default_factory=AudioEncoderConfig)
    text: TextDecoderConfig = field(default_factory=TextDecoderConfig)
    audio_token_id: int = AUDIO_TOKEN_ID
    audio_start_token_id: int = AUDIO_START_TOKEN_ID
    audio_end_token_id: int = AUDIO_END_TOKEN_ID
    # lm_head tied to embed_tokens (the released checkpoints); read from either level of config.json
    tie_word_embeddings: bool = True

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "Qwen3ASRConfig":
        """Accept the original layout (`thinker_config.{audio_config,text_config}`) or the
        transformers-native `-hf` layout (top-level `audio_config`/`text_config`)."""
        thinker = cfg.get("thinker_config", cfg)
        audio = _pick(AudioEncoderConfig, thinker.get("audio_config", {}))
        text = _pick(TextDecoderConfig, thinker.get("text_config", {}))
        tie = cfg.get("tie_word_embeddings", thinker.get("tie_word_embeddings",
                                                        thinker.get("text_config", {}).get("tie_word_embeddings", True)))
        return cls(
            audio=audio,
            text=text,
            audio_token_id=thinker.get("audio_token_id", AUDIO_TOKEN_ID),
            audio_start_token_id=thinker.get("audio_start_token_id", AUDIO_START_TOKEN_ID),
            audio_end_token_id=thinker.get("audio_end_token_id", AUDIO_END_TOKEN_ID),
            tie_word_embeddings=bool(tie),
        )

    @classmethod
    def tiny(cls) -> "Qwen3ASRConfig":
        """A few-MB random model with the real token ids, for tests. head_dim 16 -> mrope [4, 2, 2]."""
        return cls(
            audio=AudioEncoderConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4,
                                     encoder_ffn_dim=128, output_dim=64, downsample_hidden_size=32),
            text=TextDecoderConfig(vocab_size=151936, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, rope_scaling={"mrope_section": [4, 2, 2],
                                                              "interleaved": True, "rope_type": "default"}),
        )


def _pick(cls, d: dict[str, Any]):
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})
