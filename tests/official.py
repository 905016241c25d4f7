"""The official Qwen3-ASR reference (qwen-asr 0.0.6 on transformers), built tiny and random at test time.

Functions only, no side effects at import: model tests import what they need.
"""

from __future__ import annotations

import torch

TINY_AUDIO = dict(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                  output_dim=64, downsample_hidden_size=32, n_window=50, n_window_infer=800)
TINY_TEXT = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 rope_scaling={"mrope_section": [4, 2, 2], "interleaved": True, "rope_type": "default"},
                 tie_word_embeddings=True)


def official_config(audio: dict | None = None, text: dict | None = None):
    """The official `Qwen3ASRConfig` for the tiny model; `audio`/`text` override single fields."""
    from qwen_asr.core.transformers_backend import Qwen3ASRConfig as OfficialConfig

    return OfficialConfig(thinker_config=dict(
        audio_config={**TINY_AUDIO, **(audio or {})}, text_config={**TINY_TEXT, **(text or {})},
        audio_token_id=151676, audio_start_token_id=151669, audio_end_token_id=151670))


def randomize_parameters_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Overwrite every parameter with seeded noise of unit-ish output scale.

    The official init leaves biases at 0 and norms at 1 with std-0.02 weights, so activations are tiny
    and a wrong bias or norm would go unnoticed; this makes every parameter matter.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if p.dim() >= 2:  # weights: std 1/sqrt(fan_in) keeps activations O(1)
                noise = noise / (p[0].numel() ** 0.5)
            elif name.endswith("norm.weight") or name.endswith("ln_post.weight"):
                noise = 1.0 + 0.1 * noise
            else:
                noise = 0.1 * noise
            p.copy_(noise.to(p.dtype))
    return module


def official_model(seed: int = 0, audio: dict | None = None, text: dict | None = None,
                   randomize: bool = True):
    """A tiny official `Qwen3ASRForConditionalGeneration` in eval mode, fp32, seeded."""
    from qwen_asr.core.transformers_backend.modeling_qwen3_asr import Qwen3ASRForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3ASRForConditionalGeneration(official_config(audio, text)).eval()
    if randomize:
        randomize_parameters_(model, seed)
    return model


def official_audio_tower(seed: int = 0, audio: dict | None = None, randomize: bool = True):
    """Only the official audio tower (`Qwen3ASRAudioEncoder`), eval mode, fp32, seeded: quicker to
    build than the whole model when the decoder is not needed."""
    from qwen_asr.core.transformers_backend.modeling_qwen3_asr import Qwen3ASRAudioEncoder

    torch.manual_seed(seed)
    tower = Qwen3ASRAudioEncoder(official_config(audio).thinker_config.audio_config).eval()
    if randomize:
        randomize_parameters_(tower, seed)
    return tower


def audio_tower_state_dict(model) -> dict[str, torch.Tensor]:
    """The official audio tower's weights with the `thinker.audio_tower.` prefix stripped."""
    prefix = "thinker.audio_tower."
    return {k[len(prefix):]: v for k, v in model.state_dict().items() if k.startswith(prefix)}


WINDOWED_ATTENTION = "harken_windowed_sdpa"


def use_windowed_attention(model):
    """Make the official audio tower attend only inside its 8-s windows (`cu_seqlens`).

    Its flash-attention-2 path and the package's vLLM backend window the attention; its sdpa and
    eager paths (the CPU reference) pass no mask and attend across the whole item, although it
    builds the windows and has the mask builder (`_prepare_attention_mask`, never called). This
    registers an attention function that applies that builder's mask, then runs the stock sdpa one.
    `model` is the whole official model or just its audio tower; returns it.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    tower = model.thinker.audio_tower if hasattr(model, "thinker") else model

    def windowed(module, query, key, value, attention_mask, cu_seq_lens_q=None, **kwargs):
        # query: [1, H, S, hd] (the tower packs an item's tokens into one sequence)
        if attention_mask is None and cu_seq_lens_q is not None:
            attention_mask = tower._prepare_attention_mask(query[0, 0], cu_seq_lens_q)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(WINDOWED_ATTENTION, windowed)
    tower.config._attn_implementation = WINDOWED_ATTENTION
    return model


EOS = (151645, 151643)  # <|im_end|>, <|endoftext|>


def official_generate(off, wav, language: str | None, context: str, max_new_tokens: int):
    """The official transformers-backend path of `transcribe()` for one item (`off` a
    Qwen3ASRModel, `wav` 16 kHz float32), keeping the ids: (prompt ids, generated ids without the
    final EOS)."""
    from harken.cloud.model.prompt import forced_language

    text = off._build_text_prompt(context=context, force_language=forced_language(language))
    inputs = off.processor(text=[text], audio=[wav], return_tensors="pt", padding=True)
    inputs = inputs.to(off.model.device).to(off.model.dtype)
    seq = off.model.generate(**inputs, max_new_tokens=max_new_tokens).sequences[0]
    prompt = inputs["input_ids"][0].tolist()
    new = seq[len(prompt):].tolist()
    if new and new[-1] in EOS:
        new = new[:-1]
    return prompt, new
