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

State (weights, optimiser, step, RNG) is saved to OUTDIR/state.pt every `save_every_s` seconds,
at each evaluation and on SIGTERM / SIGINT; a rerun resumes from it. A run with no OUTDIR/state.pt
starts from the warm-start state committed in the repo (`state.py`, `lab/training/warmstart/`), so
training goes on across machines; its evaluation history becomes the start of OUTDIR/log.jsonl.
Each evaluation also exports the official-layout checkpoint OUTDIR/checkpoint/ (the average of the
weights, `averaging.py`; the raw weights in OUTDIR/checkpoint-raw/) and appends the held-out WER to
OUTDIR/log.jsonl; `curve.png` is redrawn from that log.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from harken.cloud.model.config import AudioEncoderConfig, Qwen3ASRConfig, TextDecoderConfig
from harken.cloud.model.decoder import DecoderLayer, Qwen3Decoder, precompute_rope, rope_inv_freq
from harken.cloud.model.encoder import AudioEncoder
from harken.cloud.model.prompt import build_prompt
from harken.cloud.model.tokenizer import Tokenizer
from harken.training import corpus, growth, pieces
from harken.training import state as warm
from harken.training.alignment import guided_attention_loss, guided_heads, token_rows
from harken.training.averaging import WeightAverage
from harken.training.evaluation import (audio_gain, evaluate, export_checkpoint, held_out_set, held_out_split,
                                           phoneme_hyps, phoneme_rate, plot_curve)
from harken.training.examples import (TARGET_PREFIX, Example, TextExample, Vocab, batches, corpus_shards,
                                         load_examples, load_texts, phone_table_of, augment, target_ids,
                                         text_batches, text_files)
from harken.training.options import TrainOptions, learning_rate
from harken.training.pieces import Pieces

# bf16 matrix products on the CPU are oneDNN kernels compiled per shape, and batch shapes vary step
# to step: with the default cache of 1,024 kernels, 8% of a step went on compiling them again. Each
# kernel kept holds ~0.85 MB (600 shapes of one bf16 linear layer, forward and backward, under
# jemalloc: 1.7 GB with a cache of 65,536, 0.5 GB with none), and with 65,536 and the texts without
# audio length-bucketed (step 74,506) the trainer grew by ~150 MB a minute. So the cache is capped
# at 4,096 and the decoder's sequences are padded to a multiple of SEQ_QUANTUM positions (right
# padding, harmless under the causal mask): a text batch (always 16) has ~40 shapes, not ~600.
ONEDNN_CACHE = 4096
SEQ_QUANTUM = 16


# synth-en's decoder depth: 4 layers to step 77,606, then grown (`growth.py`) where the warm-start
# state's bf16 planes made room in its 16 MiB
DECODER_LAYERS = 6


def synth_en_config(decoder_layers: int = DECODER_LAYERS) -> Qwen3ASRConfig:
    """synth-en dims: encoder 6 x d256, decoder `decoder_layers` x h256 (head_dim 64, so vLLM can serve it)."""
    return Qwen3ASRConfig(
        audio=AudioEncoderConfig(d_model=256, encoder_layers=6, encoder_attention_heads=4,
                                 encoder_ffn_dim=1024, output_dim=256, downsample_hidden_size=64),
        text=TextDecoderConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=decoder_layers,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                               rope_scaling={"mrope_section": [12, 10, 10], "interleaved": True,
                                             "rope_type": "default"}),
    )


def tiny_train_config(decoder_layers: int = 1) -> Qwen3ASRConfig:
    """For the smoke test: the same structure, a few hundred kB of weights besides embeddings."""
    return Qwen3ASRConfig(
        audio=AudioEncoderConfig(d_model=32, encoder_layers=1, encoder_attention_heads=2,
                                 encoder_ffn_dim=64, output_dim=64, downsample_hidden_size=8),
        text=TextDecoderConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=decoder_layers,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                               rope_scaling={"mrope_section": [6, 5, 5], "interleaved": True,
                                             "rope_type": "default"}),
    )


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
                assert isinstance(layer, DecoderLayer)  # self.layers holds Qwen3Decoder's layers
                q, k, _ = layer.self_attn.project(layer.input_layernorm(x), cos, sin)  # [B, S, H, D]
                group = t.num_attention_heads // t.num_key_value_heads
                causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
                for h in probe[i]:
                    logit = q[:, :, h] @ k[:, :, h // group].transpose(1, 2) / math.sqrt(t.head_dim)
                    weights.append(logit.float().masked_fill(~causal, float("-inf")).softmax(-1))
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


_M = TypeVar("_M", bound=nn.Module)


def _materialise(module: _M) -> _M:
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
    audio = rows if rows is not None else model.encoder.encode_items(batch.feats)  # [N_i, hidden] each
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
    S = -(-max(s.shape[0] for s in seqs) // SEQ_QUANTUM) * SEQ_QUANTUM  # few distinct shapes (ONEDNN_CACHE)
    x = torch.stack([F.pad(s, (0, 0, 0, S - s.shape[0])) for s in seqs])  # right pad: causal, harmless
    guided = batch.guide > 0 and not roll_audio and not text_only
    h, attn = model.decode_hidden(x, guided_heads(len(model.layers)) if guided else None)
    tgt_rows = torch.cat([h[b, s:s + n] for b, s, n in tgt_pos])  # [Ntgt, hidden]
    logits = (tgt_rows @ model.emb.t()).float()  # [Ntgt, Vs]; the softmaxes in fp32 under bf16 autocast
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
    ctc_tok = F.ctc_loss(tok_logits.float().log_softmax(-1), inverse + 1, out_lens,
                         torch.tensor([len(b) for b in body]), blank=0, zero_infinity=True,
                         reduction="mean")
    phones = torch.tensor([p for ps in batch.phones for p in ps], device=dev)
    ctc_ph = F.ctc_loss(ph.float().log_softmax(-1), phones, 2 * out_lens,
                        torch.tensor([len(p) for p in batch.phones]), blank=0, zero_infinity=True,
                        reduction="mean")
    # match: each encoder row towards the embeddings of the phonemes its two slots hear (posterior-
    # weighted, fixed), the rows `pseudo_rows` builds from text
    with torch.no_grad():
        target = (ph.float().softmax(-1) @ model.ph_emb.weight.float()).view(T, 2, B, -1).sum(1)  # [T, B, hidden]
    valid = (torch.arange(T, device=dev)[:, None] < out_lens.to(dev)[None, :]).float()
    match = (((A.float() - target) ** 2).mean(-1) * valid).sum() / valid.sum()
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


def _corrupt(t: torch.Tensor, keep: int, p: float, n: int) -> torch.Tensor:
    """`t` with each token after the first `keep` replaced, with probability p, by a uniformly
    drawn trained-vocabulary row (the labels stay the true tokens)."""
    hit = torch.rand(t.shape, device=t.device) < p
    hit[:keep] = False
    return torch.where(hit, torch.randint(0, n, t.shape, device=t.device), t)


# --- the loop -----------------------------------------------------------------------------------


def train(opts: TrainOptions, log=print) -> Path:
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE))  # read at the first kernel
    torch.set_num_threads(opts.threads)
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
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
    config_name = "tiny" if opts.tiny else "synth-en"
    if saved is None and init is None and opts.warmstart is not None:
        saved = warm.load(opts.warmstart)
        if saved is not None and warm.config_of(saved["meta"]) != config_name:
            raise warm.WarmStartError(f"{opts.warmstart}: a {warm.config_of(saved['meta'])} state, this run trains "
                                      f"{config_name}")
        if saved is not None and not (out / "log.jsonl").exists():  # the curve goes on from the earlier sessions
            (out / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in warm.history(saved["meta"])))
    # the depth: --decoder-layers, else the saved run's own (grown once, it stays grown), else the config's
    depth = opts.decoder_layers or (growth.decoder_layers_of(saved["model"]) if saved else 0)
    layers = {"decoder_layers": depth} if depth else {}
    cfg = tiny_train_config(**layers) if opts.tiny else synth_en_config(**layers)
    grown = growth.fit(saved, cfg.text.num_hidden_layers) if saved else None
    prior = saved or init
    table: dict[str, int] = dict(prior["phones"]) if prior else phone_table_of(shards[:1])
    phone_chars = sorted(table, key=table.__getitem__)
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
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, betas=(0.9, 0.98), weight_decay=0.01, fused=True)
    step, rng, rewarm_from, frames_seen = 0, random.Random(opts.seed), None, 0
    machine = warm.machine_kind(opts.device)
    if saved:
        st = saved
        missing, _ = model.load_state_dict({k: v.to(opts.device) for k, v in st["model"].items()}, strict=False)
        step, frames_seen = st["step"], st.get("frames_seen", 0)
        if "rng" in st:
            rng.setstate(st["rng"])
        else:  # a warm-start state: a fresh RNG of its own for this step
            rng = random.Random(f"synth-en:{opts.seed}:resume:{step}")
        if "meta" in st:  # a warm-start state keeps no optimiser moments: a fresh AdamW, warmed up
            rewarm_from = step
            m = st["meta"]
            log(f"resumed at step {step} from the warm-start state {opts.warmstart} "
                f"({m.get('audio_hours_seen', 0)} h of audio seen; held-out WER {m.get('heldout_wer')} at step "
                f"{m.get('heldout_wer_step')}, on {m.get('machine')})")
        elif grown:  # the moments were of the shallower decoder: a fresh AdamW, warmed up
            rewarm_from = step
            log(f"resumed at step {step}")
        elif missing:  # a state from before these parameters: warm start, a fresh optimiser
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
    if grown:
        log(f"decoder grown from {grown[0]} to {grown[1]} layers at step {step}: zeroed copies of layers "
            f"{', '.join(map(str, growth.copied_after(*grown)))} (the same function; `growth.py`)")
    average = (WeightAverage(model, opts.average_decay, saved.get("average") if saved else None)
               if opts.average_decay > 0 else None)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{len(examples)} utterances, {sum(e.feats.shape[1] for e in examples) / 360000:.1f} h; "
        f"vocabulary {len(vocab)} rows; {len(phone_chars)} phonemes; {n_params / 1e6:.1f}M trained parameters")

    held = held_out_set(out, opts.eval_n, table)

    recipe = {"config": config_name, "seed": opts.seed, "lr": opts.lr, "hold_steps": opts.hold_steps,
              "batch_frames": opts.batch_frames, "source_weights": corpus.SOURCE_WEIGHTS,
              "w_ctc_tok": opts.w_ctc_tok, "w_ctc_ph": opts.w_ctc_ph, "w_match": opts.w_match,
              "w_text": opts.w_text, "w_guide": opts.w_guide, "guide_steps": opts.guide_steps,
              "corrupt": opts.corrupt, "vocab_rows": len(vocab), "piper_repeat": opts.piper_repeat,
              "prose_repeat": opts.prose_repeat, "freq_mask": opts.freq_mask, "time_mask": opts.time_mask,
              "tempo": opts.tempo, "tempo_local": opts.tempo_local, "vtlp": opts.vtlp,
              "average_decay": opts.average_decay, "text_batch": opts.text_batch,
              "decoder_layers": cfg.text.num_hidden_layers}

    def save():
        tmp = out / "state.pt.tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "rewarm_from": rewarm_from,
                    "schedule": [opts.lr, opts.hold_steps], "frames_seen": frames_seen, "machine": machine,
                    "recipe": recipe, "eval_n": opts.eval_n, "average": average.state_dict() if average else None,
                    "rng": rng.getstate(), "vocab": vocab.ids.tolist(), "phones": sorted(table.items())}, tmp)
        os.replace(tmp, state_path)

    stop = []  # SIGTERM / SIGINT: finish the step, save, stop

    def on_signal(signum, _frame):
        stop.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            signal.signal(sig, on_signal)
        except ValueError:  # not the main thread: no handler, the periodic saves remain
            pass
    bf16 = (opts.device.startswith("cuda") or warm.cpu_has_bf16()) if opts.bf16 is None else opts.bf16
    autocast = (torch.autocast(torch.device(opts.device).type, dtype=torch.bfloat16) if bf16 else nullcontext())

    @contextmanager
    def kernels():  # on the CPU, attention by SDPA's math backend: its backward beats the flash kernel's (-8% a step)
        with autocast, (sdpa_kernel([SDPBackend.MATH]) if opts.device == "cpu" else nullcontext()):
            yield

    def lr_at(s: int) -> float:
        return learning_rate(opts, s, rewarm_from)

    log_path = out / "log.jsonl"
    texts: list[TextExample] = []
    text_draws = text_batches(texts, rng, max(opts.text_batch, 1))
    text_paths: list[Path] = []
    last_save, t0, seen_frames = time.time(), time.time(), 0
    avg: dict[str, float] = {}
    evaluated = [-1]

    def measured():  # what is evaluated and exported: the weights' average (with --average-decay), else them
        return average.applied(model) if average else nullcontext()

    def evaluate_and_save() -> None:
        evaluated[0] = step
        model.eval()
        raw = {"heldout_wer_raw": round(evaluate(export_checkpoint(model, out / "checkpoint-raw"), held.feats,
                                                 held.refs)[0], 4)} if average else {}
        with measured():
            evaluate_measured(raw)
        save()

    def evaluate_measured(raw: dict[str, float]) -> None:
        ckpt = export_checkpoint(model, out / "checkpoint")
        w, hyps = evaluate(ckpt, held.feats, held.refs)
        gain = audio_gain(model, held.feats, [target_ids(tok, spell, r) for r in held.refs],
                          (prefix, suffix), len(target_prefix))
        ph_hyps = phoneme_hyps(model, held.feats)
        per = phoneme_rate(held.phones, ph_hyps)
        split = held_out_split(held.voices, held.sources, held.refs, hyps, held.phones, ph_hyps)
        rec = {"step": step, "time_s": round(time.time() - t0, 1), **{k: round(v, 4) for k, v in avg.items()},
               "heldout_wer": round(w, 4), **raw, "audio_gain": round(gain, 4), "heldout_per": round(per, 4),
               **{k: round(v, 4) for k, v in split.items()},
               "audio_h": round(frames_seen / 360000, 2),
               "audio_per_s": round(seen_frames / 100 / max(time.time() - t0, 1e-9), 1),
               "machine": machine, "date": time.strftime("%Y-%m-%d"), "example": hyps[0]}
        with log_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        (out / "heldout-hyps.tmp").write_text("".join(json.dumps(  # the last evaluation's, to read whole
            {"step": step, "source": s, "voice": v, "ref": r, "hyp": h}) + "\n" for s, v, r, h in
            zip(held.sources, held.voices, held.refs, hyps)))
        os.replace(out / "heldout-hyps.tmp", out / "heldout-hyps.jsonl")
        log(f"eval step {step}: held-out WER {w:.3f} PER {per:.3f} ({', '.join(f'{k[8:]} {v:.3f}' for k, v in split.items())})"
            + (f" (raw weights {raw['heldout_wer_raw']:.3f})" if raw else "") + f" | ref {held.refs[0]!r} | hyp {hyps[0]!r}")
        plot_curve(log_path, out / "curve.png")

    def take_new_texts() -> None:  # at a pass start and every evaluation (audio shards: a pass start)
        if new := [p for p in text_files(opts) if p not in text_paths]:
            texts.extend(load_texts(new, tok, table, spell, vocab))
            text_paths.extend(new)
            log(f"{len(new)} new text files: {len(texts)} texts without audio")

    def out_of_time() -> bool:
        return bool(stop) or (opts.time_limit_s is not None and time.time() - t0 > opts.time_limit_s)

    start_step = step
    while step < opts.steps and not out_of_time():
        more = [p for p in corpus_shards(opts) if p not in shards]
        if more:  # the corpus build goes on beside training: take new shards each pass
            examples += load_examples(more, tok, table, spell, vocab)
            shards += more
            log(f"{len(more)} new shards: {len(examples)} utterances")
        take_new_texts()
        max_frames = int(500 + min(1.0, step / max(opts.ramp_steps, 1)) * 1600)
        for group in batches(examples, rng, opts.batch_frames, max_frames, opts.piper_repeat, opts.prose_repeat):
            if step >= opts.steps or out_of_time():
                break
            model.train()
            feats = [augment(e.feats, rng, opts) for e in group]
            batch = Batch([torch.from_numpy(f).to(opts.device) for f in feats],
                          [e.target for e in group], [e.phones for e in group], len(target_prefix),
                          opts.corrupt, opts.w_guide if step < opts.guide_steps else 0.0,
                          [e.words for e in group])
            with kernels():
                parts = losses(model, batch, (prefix, suffix))
            loss = parts["ce"] + opts.w_ctc_tok * parts["ctc_tok"] + opts.w_ctc_ph * parts["ctc_ph"]
            loss = loss + opts.w_match * parts["match"]
            if "guide" in parts:
                loss = loss + batch.guide * parts["guide"]
            if texts and opts.w_text > 0 and opts.text_batch > 0:
                picked = next(text_draws)
                rows = pseudo_rows(model, [t.phones for t in picked], [t.words for t in picked], rng)
                text_batch = Batch([], [t.target for t in picked], [], len(target_prefix), opts.corrupt)
                with kernels():
                    parts["ce_text"] = losses(model, text_batch, (prefix, suffix), rows=rows)["ce"]
                loss = loss + opts.w_text * parts["ce_text"]
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if average:
                average.update(model)
            step += 1
            seen_frames += sum(e.feats.shape[1] for e in group)
            frames_seen += sum(e.feats.shape[1] for e in group)
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
                evaluate_and_save()
                take_new_texts()
                last_save = time.time()
            elif time.time() - last_save > opts.save_every_s:
                save()
                last_save = time.time()
    if step != evaluated[0] and (stop or step > start_step):  # stopped between evaluations: measure where it
        evaluate_and_save()                                    # stopped, so the state packed has its WER
        if stop:
            log(f"stopped by signal {stop[0]} at step {step}; state saved")
    save()
    with measured():
        return export_checkpoint(model, out / "checkpoint")
