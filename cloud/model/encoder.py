"""Qwen3-ASR audio encoder: full, batched over attention windows, and incremental per session.

The official encoder (qwen-asr 0.0.6, `Qwen3ASRAudioEncoder`) runs a conv stem on each 1-s chunk of
log-mel (100 frames -> 13 tokens, positions 0..12 restarting per chunk), then transformer layers whose
attention is confined to windows of `chunks_per_window` chunks (8 s, 104 tokens) counted from the
start of the audio item, then a projector. Nothing crosses a window boundary, so a window's outputs
depend only on its own features (and on whether it is the first window of its item, see
`encode_windows`). This module therefore encodes *windows*, batched across items and sessions:
a whole item is its windows concatenated, and a streaming session caches its completed windows and
recomputes only the active one (`IncrementalEncoder`).
"""

from __future__ import annotations

import math
from itertools import accumulate
from dataclasses import dataclass
from typing import Callable, Literal, Sequence, overload

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import AudioEncoderConfig
from ...shared.errors import ModelError

def as_features(features: np.ndarray | Tensor, mel: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """[mel, T] normalised log-mel (numpy or torch) -> a tensor on `device` in `dtype`; anything
    else is a ModelError."""
    x = torch.as_tensor(np.asarray(features)) if isinstance(features, np.ndarray) else features
    if x.dim() != 2 or x.shape[0] != mel or x.shape[1] == 0:
        raise ModelError(f"features must be [{mel}, T] with T > 0, got {list(x.shape)}")
    return x.to(device=device, dtype=dtype)


# --- token counts and window bookkeeping (pure, host-side ints) ---------------------------------


def conv_out_length(frames: int) -> int:
    """Time length after the three stride-2 convs (k3, p1) for `frames` input frames (0 -> 0)."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1
    return frames


def num_audio_tokens(frames: int, chunk_frames: int = 100) -> int:
    """Encoder tokens (= `<|audio_pad|>` tokens) for an item of `frames` feature frames.

    13 per full 1-s chunk plus the conv length of the tail chunk: QWEN3_ASR.md's formula, which is
    the official `_get_feat_extract_output_lengths` with its hard-coded 100 as `chunk_frames`.
    """
    full, tail = divmod(frames, chunk_frames)
    return full * conv_out_length(chunk_frames) + conv_out_length(tail)


def window_spans(frames: int, window_frames: int) -> list[tuple[int, int]]:
    """[start, end) frame spans of the attention windows of an item of `frames` frames.

    Windows are counted from the item's first frame; only the last may be shorter.
    """
    return [(s, min(s + window_frames, frames)) for s in range(0, frames, window_frames)]


def sinusoid_positions(length: int, channels: int, max_timescale: float = 10000.0) -> Tensor:
    """Whisper-style sinusoid table [length, channels] = [sin | cos], computed in float32.

    Same ops in the same dtype as the official `SinusoidsPositionEmbedding`, so the table (and its
    cast to the model dtype) is bit-identical to the reference.
    """
    if channels % 2 != 0:
        raise ValueError(f"sinusoid positions need an even channel count, got {channels}")
    log_timescale_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2).float())
    scaled_time = torch.arange(length)[:, None] * inv_timescales[None, :]  # [length, channels/2]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


def _quick_gelu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(1.702 * x)


# The transformers ACT2FN names the released configs can use, as plain torch functions.
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "quick_gelu": _quick_gelu,
}


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """The activation function a config's `activation_function` names."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation_function {name!r}; known: {sorted(ACTIVATIONS)}") from None


# --- the model ------------------------------------------------------------------------------------


class EncoderAttention(nn.Module):
    """Bidirectional multi-head self-attention with biases (official `Qwen3ASRAudioAttention`)."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        if d_model % num_heads != 0:
            raise ValueError(f"d_model {d_model} is not divisible by encoder_attention_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.q_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor, key_mask: Tensor | None) -> Tensor:
        # x: [B, N, d]; key_mask: [B, 1, 1, N] bool (True = a real token) or None when nothing is padded
        b, n, d = x.shape
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, N, hd]
        k = self.k_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class EncoderLayer(nn.Module):
    """Pre-LN transformer layer (official `Qwen3ASRAudioEncoderLayer`, eval mode)."""

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.self_attn = EncoderAttention(cfg.d_model, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.act = activation(cfg.activation_function)

    def forward(self, x: Tensor, key_mask: Tensor | None) -> Tensor:
        # x: [B, N, d]
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_mask)
        x = x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:
            # the reference clamps here so fp16 overflow saturates instead of turning into inf/nan
            limit = torch.finfo(torch.float16).max - 1000
            x = x.clamp(min=-limit, max=limit)
        return x


@dataclass(frozen=True)
class WindowBatch:
    """Host-side layout of a padded batch of windows: built from shapes only, so it costs no device sync."""

    chunk_counts: list[int]  # chunks per window
    tokens: list[int]  # valid tokens per window
    token_index: Tensor  # [B, N] long: row of the flattened [C * tokens_per_chunk] conv output per token
    key_mask: Tensor | None  # [B, 1, 1, N] bool, True = real token; None when no window is padded
    short_lengths: Tensor | None  # [C] valid frames per chunk when some window is a whole sub-chunk item


def window_batch(lengths: Sequence[int], item_start: Sequence[bool], chunk_frames: int,
                 tokens_per_chunk: int) -> WindowBatch:
    """Lay out windows of `lengths` frames as a padded batch (see `AudioEncoder.encode_windows`)."""
    counts = [-(-t // chunk_frames) for t in lengths]
    tokens = [num_audio_tokens(t, chunk_frames) for t in lengths]
    n_max = max(tokens)
    # a window's tokens are its chunks' tokens in order (only its last chunk can be partial), so
    # token j of a window starting at chunk c0 is row c0 * tokens_per_chunk + j; padding reads row 0
    first_chunk = torch.tensor([0] + counts[:-1]).cumsum(0)  # [B]
    n = torch.tensor(tokens)  # [B]
    j = torch.arange(n_max)  # [N]
    real = j[None, :] < n[:, None]  # [B, N]
    token_index = torch.where(real, first_chunk[:, None] * tokens_per_chunk + j[None, :], 0)
    key_mask = None if all(t == n_max for t in tokens) else real[:, None, None, :]
    short_lengths = None
    if any(s and t < chunk_frames for t, s in zip(lengths, item_start)):
        short_lengths = torch.tensor([t if s and t < chunk_frames else chunk_frames
                                      for t, k, s in zip(lengths, counts, item_start) for _ in range(k)])
    return WindowBatch(counts, tokens, token_index, key_mask, short_lengths)


class AudioEncoder(nn.Module):
    """The Qwen3-ASR audio tower. `state_dict()` keys are the official `thinker.audio_tower.*` keys
    with that prefix stripped, so a checkpoint loads with `load_state_dict(stripped, strict=True)`.

    `scale_embedding` is read by the official code but never applied in its forward; it is ignored
    here too. Dropout fields are training-only and not modelled.
    """

    positions: Tensor  # a buffer, declared for the type checker

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        if cfg.chunks_per_window < 1:
            raise ValueError(f"n_window_infer {cfg.n_window_infer} is shorter than one chunk ({cfg.chunk_frames})")
        self.cfg = cfg
        hidden = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, hidden, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv_out = nn.Linear(hidden * conv_out_length(cfg.num_mel_bins), cfg.d_model, bias=False)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)
        self.act = activation(cfg.activation_function)
        # float32 like the reference's buffer; cast to the activations' dtype where it is added
        self.register_buffer("positions", sinusoid_positions(cfg.max_source_positions, cfg.d_model),
                             persistent=False)
        self.tokens_per_chunk = conv_out_length(cfg.chunk_frames)
        # a window holds whole chunks; the reference counts windows in tokens (13 per chunk)
        self.window_frames = cfg.chunks_per_window * cfg.chunk_frames
        self.window_tokens = cfg.chunks_per_window * self.tokens_per_chunk
        # chunks run through `conv_stem` so far (a plain counter, for tests and profiling)
        self.stem_chunks = 0

    def num_tokens(self, frames: int) -> int:
        """Encoder tokens for an item of `frames` feature frames."""
        return num_audio_tokens(frames, self.cfg.chunk_frames)

    # -- stages --

    def conv_stem(self, chunks: Tensor, short_lengths: Tensor | None) -> Tensor:
        """Per-chunk conv stem + input projection + positions.

        chunks: [C, mel, chunk_frames], zero-padded tails. short_lengths: [C] valid frames per chunk
        or None. The reference pads a tail chunk to the longest chunk of its item — 100 frames,
        unless the item is shorter than one chunk and so runs unpadded. Zeroing each conv output
        beyond the valid length reproduces an unpadded conv exactly (its padding reads zeros there);
        `short_lengths` gives the full chunk length for every chunk that is not such an item.
        Returns [C, tokens_per_chunk, d_model].
        """
        self.stem_chunks += int(chunks.shape[0])
        pieces = []
        for c0 in range(0, chunks.shape[0], self.cfg.conv_chunksize):  # bounds conv memory, as the reference does
            x = chunks[c0:c0 + self.cfg.conv_chunksize].unsqueeze(1)  # [c, 1, mel, t]
            lengths = short_lengths[c0:c0 + self.cfg.conv_chunksize] if short_lengths is not None else None
            for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
                # the reference hard-codes F.gelu here, whatever activation_function says
                x = F.gelu(conv(x))  # [c, ch, f, t] with f, t halved (rounding up)
                if lengths is not None:
                    lengths = (lengths - 1) // 2 + 1
                    keep = torch.arange(x.shape[-1], device=x.device) < lengths[:, None]  # [c, t]
                    x = x * keep[:, None, None, :].to(x.dtype)
            pieces.append(x)
        x = torch.cat(pieces)  # [C, ch, f, t]
        c, ch, f, t = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(c, t, ch * f))  # [C, t, d]
        return x + self.positions[:t].to(x.dtype)

    def transformer(self, x: Tensor, key_mask: Tensor | None) -> Tensor:
        """Layers + projector. x: [B, N, d_model] -> [B, N, output_dim]."""
        for layer in self.layers:
            x = layer(x, key_mask)
        return self.proj2(self.act(self.proj1(self.ln_post(x))))

    # -- public API --

    @overload
    def encode_windows(self, windows: Sequence[Tensor], item_start: Sequence[bool],
                       stems: Sequence[Tensor | None] | None = None, *,
                       return_stems: Literal[False] = False) -> list[Tensor]: ...

    @overload
    def encode_windows(self, windows: Sequence[Tensor], item_start: Sequence[bool],
                       stems: Sequence[Tensor | None] | None = None, *,
                       return_stems: Literal[True]) -> tuple[list[Tensor], list[Tensor]]: ...

    def encode_windows(self, windows: Sequence[Tensor], item_start: Sequence[bool],
                       stems: Sequence[Tensor | None] | None = None, *,
                       return_stems: bool = False) -> list[Tensor] | tuple[list[Tensor], list[Tensor]]:
        """Encode attention windows from any items/sessions as one padded batch.

        windows[i]: [mel, t_i] features of ONE attention window, 1 <= t_i <= window_frames, starting
        at a window boundary of its item. item_start[i]: whether it is its item's first window —
        it matters only for a window shorter than one chunk, which the reference then encodes
        unpadded (a whole item under 1 s) instead of zero-padding its tail chunk to 1 s.
        stems[i] (optional): `conv_stem` outputs [k_i, tokens_per_chunk, d_model] already computed
        for the window's first k_i chunks, which must be COMPLETE chunks of these same features
        (k_i * chunk_frames <= t_i); only the window's other chunks go through the conv stem. A
        complete chunk's stem output depends on its own frames only, so this changes nothing.
        Returns [num_tokens(t_i), output_dim] per window, in the parameters' dtype and device; with
        `return_stems`, also each window's stem outputs of all its complete chunks
        ([t_i // chunk_frames, tokens_per_chunk, d_model]) for the caller to pass back later.
        """
        if len(windows) != len(item_start):
            raise ValueError(f"{len(windows)} windows but {len(item_start)} item_start flags")
        if stems is None:
            stems = [None] * len(windows)
        elif len(stems) != len(windows):
            raise ValueError(f"{len(windows)} windows but {len(stems)} stems")
        if not windows:
            return ([], []) if return_stems else []
        p = self.conv_out.weight
        cf = self.cfg.chunk_frames
        lengths = [int(w.shape[-1]) for w in windows]
        for w, t in zip(windows, lengths):
            if w.dim() != 2 or w.shape[0] != self.cfg.num_mel_bins or not 1 <= t <= self.window_frames:
                raise ValueError(f"a window must be [{self.cfg.num_mel_bins}, 1..{self.window_frames}], "
                                 f"got {list(w.shape)}")
        cached = [0 if st is None else int(st.shape[0]) for st in stems]
        for st, k, t in zip(stems, cached, lengths):
            if st is not None and (k * cf > t or tuple(st.shape[1:]) != (self.tokens_per_chunk, self.cfg.d_model)):
                raise ValueError(f"stems must be [k, {self.tokens_per_chunk}, {self.cfg.d_model}] of complete "
                                 f"chunks, got {list(st.shape)} for a window of {t} frames")
        lay = window_batch(lengths, item_start, cf, self.tokens_per_chunk)

        def to_device(t: Tensor | None) -> Tensor | None:
            # host-built index/mask tensors: an async copy, no wait for queued device work
            return None if t is None else t.to(p.device, non_blocking=True)

        # chunks of every window not covered by its stems, tails zero-padded to chunk_frames:
        # [C_new, mel, cf]; built where the features are, then moved once
        new = [F.pad(w[:, k0 * cf:], (0, k * cf - t)).reshape(self.cfg.num_mel_bins, k - k0, cf).transpose(0, 1)
               for w, t, k, k0 in zip(windows, lengths, lay.chunk_counts, cached) if k > k0]
        fresh = None
        if new:
            chunks = torch.cat(new).to(device=p.device, dtype=p.dtype, non_blocking=True)
            short = lay.short_lengths
            if short is not None and any(cached):
                # a cached chunk is a complete chunk: never one of the short ones
                keep = torch.cat([torch.arange(k) >= k0 for k, k0 in zip(lay.chunk_counts, cached)])
                short = short[keep]
            fresh = self.conv_stem(chunks, to_device(short))  # [C_new, tokens_per_chunk, d]
        if any(cached):
            parts, c = [], 0
            for st, k, k0 in zip(stems, lay.chunk_counts, cached):
                if st is not None and k0:
                    parts.append(st.to(device=p.device, dtype=p.dtype))
                if k > k0:
                    assert fresh is not None  # the chunks not cached went through the stem
                    parts.append(fresh[c:c + k - k0])
                    c += k - k0
            embeds = torch.cat(parts)  # [C, tokens_per_chunk, d]
        else:
            assert fresh is not None  # nothing was cached: every chunk went through the stem
            embeds = fresh
        x = embeds.reshape(-1, embeds.shape[-1])[to_device(lay.token_index)]  # [B, N, d]
        out = self.transformer(x, to_device(lay.key_mask))  # [B, N, out]
        outs = [o[:n] for o, n in zip(out, lay.tokens)]
        if not return_stems:
            return outs
        first = [0] + list(accumulate(lay.chunk_counts))
        # copies, so a caller keeping one does not keep the whole batch's embeddings alive
        window_stems = [embeds[c0:c0 + t // cf].clone() for c0, t in zip(first, lengths)]
        return outs, window_stems

    def encode_items(self, items: Sequence[Tensor]) -> list[Tensor]:
        """Encode whole audio items ([mel, T_i] each) in one batch of all their windows.

        Returns [num_tokens(T_i), output_dim] per item (an empty item gives [0, output_dim]).
        """
        windows, starts, counts = [], [], []
        for feats in items:
            spans = window_spans(int(feats.shape[-1]), self.window_frames)
            windows += [feats[:, s:e] for s, e in spans]
            starts += [s == 0 for s, _ in spans]
            counts.append(len(spans))
        outs = self.encode_windows(windows, starts)
        empty = self.proj2.weight.new_zeros(0, self.cfg.output_dim)
        result, i = [], 0
        for k in counts:
            result.append(torch.cat(outs[i:i + k]) if k else empty)
            i += k
        return result

    def forward(self, features: Tensor) -> Tensor:
        """Encode one audio item: features [mel, T] -> [num_tokens(T), output_dim]."""
        return self.encode_items([features])[0]


# --- streaming ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WindowRequest:
    """A window of one session that needs encoding (see `IncrementalEncoder.pending_windows`)."""

    index: int  # window number within the item
    start_frame: int
    features: Tensor  # [mel, t], t <= window_frames
    complete: bool  # t == window_frames: its outputs are final and get cached
    # conv-stem outputs [k, tokens_per_chunk, d_model] of the window's first k complete chunks,
    # computed by an earlier pass (pass as `encode_windows(..., stems=...)`), or None
    stem: Tensor | None = None

    @property
    def item_start(self) -> bool:
        return self.index == 0

    @property
    def end_frame(self) -> int:
        return self.start_frame + int(self.features.shape[-1])


class IncrementalEncoder:
    """Encoder state of one streaming audio item (one session segment).

    Feature frames are appended as they arrive. Completed windows are encoded once and cached
    (their features dropped); only the active, incomplete window is recomputed when it has grown,
    and of it only the transformer: the conv-stem outputs of its complete 1-s chunks are cached
    (they depend on those chunks' frames alone) until the window is complete and committed. The
    partial tail chunk always goes through the stem again.

    Two ways to drive it, sharing the same code:
    - simple: `append(frames)` then `outputs()` (encodes whatever is pending, this session alone);
    - scheduler: `pending_windows()` of many sessions -> one `AudioEncoder.encode_windows(features,
      item_starts, stems=[r.stem ...], return_stems=True)` batch -> `commit(request, output, stem)`
      per request -> `outputs()` (nothing left to encode).
    """

    def __init__(self, encoder: AudioEncoder):
        self.encoder = encoder
        self.window_frames = encoder.window_frames
        self._frames = 0  # frames appended so far
        self._buffer_start = 0  # item frame index of _buffer[:, 0]; a window boundary
        self._buffer: Tensor | None = None  # [mel, b]: features of windows not yet committed (active + completed-pending)
        self._completed: list[Tensor] = []  # outputs of committed complete windows
        self._active: Tensor | None = None  # output of the active window ...
        self._active_frames = 0  # ... computed from the item's first _active_frames frames
        self._stems: dict[int, Tensor] = {}  # window index -> conv-stem outputs of its leading complete chunks

    @property
    def frames(self) -> int:
        """Feature frames appended so far."""
        return self._frames

    @property
    def buffered_frames(self) -> int:
        """Feature frames still held: the active window's, plus completed windows not yet committed."""
        return 0 if self._buffer is None else int(self._buffer.shape[1])

    @property
    def completed_tokens(self) -> int:
        """Tokens of the committed complete windows; these outputs never change."""
        return len(self._completed) * self.encoder.window_tokens

    @property
    def completed_outputs(self) -> list[Tensor]:
        """Outputs of the committed complete windows, [window_tokens, output_dim] each."""
        return list(self._completed)

    def append(self, frames: Tensor) -> None:
        """Append feature frames [mel, k] (k may be 0). Nothing is encoded until asked."""
        if frames.dim() != 2 or frames.shape[0] != self.encoder.cfg.num_mel_bins:
            raise ValueError(f"frames must be [{self.encoder.cfg.num_mel_bins}, k], got {list(frames.shape)}")
        if frames.shape[1] == 0:
            return
        self._buffer = frames if self._buffer is None else torch.cat([self._buffer, frames], dim=1)
        self._frames += int(frames.shape[1])

    def pending_windows(self) -> list[WindowRequest]:
        """Windows that need encoding now: completed windows not yet committed (in order), then the
        active window if it has frames its cached output was not computed from."""
        if self._buffer is None:
            return []
        wf, requests = self.window_frames, []
        first = len(self._completed)
        for j, s in enumerate(range(0, self._buffer.shape[1], wf)):
            feats = self._buffer[:, s:s + wf]
            complete = feats.shape[1] == wf
            if complete or self._active_frames != self._frames:
                requests.append(WindowRequest(first + j, self._buffer_start + s, feats, complete,
                                              self._stems.get(first + j)))
        return requests

    def active_window_features(self) -> Tensor | None:
        """Features [mel, t] of the active (incomplete) window, or None at a window boundary."""
        if self._buffer is None or self._frames % self.window_frames == 0:
            return None
        return self._buffer[:, (self._frames - self._buffer_start) // self.window_frames * self.window_frames:]

    def commit(self, request: WindowRequest, output: Tensor, stem: Tensor | None = None) -> None:
        """Store the encoder output [tokens, output_dim] of a request from `pending_windows`, and
        optionally the conv-stem outputs of its complete chunks (`encode_windows(...,
        return_stems=True)`), which later requests of the same window reuse.

        A complete window's output is cached for good and its features (and stem cache) dropped;
        complete windows must be committed in order. An active-window output is kept until frames
        arrive after it.
        """
        expected = self.encoder.num_tokens(request.end_frame - request.start_frame)
        if output.shape[0] != expected:
            raise ValueError(f"window {request.index} needs {expected} tokens, got {output.shape[0]}")
        cf = self.encoder.cfg.chunk_frames
        if stem is not None and stem.shape[0] != (request.end_frame - request.start_frame) // cf:
            raise ValueError(f"window {request.index} has {(request.end_frame - request.start_frame) // cf} "
                             f"complete chunks, got a stem of {stem.shape[0]}")
        if request.complete:
            if request.index != len(self._completed):
                raise ValueError(f"window {request.index} committed out of order "
                                 f"(next is {len(self._completed)})")
            self._completed.append(output)
            self._stems.pop(request.index, None)  # its final output is cached: the stems are no use
            assert self._buffer is not None  # holds the window until it is committed
            self._buffer = self._buffer[:, self.window_frames:]
            self._buffer_start += self.window_frames
            if self._buffer.shape[1] == 0:
                self._buffer = None
            if self._active_frames <= self._buffer_start:
                self._active, self._active_frames = None, 0
        else:
            if request.index == self._frames // self.window_frames:
                self._active, self._active_frames = output, request.end_frame
            # a stale result's stems are still right (complete chunks never change) unless the window
            # has been committed since
            cached = self._stems.get(request.index)
            if (stem is not None and stem.shape[0] > 0 and request.index >= len(self._completed)
                    and (cached is None or stem.shape[0] > cached.shape[0])):
                self._stems[request.index] = stem
        # else: a partial result of a window that has completed since; the complete one replaces it

    def encode_pending(self) -> None:
        """Encode this session's pending windows on its own (one batch) and commit them."""
        requests = self.pending_windows()
        outs, stems = self.encoder.encode_windows([r.features for r in requests],
                                                  [r.item_start for r in requests],
                                                  [r.stem for r in requests], return_stems=True)
        for r, o, st in zip(requests, outs, stems):
            self.commit(r, o, st)

    def outputs(self) -> Tensor:
        """Encoder outputs for all frames so far: [num_tokens(frames), output_dim].

        Equal to `encoder(all features)` (see tests for the tolerances). Encodes what is pending first.
        """
        self.encode_pending()
        parts = list(self._completed)
        if self._active is not None:
            parts.append(self._active)
        if not parts:
            p = self.encoder.proj2.weight
            return p.new_zeros(0, self.encoder.cfg.output_dim)
        return torch.cat(parts)
