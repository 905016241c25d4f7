"""The Qwen3 text decoder of Qwen3-ASR, with batched prefill/decode over a shared `KVCache`.

Stock Qwen3: GQA attention with per-head q/k RMSNorm before RoPE, SwiGLU MLP, pre-norm residual
blocks, final RMSNorm, output head (tied to the embeddings in the released checkpoints).

The official "interleaved MRoPE" gets the same position on all three rows for audio-only prompts,
so it is plain 1-D RoPE over positions 0..L-1 (tests check this against the official model).
RoPE angles are computed in float32 and RMSNorm runs in float32, as in the official code (which
does so even in float64), so every dtype rounds like the reference.

Layout: the model runs on packed tokens ([N, hidden], no padding) and only attention sees a padded
[B, max_new, ...] view of the queries, against each slot's keys in the cache. `prefill`,
`decode_step` and `greedy_decode` are plain functions over (decoder, cache) so a scheduler can
batch any set of slots on every tick.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import TextDecoderConfig
from .kv_cache import BatchLayout, KVCache, plan_batch


# --- numerics: small pure functions ---------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D] -> [..., D]. Normalises in float32 and scales in x's dtype, exactly as the official
    code does (even for float64 input), so every dtype rounds like the reference."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, computed exactly as transformers' default RoPE."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta ** exponent)


def precompute_rope(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [*] int -> (cos, sin): [*, head_dim] float32, angles in float32 like the reference."""
    freqs = positions.float()[..., None] * inv_freq  # [*, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [*, D]: rotate_half pairs i with i + D/2
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [*, H, D]; cos, sin: [*, D] -> [*, H, D] (rotate-half convention)."""
    cos = cos.to(x.dtype)[..., None, :]  # [*, 1, D]
    sin = sin.to(x.dtype)[..., None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q: [B, Hq, S, D]; k, v: [B, Hkv, L, D]; mask: [B, 1, S, L] bool (True = attend) -> [B, Hq, S, D].

    Query heads h*G..h*G+G-1 share kv head h. Folding the G query heads of a group into the query
    length lets SDPA read each kv head once instead of materialising G copies of the cache.
    """
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    q = q.reshape(B, Hkv, G * S, D)  # rows ordered (g, s)
    if G > 1:
        mask = mask.repeat(1, 1, G, 1)  # [B, 1, G*S, L], same (g, s) order
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, Hkv, G*S, D]
    return out.reshape(B, Hq, S, D)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


# --- modules (names follow the official `thinker.model.*` weights) ---------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: TextDecoderConfig):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads} query heads do not split into {self.n_kv_heads} kv groups")
        hd, bias = config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [*, hidden] -> q: [*, Hq, D], k, v: [*, Hkv, D]; q/k normed per head, then RoPE'd."""
        lead = x.shape[:-1]
        q = self.q_norm(self.q_proj(x).view(*lead, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(*lead, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).view(*lead, self.n_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward_causal(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """No cache. x: [B, S, hidden]; cos, sin: [B, S, D] -> [B, S, hidden]."""
        B, S, _ = x.shape
        q, k, v = self.project(x, cos, sin)  # [B, S, H, D]
        mask = torch.ones(S, S, dtype=torch.bool, device=x.device).tril().expand(B, 1, S, S)
        out = gqa_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: BatchLayout,
                       k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """x: [N, hidden] packed new tokens; cos, sin: [N, D]; k_cache, v_cache: one layer's
        storage [slots, Hkv, max_len, D], written in place at (slot, pos) -> [N, hidden]."""
        q, k, v = self.project(x, cos, sin)  # [N, H, D]
        # index_put_ with index tensors: static shapes, no host sync (capture-friendly)
        k_cache[layout.slot, :, layout.pos] = k
        v_cache[layout.slot, :, layout.pos] = v

        R, S, L = layout.rows, layout.max_new, layout.kv_len
        if layout.slot_range is not None:  # a view, no copy
            keys = k_cache[layout.slot_range[0]:layout.slot_range[1], :, :L]  # [R, Hkv, L, D]
            values = v_cache[layout.slot_range[0]:layout.slot_range[1], :, :L]
        else:
            keys = k_cache[layout.slots, :, :L]
            values = v_cache[layout.slots, :, :L]
        if layout.dense:
            q_pad = q.view(R, S, self.n_heads, self.head_dim)
        else:
            q_pad = q.new_zeros(R, S, self.n_heads, self.head_dim)
            q_pad[layout.row, layout.col] = q
        out = gqa_attention(q_pad.transpose(1, 2), keys, values, layout.mask)  # [R, Hq, S, D]
        out = out.transpose(1, 2)  # [R, S, Hq, D]
        out = out.reshape(R * S, -1) if layout.dense else out[layout.row, layout.col].reshape(x.shape[0], -1)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, config: TextDecoderConfig):
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}")
        self.act = _ACTIVATIONS[config.hidden_act]
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: TextDecoderConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, layout: BatchLayout | None = None, k_cache=None, v_cache=None):
        """x: [B, S, hidden] without a layout (no cache), or [N, hidden] packed with one."""
        h = self.input_layernorm(x)
        if layout is None:
            x = x + self.self_attn.forward_causal(h, cos, sin)
        else:
            x = x + self.self_attn.forward_cached(h, cos, sin, layout, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    def __init__(self, config: TextDecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class OutputHead(nn.Linear):
    """The output projection (`lm_head.weight`, [vocab, hidden], no bias), which on a CPU skips the
    rows that are exactly zero.

    A model trained on a part of the vocabulary (synth-en: 1,714 of 151,936 rows; the rest were
    never touched and ship as zeros) spends most of each decode step reading zero rows: at hidden 256
    the full head is 155 MB of fp32 per token, half of a stream's CPU time. Their logits are exactly
    0 whatever the input, so the head computes the live rows alone and writes them into zeros: the
    same logits, softmax and argmax as the full product (each live row is the same dot product; the
    BLAS may block it differently, so a logit can differ in its last bit). Used where at least half
    the rows are zero and nothing needs gradients; the live rows are found once per weight version
    (a `load_state_dict` or in-place edit makes a new one). On CUDA the full product is one fast GEMM
    and CUDA-graph capture must not meet a host sync, so it stays dense there."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self._live: tuple[tuple, torch.Tensor | None, torch.Tensor | None] | None = None

    def live_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(row indices, their weights) when the sparse path applies, else None."""
        w = self.weight
        if w.device.type != "cpu" or (torch.is_grad_enabled() and w.requires_grad):
            return None
        key = (w.data_ptr(), w._version, w.dtype, tuple(w.shape))
        if self._live is None or self._live[0] != key:
            with torch.no_grad():
                found = torch.nonzero(w.ne(0).any(dim=1)).flatten()
            sparse = found.numel() <= w.shape[0] // 2
            self._live = (key, found if sparse else None, w.detach()[found].contiguous() if sparse else None)
        _, rows, weight = self._live
        return None if rows is None or weight is None else (rows, weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        live = self.live_rows()
        if live is None:
            return F.linear(x, self.weight)
        rows, weight = live
        out = x.new_zeros(*x.shape[:-1], self.out_features)
        out[..., rows] = F.linear(x, weight)
        return out


class Qwen3Decoder(nn.Module):
    """Qwen3 causal LM: `model.*` (embeddings, layers, final norm) and `lm_head`.

    Parameter names equal the official checkpoint's `thinker.model.*` / `thinker.lm_head.*` with
    `thinker.` stripped. Use `prefill` / `decode_step` / `greedy_decode` with a `KVCache` for
    incremental decoding; `forward` is the cache-free full-sequence pass.
    """

    def __init__(self, config: TextDecoderConfig, tie_word_embeddings: bool | None = None):
        super().__init__()
        scaling = config.rope_scaling or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))  # mrope_section: see above
        if rope_type != "default":
            raise NotImplementedError(f"rope_type {rope_type!r}: only the default RoPE is implemented")
        self.config = config
        self.tied = config.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
        self.model = TextModel(config)
        self.lm_head: nn.Linear = OutputHead(config.hidden_size, config.vocab_size)
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: [*] -> [*, hidden]. Write audio embeddings over the `<|audio_pad|>` rows."""
        return self.model.embed_tokens(token_ids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [*] -> cos, sin: [*, head_dim] float32. Computed per call (a few kernels) rather
        than kept as a buffer, which `module.to(bfloat16)` would round."""
        inv_freq = rope_inv_freq(self.config.head_dim, self.config.rope_theta, positions.device)
        return precompute_rope(positions, inv_freq)

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """Cache-free causal pass at positions 0..S-1. inputs_embeds: [B, S, hidden] -> [B, S, vocab]."""
        B, S, _ = inputs_embeds.shape
        x = inputs_embeds.to(device=self.device, dtype=self.dtype)
        cos, sin = self.rope(torch.arange(S, device=x.device).expand(B, S))  # [B, S, D]
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def forward_packed(self, x: torch.Tensor, layout: BatchLayout, cache: KVCache) -> torch.Tensor:
        """x: [N, hidden] packed new tokens placed by `layout` -> final-normed hidden [N, hidden];
        writes every layer's keys/values into `cache`."""
        cos, sin = self.rope(layout.pos)  # [N, D]
        x = x.to(device=self.device, dtype=self.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, layout, cache.k[i], cache.v[i])
        return self.model.norm(x)

    def check_cache(self, cache: KVCache) -> None:
        """Raise ValueError unless `cache` fits this decoder (shape, dtype, device)."""
        c = self.config
        want = (c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.dtype, self.device)
        got = (cache.k.shape[0], cache.k.shape[2], cache.k.shape[4], cache.dtype, cache.device)
        if want != got:
            raise ValueError(f"KV cache (layers, kv heads, head_dim, dtype, device) {got}, "
                             f"decoder needs {want}")

    def load_official_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the checkpoint's `thinker.model.*` and `thinker.lm_head.*` tensors, `thinker.` stripped.

        Strict: a missing, unexpected or mis-shaped tensor raises ValueError. With tied embeddings the
        head is the embedding matrix and a stored `lm_head.weight` is ignored (as transformers does);
        untied, `lm_head.weight` is required.
        """
        sd = dict(state_dict)
        if self.tied:
            sd.pop("lm_head.weight", None)
        own = self.state_dict()
        expected = set(own) - ({"lm_head.weight"} if self.tied else set())
        missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
        if missing or unexpected:
            more = lambda names: "..." if len(names) > 8 else ""  # noqa: E731
            raise ValueError(f"decoder state dict mismatch: missing {missing[:8]}{more(missing)}, "
                             f"unexpected {unexpected[:8]}{more(unexpected)}")
        for name, t in sd.items():
            if tuple(t.shape) != tuple(own[name].shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)}, model {tuple(own[name].shape)}")
        with torch.no_grad():
            for name, t in sd.items():
                own[name].copy_(t)


# --- batched incremental decoding over a KVCache ---------------------------------------------------

@torch.no_grad()
def prefill(decoder: Qwen3Decoder, cache: KVCache, slots: list[int], embeds: list[torch.Tensor],
            kv_len: int | None = None, tails: list[int] | None = None) -> torch.Tensor:
    """Append `embeds[i]` ([S_i, hidden]) to slot `slots[i]`, at positions length(slot).., all
    sequences in one batch. Returns the logits of each sequence's last new token, [B, vocab]; with
    `tails`, those of sequence i's last `tails[i]` new positions (1 <= tails[i] <= S_i), sequence
    after sequence, [sum(tails), vocab] (what verifying drafted tokens needs).

    Prefill after a kept prefix (e.g. after `cache.truncate`) is just this append.
    """
    if len(slots) != len(embeds) or not slots:
        raise ValueError(f"{len(slots)} slots for {len(embeds)} sequences")
    counts = [e.shape[0] for e in embeds]
    tails = [1] * len(counts) if tails is None else tails
    if len(tails) != len(counts) or any(not 1 <= t <= c for t, c in zip(tails, counts)):
        raise ValueError(f"tails {tails} for sequences of {counts} positions")
    decoder.check_cache(cache)
    layout = plan_batch(cache, slots, counts, kv_len)
    h = decoder.forward_packed(torch.cat(embeds), layout, cache)  # [N, hidden]
    ends = 0
    rows: list[int] = []
    for c, t in zip(counts, tails):
        ends += c
        rows.extend(range(ends - t, ends))
    return decoder.lm_head(h[torch.tensor(rows, device=h.device)])


@torch.no_grad()
def decode_step(decoder: Qwen3Decoder, cache: KVCache, slots: list[int], token_ids: torch.Tensor,
                kv_len: int | None = None) -> torch.Tensor:
    """Feed one token per slot (token_ids: [B]), each at its own slot's next position -> [B, vocab].

    Any set of allocated slots can be batched on any call, so new sessions join between steps.
    `kv_len=cache.max_len` gives shapes that depend on the batch size only (for graph capture).
    """
    if token_ids.shape != (len(slots),):
        raise ValueError(f"token_ids shape {tuple(token_ids.shape)} for {len(slots)} slots")
    decoder.check_cache(cache)
    layout = plan_batch(cache, slots, [1] * len(slots), kv_len)
    return decoder.lm_head(decoder.forward_packed(decoder.embed(token_ids.to(decoder.device)), layout, cache))


@torch.no_grad()
def greedy_decode(decoder: Qwen3Decoder, cache: KVCache, slots: list[int], first_logits: torch.Tensor,
                  max_new_tokens: int, eos_ids: set[int] | list[int] | tuple[int, ...],
                  loop_cut: Callable[[list[int]], int | None] | None = None) -> list[list[int]]:
    """Greedy continuation of each slot, decode steps batched across the slots still running.

    first_logits: [B, vocab], the logits `prefill` returned. Returns the new tokens of each slot; a
    list ends with its EOS token when one was produced. The last returned token is not fed back, so
    afterwards a slot caches its prompt plus all returned tokens but the last. `loop_cut(tokens)`
    (the loop guard, `DecodeLimits.loop_cut`): a slot whose tokens it cuts stops there.
    """
    eos = set(eos_ids)
    out: list[list[int]] = [[] for _ in slots]
    if max_new_tokens <= 0:
        return out
    active = list(range(len(slots)))  # indices into `slots` still decoding
    tokens = first_logits.argmax(-1).tolist()  # one host read per step: needed to drop finished slots
    while True:
        still = []
        for i, t in zip(active, tokens):
            out[i].append(t)
            cut = loop_cut(out[i]) if loop_cut is not None and t not in eos else None
            if cut is not None:
                del out[i][cut:]
            elif t not in eos and len(out[i]) < max_new_tokens:
                still.append(i)
        active = still
        if not active:
            return out
        feed = torch.tensor([out[i][-1] for i in active], device=decoder.device)
        logits = decode_step(decoder, cache, [slots[i] for i in active], feed)
        tokens = logits.argmax(-1).tolist()
