"""Where each transcript token is spoken, for synth-en's guided attention (training only): the
phoneme CTC force-aligned to espeak-ng's phonemes (`ctc_align`, `token_rows`), a word's tokens
(`word_structure`), the speech's rows (`speech_rows`) and the loss that steers the probed decoder
heads there (`guided_attention_loss`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from harken.cloud.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from harken.training.train import Batch


def guided_heads(n_layers: int) -> dict[int, list[int]]:
    """(decoder layer: query heads) steered to the audio by the guided-attention loss: head 0 of
    the second and third layers (of the last layer in a model with fewer than three)."""
    return {1: [0], 2: [0]} if n_layers >= 3 else {n_layers - 1: [0]}


def speech_rows(feats: torch.Tensor, encoder, drop: float = 0.4) -> tuple[int, int]:
    """[first, last + 1) audio rows of the speech in an utterance: the frames whose mean log-mel
    is within `drop` (normalised units, 40 dB each) of the loudest frame's."""
    e = feats.float().mean(0)
    loud = torch.nonzero(e > e.max() - drop)[:, 0]
    a, b = int(loud[0]), int(loud[-1]) + 1
    return encoder.num_tokens(a), max(encoder.num_tokens(b), encoder.num_tokens(a) + 1)


def guided_attention_loss(attn: list[torch.Tensor], batch: Batch, audio_rows: list[int], audio_start: int,
                          tgt_pos: list[tuple[int, int, int]], encoder,
                          spans: list[tuple[np.ndarray, np.ndarray] | None] | None = None) -> torch.Tensor:
    """Steer the probed heads to the audio where each transcript token is spoken, assumed spread
    evenly over the speech (a diagonal prior, as in guided attention for TTS): for the query that
    predicts transcript token k of K, -log of its attention mass under a Gaussian window over the
    audio rows centred at (k + 1/2) / K of the speech (width 10% of it, at least 1.5 rows). It only
    gets alignment started; the content decides the rest.

    `spans[b]` (when given): each transcript token's (centre, width) in audio rows from the phoneme
    CTC's forced alignment (`token_rows`), a far sharper target than the diagonal."""
    total, count = torch.zeros(()), 0
    for b, (_, s, n) in enumerate(tgt_pos):
        K = n - batch.n_prefix - 1  # transcript tokens, without the language prefix and <|im_end|>
        if K <= 0:
            continue
        dev = attn[0].device
        j = torch.arange(audio_rows[b], device=dev, dtype=torch.float32)
        span = spans[b] if spans is not None else None
        sigma: torch.Tensor | float
        if span is not None and len(span[0]) == K:
            centre = torch.as_tensor(span[0], device=dev, dtype=torch.float32)
            sigma = torch.as_tensor(span[1], device=dev, dtype=torch.float32)[:, None]
        else:
            a0, a1 = speech_rows(batch.feats[b], encoder)
            a1 = min(a1, audio_rows[b])
            a0 = min(a0, a1 - 1)
            centre = a0 + (a1 - a0) * (torch.arange(K, device=dev, dtype=torch.float32) + 0.5) / K
            sigma = max(1.5, 0.1 * (a1 - a0))
        window = torch.exp(-0.5 * ((j[None, :] - centre[:, None]) / sigma) ** 2)  # [K, rows]
        q0 = s + batch.n_prefix  # the query that predicts transcript token 0
        for w in attn:
            mass = (w[b, q0:q0 + K, audio_start:audio_start + audio_rows[b]] * window).sum(-1)
            total = total - torch.log(mass + 1e-6).sum()
            count += K
    return total / max(count, 1)


def ctc_align(logp: np.ndarray, target: list[int]) -> list[int] | None:
    """CTC forced alignment (Viterbi, blank 0): the frame where each target label is first emitted
    on the best path through `logp` [frames, classes] (log-probabilities); None if no path fits."""
    T, L = logp.shape[0], len(target)
    ext = np.zeros(2 * L + 1, dtype=np.int64)
    ext[1::2] = target
    S = len(ext)
    emit = logp[:, ext]  # [T, S]
    skip = np.zeros(S, dtype=bool)
    skip[2:] = (ext[2:] != 0) & (ext[2:] != ext[:-2])
    neg = -1e30
    alpha = np.full(S, neg)
    alpha[:2] = emit[0, :2]
    back = np.zeros((T, S), dtype=np.int8)
    for t in range(1, T):
        cand = np.full((3, S), neg)
        cand[0] = alpha
        cand[1, 1:] = alpha[:-1]
        cand[2, 2:] = np.where(skip[2:], alpha[:-2], neg)
        back[t] = cand.argmax(0)
        alpha = cand.max(0) + emit[t]
    s = S - 1 if S == 1 or alpha[S - 1] >= alpha[S - 2] else S - 2
    if alpha[s] < neg / 2:
        return None
    first: list[int | None] = [None] * L
    for t in range(T - 1, -1, -1):
        if s % 2:
            first[s // 2] = t
        s -= int(back[t, s])
    return first if all(f is not None for f in first) else None  # type: ignore[return-value]


def token_rows(logp: np.ndarray, phones: list[int], words: tuple[list[int], list[int]]
               ) -> tuple[np.ndarray, np.ndarray] | None:
    """(centre, width) in audio rows of each transcript token: the phoneme CTC (two slots a row) is
    force-aligned to the utterance's phonemes; a word spans from its first phoneme's slot to the next
    word's; a word's tokens share its span evenly."""
    per_word, token_word = words
    first = ctc_align(logp, phones)
    if first is None or sum(per_word) != len(phones):
        return None
    starts = np.cumsum([0] + per_word)
    bounds = [first[i] for i in starts[:-1]] + [first[-1] + 2]
    centre, width = [], []
    for w in range(len(per_word)):
        toks = [k for k, tw in enumerate(token_word) if tw == w]
        r0, r1 = bounds[w] / 2, max(bounds[w + 1], bounds[w] + 1) / 2
        for i, _ in enumerate(toks):
            centre.append(r0 + (r1 - r0) * (i + 0.5) / len(toks))
            width.append(max(1.0, 0.5 * (r1 - r0) / len(toks)))
    if len(centre) != len(token_word):
        return None
    return np.array(centre), np.array(width)


def word_structure(tok: Tokenizer, text: str, phonemes: str, table: dict[str, int], transcript: list[int]
                   ) -> tuple[list[int], list[int]] | None:
    """(phonemes of each word, word of each transcript token) when espeak-ng's words and the text's
    whitespace words match one to one (numbers and some contractions do not: None). A token belongs
    to the word of its first non-space byte; a lone space to the next word."""
    per_word = [sum(c in table for c in w) for w in phonemes.split()]
    if len(per_word) != len(text.split()) or 0 in per_word:
        return None
    token_word, w, prev_space = [], -1, True
    for t in transcript:
        own = None
        for ch in tok.token_bytes(t):
            space = ch in b" \t\n"
            if not space and prev_space:
                w += 1
            if not space and own is None:
                own = w
            prev_space = space
        token_word.append(own if own is not None else w + 1)
    if max(token_word, default=-1) != len(per_word) - 1:
        return None
    return per_word, token_word
