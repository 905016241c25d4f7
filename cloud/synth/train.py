"""`harken train synth-en OUTDIR`: train harken's own small Qwen3-ASR on the synthetic corpus.

The model is harken's `AudioEncoder` + `Qwen3Decoder` (cloud/model) with small dims
(`synth_en_config`), the real Qwen vocabulary and the official prompt; the target is what the
official model writes, `language English<asr_text>{text}<|im_end|>`, after the official prompt
with the audio embeddings over the `<|audio_pad|>` rows.

Training-only parts, dropped from the shipped checkpoint:
- the loss runs over the vocabulary rows that occur in the training text (`Vocab`): the other
  rows of the tied embedding stay exactly zero, so their logits are 0 and one constant term
  log(V - Vs) in the log-sum-exp makes this exactly the full-vocabulary loss;
- two auxiliary CTC losses on the encoder output, which teach it speech long before the decoder
  learns to read it: over espeak-ng's phonemes (two CTC slots per 80-ms encoder token), and over
  the Qwen tokens with the tied embedding as the output matrix (so an audio row comes to look like
  the embedding of the token spoken there, which the decoder then only has to copy in order);
- a curriculum: short utterances first (the longest allowed grows over `--ramp-steps`).

State (weights, optimiser, step, RNG) is saved to OUTDIR/state.pt every `--save-every` seconds
and at each evaluation; a rerun resumes from it. Each evaluation also exports the official-layout
checkpoint OUTDIR/checkpoint/ and appends the held-out WER to OUTDIR/log.jsonl; `curve.png` is
redrawn from that log.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from harken.cloud.model.config import AudioEncoderConfig, Qwen3ASRConfig, TextDecoderConfig
from harken.cloud.model.decoder import Qwen3Decoder, precompute_rope, rope_inv_freq
from harken.cloud.model.encoder import AudioEncoder
from harken.cloud.model.prompt import build_prompt
from harken.cloud.model.tokenizer import Tokenizer
from harken.cloud.synth import corpus, pieces
from harken.cloud.synth.pieces import Pieces

TARGET_PREFIX = "language English<asr_text>"


def synth_en_config() -> Qwen3ASRConfig:
    """synth-en dims: encoder 6 x d256, decoder 4 x h256 (head_dim 64, so vLLM can serve it)."""
    return Qwen3ASRConfig(
        audio=AudioEncoderConfig(d_model=256, encoder_layers=6, encoder_attention_heads=4,
                                 encoder_ffn_dim=1024, output_dim=256, downsample_hidden_size=64),
        text=TextDecoderConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                               rope_scaling={"mrope_section": [12, 10, 10], "interleaved": True,
                                             "rope_type": "default"}),
    )


def tiny_train_config() -> Qwen3ASRConfig:
    """For the smoke test: the same structure, a few hundred kB of weights besides embeddings."""
    return Qwen3ASRConfig(
        audio=AudioEncoderConfig(d_model=32, encoder_layers=1, encoder_attention_heads=2,
                                 encoder_ffn_dim=64, output_dim=64, downsample_hidden_size=8),
        text=TextDecoderConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                               rope_scaling={"mrope_section": [6, 5, 5], "interleaved": True,
                                             "rope_type": "default"}),
    )


# --- data ---------------------------------------------------------------------------------------

@dataclass
class Example:
    feats: np.ndarray  # fp16 [128, T] (a view into its shard)
    target: list[int]  # token ids: language English<asr_text>{text}<|im_end|>
    phones: list[int]  # phoneme ids (1-based; 0 is the CTC blank)
    text: str
    words: tuple[list[int], list[int]] | None = None  # (phonemes of each word, word of each transcript
    # token) when espeak-ng's words match the text's one to one (`word_structure`), else None


class Vocab:
    """The vocabulary rows trained: every token of the training text and the prompt."""

    def __init__(self, ids: list[int], vocab_size: int):
        self.ids = torch.tensor(sorted(set(ids)), dtype=torch.long)
        self.vocab_size = vocab_size
        self.index = torch.full((vocab_size,), -1, dtype=torch.long)
        self.index[self.ids] = torch.arange(len(self.ids))

    def __len__(self) -> int:
        return len(self.ids)

    def sub(self, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
        idx = self.index[torch.as_tensor(token_ids, dtype=torch.long)]
        if (idx < 0).any():
            raise ValueError("token outside the trained vocabulary")
        return idx


def phone_table(examples_phonemes: list[str]) -> dict[str, int]:
    chars = sorted({c for p in examples_phonemes for c in p if c != " "})
    return {c: i + 1 for i, c in enumerate(chars)}


# --- the model being trained --------------------------------------------------------------------

class Trainee(nn.Module):
    """Encoder + decoder with the embedding restricted to `vocab` rows, and the CTC heads."""

    def __init__(self, cfg: Qwen3ASRConfig, vocab: Vocab, n_phones: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.cfg, self.vocab = cfg, vocab
        self.encoder = AudioEncoder(cfg.audio)
        with torch.device("meta"):
            dec = Qwen3Decoder(cfg.text, tie_word_embeddings=True)
        # the decoder's layers and norm, without the 151,936-row embedding
        self.layers = nn.ModuleList([_materialise(layer) for layer in dec.model.layers])
        self.norm = _materialise(dec.model.norm)
        self.decoder_config = cfg.text
        self.emb = nn.Parameter(torch.randn(len(vocab), cfg.text.hidden_size) * 0.02)
        self.blank = nn.Parameter(torch.zeros(cfg.text.hidden_size))  # token-CTC blank row
        self.phone_head = nn.Linear(cfg.audio.output_dim, 2 * (n_phones + 1))
        # text without audio: "audio rows" made of phoneme embeddings (`pseudo_rows`), which the
        # encoder's output is also pulled towards (`losses`, "match")
        self.ph_emb = nn.Embedding(n_phones + 1, cfg.audio.output_dim)
        _init(self)

    def decode_hidden(self, x: torch.Tensor, probe: dict[int, list[int]] | None = None
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final hidden states [B, S, hidden], and the attention weights [B, S, S] of each probed
        (layer: query heads) head, in layer order."""
        B, S, _ = x.shape
        t = self.cfg.text
        pos = torch.arange(S, device=x.device).expand(B, S)
        cos, sin = precompute_rope(pos, rope_inv_freq(t.head_dim, t.rope_theta, x.device))
        weights = []
        for i, layer in enumerate(self.layers):
            if probe and i in probe:
                q, k, _ = layer.self_attn.project(layer.input_layernorm(x), cos, sin)  # [B, S, H, D]
                group = t.num_attention_heads // t.num_key_value_heads
                causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
                for h in probe[i]:
                    logit = q[:, :, h] @ k[:, :, h // group].transpose(1, 2) / math.sqrt(t.head_dim)
                    weights.append(logit.masked_fill(~causal, float("-inf")).softmax(-1))
            x = layer(x, cos, sin)
        return self.norm(x), weights


@torch.no_grad()
def warm_start(model: Trainee, state: dict) -> None:
    """Every weight of another run's `state` whose shape fits; embedding rows by token id (rows
    that run did not train keep their fresh initialisation)."""
    old = state["model"]
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in old.items() if k in own and k != "emb" and v.shape == own[k].shape},
                          strict=False)
    old_index = {t: i for i, t in enumerate(state["vocab"])}
    for row, t in enumerate(model.vocab.ids.tolist()):
        if t in old_index:
            model.emb[row] = old["emb"][old_index[t]].to(model.emb.device)


def _materialise(module: nn.Module) -> nn.Module:
    return module.to_empty(device="cpu")


def _init(model: Trainee) -> None:
    """Transformer init: N(0, 0.02) matrices, zero biases, unit norms; output projections of
    residual blocks scaled down by depth."""
    for name, p in model.named_parameters():
        if name in ("emb", "blank"):
            continue
        with torch.no_grad():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
                if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight", "fc2.weight")):
                    p.mul_(1 / math.sqrt(2 * max(model.cfg.text.num_hidden_layers, 1)))
            elif "norm" in name or "layer_norm" in name or "ln_post" in name:
                p.fill_(1.0) if name.endswith("weight") else p.zero_()
            else:
                p.zero_()
    # conv stem: kaiming so the 3 GELU convs keep their scale
    for conv in (model.encoder.conv2d1, model.encoder.conv2d2, model.encoder.conv2d3):
        nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")


# --- the loss -----------------------------------------------------------------------------------

@dataclass
class Batch:
    feats: list[torch.Tensor]
    targets: list[list[int]]  # language English<asr_text>{text}<|im_end|>
    phones: list[list[int]]
    n_prefix: int  # tokens of `language English<asr_text>` at the start of every target
    corrupt: float = 0.0  # share of transcript input tokens replaced by random trained tokens
    guide: float = 0.0  # weight of the guided-attention loss (0: not computed)
    words: list[tuple[list[int], list[int]] | None] | None = None  # `Example.words` of each item


def losses(model: Trainee, batch: Batch, prompt_ids: tuple[list[int], list[int]], aux: bool = True,
           roll_audio: bool = False, rows: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Cross-entropy of the transcript tokens (exact full-vocabulary value) and (`aux`) the two CTCs
    and the match of the encoder's rows to its phonemes' embeddings. `roll_audio`: each transcript
    gets the next utterance's audio (how much the decoder listens). `rows`: audio rows given
    (text without audio, `pseudo_rows`): the cross-entropy alone."""
    cfg, vocab = model.cfg, model.vocab
    text_only = rows is not None
    audio = rows if text_only else model.encoder.encode_items(batch.feats)  # [N_i, hidden] each
    if roll_audio:
        audio = audio[1:] + audio[:1]
    prefix, suffix = prompt_ids
    dev = model.emb.device
    subs = [vocab.sub(t).to(dev) for t in batch.targets]
    # every text embedding of the batch in one gather (one sparse-ish backward, not one per piece)
    inputs = [t[:-1] for t in subs]
    if batch.corrupt > 0:  # the decoder cannot lean on its own history alone: it has to listen
        inputs = [_corrupt(t, batch.n_prefix, batch.corrupt, len(vocab)) for t in inputs]
    pieces = [vocab.sub(prefix).to(dev), vocab.sub(suffix).to(dev)] + inputs
    text_emb = model.emb[torch.cat(pieces)].split([len(p) for p in pieces])
    pre, suf = text_emb[0], text_emb[1]
    seqs, tgt_pos = [], []
    for b, (a, t_in) in enumerate(zip(audio, text_emb[2:])):
        # input: prefix, audio, suffix, target[:-1]; predict the target at the last len(target) places
        seqs.append(torch.cat([pre, a, suf, t_in]))
        tgt_pos.append((b, len(prefix) + a.shape[0] + len(suffix) - 1, t_in.shape[0] + 1))
    S = max(s.shape[0] for s in seqs)
    x = torch.stack([F.pad(s, (0, 0, 0, S - s.shape[0])) for s in seqs])  # right pad: causal, harmless
    guided = batch.guide > 0 and not roll_audio and not text_only
    h, attn = model.decode_hidden(x, guided_heads(len(model.layers)) if guided else None)
    rows = torch.cat([h[b, s:s + n] for b, s, n in tgt_pos])  # [Ntgt, hidden]
    logits = rows @ model.emb.t()  # [Ntgt, Vs]
    # the untrained rows are zero: V - Vs logits of exactly 0
    extra = math.log(vocab.vocab_size - len(vocab))
    lse = torch.logaddexp(torch.logsumexp(logits, -1), torch.full_like(logits[:, 0], extra))
    gold = torch.cat(subs)
    ce = (lse - logits.gather(1, gold[:, None])[:, 0]).mean()
    if not aux or text_only:
        return {"ce": ce}
    out = {"ce": ce}
    # phoneme CTC, two slots per encoder token
    out_lens = torch.tensor([a.shape[0] for a in audio])
    A = torch.nn.utils.rnn.pad_sequence(audio)  # [T, B, hidden]
    ph = model.phone_head(A)  # [T, B, 2 * P]
    T, B, _ = ph.shape
    ph = ph.view(T, B, 2, -1).permute(0, 2, 1, 3).reshape(2 * T, B, -1)
    if guided:
        spans = None
        if batch.words is not None:
            logp = ph.detach().float().log_softmax(-1).cpu().numpy()
            spans = [token_rows(logp[:2 * int(out_lens[b]), b], batch.phones[b], w) if w else None
                     for b, w in enumerate(batch.words)]
        out["guide"] = guided_attention_loss(attn, batch, [a.shape[0] for a in audio], len(prefix), tgt_pos,
                                             model.encoder, spans)

    # CTC over Qwen tokens on the audio rows, output matrix = the tied embedding rows of the tokens
    # in this batch (+ a blank row): an auxiliary loss, so a batch-local softmax is enough
    body = [t[batch.n_prefix:-1] for t in subs]  # the transcript alone
    local, inverse = torch.unique(torch.cat(body), return_inverse=True)
    tok_logits = A @ torch.cat([model.blank[None], model.emb[local]]).t()  # [T, B, 1 + n_local]
    ctc_tok = F.ctc_loss(tok_logits.log_softmax(-1), inverse + 1, out_lens,
                         torch.tensor([len(b) for b in body]), blank=0, zero_infinity=True,
                         reduction="mean")
    phones = torch.tensor([p for ps in batch.phones for p in ps], device=dev)
    ctc_ph = F.ctc_loss(ph.log_softmax(-1), phones, 2 * out_lens,
                        torch.tensor([len(p) for p in batch.phones]), blank=0, zero_infinity=True,
                        reduction="mean")
    # match: each encoder row towards the embeddings of the phonemes its two slots hear (posterior-
    # weighted, fixed), the rows `pseudo_rows` builds from text
    with torch.no_grad():
        target = (ph.softmax(-1) @ model.ph_emb.weight).view(T, 2, B, -1).sum(1)  # [T, B, hidden]
    valid = (torch.arange(T, device=dev)[:, None] < out_lens.to(dev)[None, :]).float()
    match = (((A - target) ** 2).mean(-1) * valid).sum() / valid.sum()
    return {**out, "ctc_tok": ctc_tok, "ctc_ph": ctc_ph, "match": match}


def pseudo_rows(model: Trainee, phones: list[list[int]], words: list[list[int]], rng: random.Random
                ) -> list[torch.Tensor]:
    """Audio rows made from text: each phoneme a spike in one CTC slot with 0-3 blank slots after
    it (a random speaking rate per utterance), 1-2 more blanks between words, 2-12 before and
    after; a row is the sum of its two slots' phoneme embeddings, as the match term makes the
    encoder's rows. `words[i]`: the index of the first phoneme of each word."""
    out = []
    for ph, starts in zip(phones, words):
        rate = rng.uniform(0.6, 1.5)
        slots = [0] * rng.randint(2, 12)
        word_starts = set(starts)
        for i, p in enumerate(ph):
            if i in word_starts and i:
                slots += [0] * rng.randint(0, 2)
            slots.append(p)
            slots += [0] * min(3, int(rng.expovariate(1.0) * rate + 0.5))
        slots += [0] * rng.randint(2, 12)
        if len(slots) % 2:
            slots.append(0)
        ids = torch.tensor(slots, device=model.ph_emb.weight.device).view(-1, 2)
        out.append(model.ph_emb(ids).sum(1))
    return out


@torch.no_grad()
def init_phone_embeddings(model: Trainee, examples: list[Example], n: int = 200) -> None:
    """ph_emb[p] := half the mean encoder row where a slot's most likely phoneme is p (so that the
    match term starts near where the encoder already is)."""
    dim = model.ph_emb.weight.shape[1]
    total = torch.zeros(model.ph_emb.num_embeddings, dim)
    count = torch.zeros(model.ph_emb.num_embeddings)
    dev = model.ph_emb.weight.device
    for e in examples[:n]:
        a = model.encoder.encode_items([torch.from_numpy(e.feats.astype(np.float32)).to(dev)])[0]
        best = model.phone_head(a).view(a.shape[0], 2, -1).argmax(-1)  # [rows, 2]
        for slot in range(2):
            total.index_add_(0, best[:, slot].cpu(), a.cpu() / 2)
            count.index_add_(0, best[:, slot].cpu(), torch.ones(a.shape[0]))
    seen = count > 0
    model.ph_emb.weight[seen.to(dev)] = (total[seen] / count[seen, None]).to(dev)


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
    total, count = 0.0, 0
    for b, (_, s, n) in enumerate(tgt_pos):
        K = n - batch.n_prefix - 1  # transcript tokens, without the language prefix and <|im_end|>
        if K <= 0:
            continue
        dev = attn[0].device
        j = torch.arange(audio_rows[b], device=dev, dtype=torch.float32)
        if spans is not None and spans[b] is not None and len(spans[b][0]) == K:
            centre = torch.as_tensor(spans[b][0], device=dev, dtype=torch.float32)
            sigma = torch.as_tensor(spans[b][1], device=dev, dtype=torch.float32)[:, None]
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


def _corrupt(t: torch.Tensor, keep: int, p: float, n: int) -> torch.Tensor:
    """`t` with each token after the first `keep` replaced, with probability p, by a uniformly
    drawn trained-vocabulary row (the labels stay the true tokens)."""
    hit = torch.rand(t.shape, device=t.device) < p
    hit[:keep] = False
    return torch.where(hit, torch.randint(0, n, t.shape, device=t.device), t)


# --- export -------------------------------------------------------------------------------------

def export_state_dict(model: Trainee) -> dict[str, np.ndarray]:
    """The official tensor names (`thinker.*`), fp32, untrained vocabulary rows zero."""
    out = {f"thinker.audio_tower.{k}": v.detach().float().cpu().numpy().copy() for k, v in model.encoder.state_dict().items()}
    for i, layer in enumerate(model.layers):
        for k, v in layer.state_dict().items():
            out[f"thinker.model.layers.{i}.{k}"] = v.detach().float().cpu().numpy().copy()
    out["thinker.model.norm.weight"] = model.norm.weight.detach().float().cpu().numpy().copy()
    emb = np.zeros((model.cfg.text.vocab_size, model.cfg.text.hidden_size), np.float32)
    emb[model.vocab.ids.numpy()] = model.emb.detach().float().cpu().numpy()
    out["thinker.model.embed_tokens.weight"] = emb
    return out


def export_checkpoint(model: Trainee, out: Path) -> Path:
    """Write an official-layout checkpoint directory (config, safetensors, tokenizer files)."""
    from safetensors.numpy import save_file

    from harken.cloud.model.tiny import _write_json, config_json, write_tokenizer_files

    out.mkdir(parents=True, exist_ok=True)
    if not (out / "tokenizer.json").exists():
        write_tokenizer_files(out, "real")
    _write_json(out / "config.json", config_json(model.cfg))
    _write_json(out / "generation_config.json", {"eos_token_id": [151645, 151643], "pad_token_id": 151643,
                                                 "do_sample": False})
    tmp = out / "model.safetensors.tmp"
    save_file(export_state_dict(model), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    return out


# --- evaluation ---------------------------------------------------------------------------------

def wer(refs: list[str], hyps: list[str]) -> float:
    """Word error rate with jiwer after the Whisper English normaliser (Open ASR Leaderboard)."""
    import jiwer
    from whisper_normalizer.english import EnglishTextNormalizer

    norm = EnglishTextNormalizer()
    pairs = [(norm(r), norm(h)) for r, h in zip(refs, hyps)]
    pairs = [(r, h) for r, h in pairs if r.strip()]
    return float(jiwer.wer([r for r, _ in pairs], [h for _, h in pairs]))


def evaluate(ckpt_dir: Path, feats: list[np.ndarray], refs: list[str]) -> tuple[float, list[str]]:
    from harken.cloud.model.asr import Qwen3ASR

    from harken.cloud.model.decode_limits import DecodeLimits

    asr = Qwen3ASR.load(str(ckpt_dir), dtype="fp32", device="cpu")
    hyps = [asr.transcribe(f.astype(np.float32), limits=DecodeLimits()).text for f in feats]
    return wer(refs, hyps), hyps


@torch.no_grad()
def audio_gain(model: Trainee, feats: list[np.ndarray], targets: list[list[int]],
               prompt_ids: tuple[list[int], list[int]], n_prefix: int) -> float:
    """Held-out transcript cross-entropy with another utterance's audio minus with its own (nats
    per token): ~0 while the decoder ignores the audio, large once it reads it."""
    keep = [i for i, t in enumerate(targets) if (model.vocab.index[torch.tensor(t)] >= 0).all()]
    if len(keep) < 2:
        return float("nan")
    dev = model.emb.device
    batch = Batch([torch.from_numpy(feats[i].astype(np.float32)).to(dev) for i in keep],
                  [targets[i] for i in keep], [[] for _ in keep], n_prefix)
    own = losses(model, batch, prompt_ids, aux=False)["ce"].item()
    other = losses(model, batch, prompt_ids, aux=False, roll_audio=True)["ce"].item()
    return other - own


# --- the loop -----------------------------------------------------------------------------------

@dataclass
class TrainOptions:
    corpus: Path
    out: Path
    steps: int = 20000
    batch_frames: int = 4000
    lr: float = 2e-3
    warmup: int = 100
    hold_steps: int = 100  # the learning rate stays at its peak until here, then falls as 1/sqrt(step)
    ramp_steps: int = 1500  # longest utterance grows from 5 s to 20 s over these steps
    eval_every: int = 400
    eval_n: int = 40
    save_every_s: float = 300.0
    seed: int = 0
    threads: int = 2
    w_ctc_tok: float = 0.5
    w_ctc_ph: float = 0.5
    corrupt: float = 0.2
    w_guide: float = 1.0  # guided attention (`guided_attention_loss`) while step < guide_steps
    w_match: float = 0.1  # encoder rows towards their phonemes' embeddings
    w_text: float = 1.0  # transcripts of text without audio, read from `pseudo_rows`
    text_batch: int = 4  # texts without audio per step
    guide_steps: int = 12000
    tiny: bool = False
    max_shards: int | None = None
    device: str = "cpu"  # "cuda" when a GPU is lent: the same run in minutes
    init_from: Path | None = None  # a new run starts from another run's state.pt (`warm_start`)
    whole_tokens: int = 1000  # `pieces.choose`: the output vocabulary synth-en writes with
    part_tokens: int = 600


def corpus_shards(opts: TrainOptions) -> list[Path]:
    """The finished shards: full utterances (`train-*`, at most `max_shards`) and phrases (`phrase-*`)."""
    def done(pattern: str) -> list[Path]:
        return sorted(p for p in opts.corpus.glob(pattern) if not p.name.endswith(".tmp.npz"))

    return done("train-*.npz")[:opts.max_shards] + done("phrase-*.npz")


def target_ids(tok: Tokenizer, spell: Pieces, text: str) -> list[int]:
    """`language English<asr_text>{text}<|im_end|>`, the text spelled with synth-en's pieces."""
    return tok.encode(TARGET_PREFIX) + spell.encode(text) + [tok.token_id("<|im_end|>")]


def load_examples(shards: list[Path], tok: Tokenizer, table: dict[str, int], spell: Pieces,
                  vocab: Vocab | None = None) -> list[Example]:
    """The utterances of `shards`; phoneme symbols outside `table` are dropped, and (with `vocab`)
    utterances with a token outside it are skipped."""
    out = []
    n_prefix = len(tok.encode(TARGET_PREFIX))
    for s in shards:
        feats, lengths, meta = corpus.load_shard(s)
        offs = np.concatenate([[0], np.cumsum(lengths)])
        for i, m in enumerate(meta):
            target = target_ids(tok, spell, m["text"])
            if vocab is not None and (vocab.index[torch.tensor(target)] < 0).any():
                continue
            out.append(Example(feats[:, offs[i]:offs[i + 1]], target,
                               [table[c] for c in m["phonemes"] if c in table], m["text"],
                               word_structure(tok, m["text"], m["phonemes"], table, target[n_prefix:-1])))
    return out


@dataclass
class TextExample:
    target: list[int]
    phones: list[int]
    words: list[int]  # index in `phones` of each word's first phoneme


def load_texts(paths: list[Path], tok: Tokenizer, table: dict[str, int], spell: Pieces, vocab: Vocab
               ) -> list[TextExample]:
    """Texts without audio (`corpus.build_text_phonemes`) whose tokens are all trained rows."""
    out = []
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            d = json.loads(line)
            target = target_ids(tok, spell, d["text"])
            if (vocab.index[torch.tensor(target)] < 0).any():
                continue
            phones, words = [], []
            for word in d["phonemes"].split():
                ids = [table[c] for c in word if c in table]
                if ids:
                    words.append(len(phones))
                    phones += ids
            if phones:
                out.append(TextExample(target, phones, words))
    return out


def text_files(opts: TrainOptions) -> list[Path]:
    return sorted(opts.corpus.glob("text-*.jsonl"))


def phone_table_of(shards: list[Path]) -> dict[str, int]:
    return phone_table([m["phonemes"] for s in shards for m in corpus.load_shard(s)[2]])


def batches(examples: list[Example], rng: random.Random, batch_frames: int, max_frames: int):
    """Length-bucketed batches of at most `batch_frames` frames (padding counted)."""
    pool = [e for e in examples if e.feats.shape[1] <= max_frames]
    rng.shuffle(pool)
    for i in range(0, len(pool), 512):
        chunk = sorted(pool[i:i + 512], key=lambda e: e.feats.shape[1])
        group: list[Example] = []
        for e in chunk:
            if group and (len(group) + 1) * e.feats.shape[1] > batch_frames:
                yield group
                group = []
            group.append(e)
        if group:
            yield group


def train(opts: TrainOptions, log=print) -> Path:
    torch.set_num_threads(opts.threads)
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_train_config() if opts.tiny else synth_en_config()
    tok_dir = out / "checkpoint"
    if not (tok_dir / "tokenizer.json").exists():
        from harken.cloud.model.tiny import write_tokenizer_files

        write_tokenizer_files(tok_dir, "real")
    tok = Tokenizer.from_dir(tok_dir)
    target_prefix = tok.encode(TARGET_PREFIX)
    shards = corpus_shards(opts)
    if not shards:
        raise SystemExit(f"no corpus shards in {opts.corpus}")
    state_path = out / "state.pt"
    saved = torch.load(state_path, map_location="cpu", weights_only=False) if state_path.exists() else None
    init = (torch.load(opts.init_from, map_location="cpu", weights_only=False)
            if saved is None and opts.init_from else None)
    table = dict((saved or init)["phones"]) if (saved or init) else phone_table_of(shards[:1])
    phone_chars = sorted(table, key=table.get)
    prompt = build_prompt(tok, 1, "", None)
    prefix, suffix = prompt.ids[:prompt.audio_start], prompt.ids[prompt.audio_start + 1:]
    if saved:  # the run's own rows; utterances with a token outside them are skipped
        vocab = Vocab(saved["vocab"], cfg.text.vocab_size)
    else:
        # the trained rows: the pieces of the training text, the prompt, both end tokens
        train_text = [s for group in corpus._split_sources(opts.seed)[0].values() for s in group]
        ids = set(prompt.ids) | {tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")}
        ids.update(target_prefix)
        ids.update(pieces.choose(tok, train_text, opts.whole_tokens, opts.part_tokens))
        vocab = Vocab(sorted(ids), cfg.text.vocab_size)
    spell = Pieces(tok, [i for i in vocab.ids.tolist() if i not in tok.added_ids])
    examples = load_examples(shards, tok, table, spell, vocab)
    model = Trainee(cfg, vocab, len(phone_chars), opts.seed).to(opts.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, betas=(0.9, 0.98), weight_decay=0.01)
    step, rng, rewarm_from = 0, random.Random(opts.seed), None
    if saved:
        st = saved
        missing, _ = model.load_state_dict({k: v.to(opts.device) for k, v in st["model"].items()}, strict=False)
        step = st["step"]
        rng.setstate(st["rng"])
        if missing:  # a state from before these parameters: warm start, a fresh optimiser
            if "ph_emb.weight" in missing:
                init_phone_embeddings(model, examples)
            rewarm_from = step
            log(f"warm start at step {step} (new: {', '.join(missing)})")
        else:
            opt.load_state_dict(st["opt"])
            rewarm_from = st.get("rewarm_from")
            if st.get("schedule") != [opts.lr, opts.hold_steps]:  # a new schedule: warm up to it again
                rewarm_from = step
            log(f"resumed at step {step}")
    elif init:
        warm_start(model, init)
        log(f"step 0: weights from {opts.init_from} (step {init['step']}), "
            f"{len(vocab)} vocabulary rows mapped by token id")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{len(examples)} utterances, {sum(e.feats.shape[1] for e in examples) / 360000:.1f} h; "
        f"vocabulary {len(vocab)} rows; {len(phone_chars)} phonemes; {n_params / 1e6:.1f}M trained parameters")

    held = corpus.read_held_out()[:opts.eval_n]
    held_feats_path = out / f"heldout-{opts.eval_n}.npz"
    if held_feats_path.exists():
        with np.load(held_feats_path) as z:
            held_feats = [z[f"f{i}"] for i in range(len(held))]
    else:
        held_feats = [corpus.render_features(u.recipe) for u in held]
        np.savez(held_feats_path, **{f"f{i}": f for i, f in enumerate(held_feats)})
    held_refs = [u.recipe.text for u in held]

    def save():
        tmp = out / "state.pt.tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "rewarm_from": rewarm_from,
                    "schedule": [opts.lr, opts.hold_steps],
                    "rng": rng.getstate(), "vocab": vocab.ids.tolist(), "phones": sorted(table.items())}, tmp)
        os.replace(tmp, state_path)

    def lr_at(s: int) -> float:
        lr = opts.lr * min((s + 1) / opts.warmup, 1.0, math.sqrt(max(opts.hold_steps, opts.warmup) / (s + 1)))
        if rewarm_from is not None:  # after a warm start: warm the fresh optimiser up again
            lr *= min(1.0, (s - rewarm_from + 1) / opts.warmup)
        return lr

    log_path = out / "log.jsonl"
    texts: list[TextExample] = []
    text_paths: list[Path] = []
    last_save, t0, seen_frames = time.time(), time.time(), 0
    avg: dict[str, float] = {}
    while step < opts.steps:
        more = [p for p in corpus_shards(opts) if p not in shards]
        if more:  # the corpus build goes on beside training: take new shards each pass
            examples += load_examples(more, tok, table, spell, vocab)
            shards += more
            log(f"{len(more)} new shards: {len(examples)} utterances")
        new_texts = [p for p in text_files(opts) if p not in text_paths]
        if new_texts:
            texts += load_texts(new_texts, tok, table, spell, vocab)
            text_paths += new_texts
            log(f"{len(new_texts)} new text files: {len(texts)} texts without audio")
        max_frames = int(500 + min(1.0, step / max(opts.ramp_steps, 1)) * 1600)
        for group in batches(examples, rng, opts.batch_frames, max_frames):
            if step >= opts.steps:
                break
            model.train()
            batch = Batch([torch.from_numpy(e.feats.astype(np.float32)).to(opts.device) for e in group],
                          [e.target for e in group], [e.phones for e in group], len(target_prefix),
                          opts.corrupt, opts.w_guide if step < opts.guide_steps else 0.0,
                          [e.words for e in group])
            parts = losses(model, batch, (prefix, suffix))
            loss = parts["ce"] + opts.w_ctc_tok * parts["ctc_tok"] + opts.w_ctc_ph * parts["ctc_ph"]
            loss = loss + opts.w_match * parts["match"]
            if "guide" in parts:
                loss = loss + batch.guide * parts["guide"]
            if texts and opts.w_text > 0:
                picked = [texts[rng.randrange(len(texts))] for _ in range(opts.text_batch)]
                rows = pseudo_rows(model, [t.phones for t in picked], [t.words for t in picked], rng)
                text_batch = Batch([], [t.target for t in picked], [], len(target_prefix), opts.corrupt)
                parts["ce_text"] = losses(model, text_batch, (prefix, suffix), rows=rows)["ce"]
                loss = loss + opts.w_text * parts["ce_text"]
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            seen_frames += sum(e.feats.shape[1] for e in group)
            for k, v in parts.items():
                avg[k] = 0.98 * avg.get(k, v.item()) + 0.02 * v.item()
            if step % 20 == 0:
                el = time.time() - t0
                log(f"step {step} ce {avg['ce']:.3f} ctc_tok {avg['ctc_tok']:.3f} ctc_ph {avg['ctc_ph']:.3f} "
                    + (f"guide {avg['guide']:.3f} " if "guide" in parts else "")
                    + f"match {avg['match']:.3f} "
                    + (f"ce_text {avg['ce_text']:.3f} " if "ce_text" in avg else "")
                    + f"lr {lr_at(step):.2e} max_s {max_frames / 100:.0f} audio/s {seen_frames / 100 / el:.0f}")
            if step % opts.eval_every == 0 or step == opts.steps:
                model.eval()
                ckpt = export_checkpoint(model, out / "checkpoint")
                w, hyps = evaluate(ckpt, held_feats, held_refs)
                gain = audio_gain(model, held_feats, [target_ids(tok, spell, r) for r in held_refs],
                                  (prefix, suffix), len(target_prefix))
                rec = {"step": step, "time_s": round(time.time() - t0, 1), **{k: round(v, 4) for k, v in avg.items()},
                       "heldout_wer": round(w, 4), "audio_gain": round(gain, 4), "example": hyps[0]}
                with log_path.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
                log(f"eval step {step}: held-out WER {w:.3f} | ref {held_refs[0]!r} | hyp {hyps[0]!r}")
                plot_curve(log_path, out / "curve.png")
                save()
                last_save = time.time()
            elif time.time() - last_save > opts.save_every_s:
                save()
                last_save = time.time()
    save()
    return export_checkpoint(model, out / "checkpoint")


def plot_curve(log_path: Path, png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    recs = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    if not recs:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in recs]
    ax.plot(steps, [r["ce"] for r in recs], label="transcript CE")
    ax.plot(steps, [r["ctc_tok"] for r in recs], label="token CTC (aux)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax2 = ax.twinx()
    ax2.plot(steps, [100 * r["heldout_wer"] for r in recs], "k--", label="held-out WER %")
    ax2.set_ylabel("WER %")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    o = TrainOptions(Path(sys.argv[1]), Path(sys.argv[2]))
    train(o)
