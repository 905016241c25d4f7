"""`harken train synth-align OUTDIR`: a Qwen3-ForcedAligner for synth-en, trained on espeak-ng's word times.

Since the real aligner's weights cannot be fetched here, harken trains its own, in the official aligner
layout, so `harken align --model OUTDIR/checkpoint` and `harken serve --aligner` run it like the release:

- model: synth-en's network (`synth_en_config`; `--tiny`: the smoke tests' dims) with the aligner's
  classification head (`classify_num` 80-ms bins); encoder, decoder layers and embedding rows start from
  synth-en's warm-start state (lab/training/warmstart/, or `--init-from` a run's state.pt), the head fresh;
- data: espeak-ng utterances of the synth-en training recipes (`corpus.plan`, no Piper: it reports no
  word events), rendered with their augmentation, and each word's start and end from espeak-ng's own
  events (align_targets.py), in shards OUTDIR/align-corpus/align-NNNNN.{npz,jsonl};
- loss: at the two `<timestamp>` positions of each word, cross-entropy against a soft target (a Gaussian
  of 0.5 bins around the true time, so sub-bin timing still shapes the gradient);
- evaluation: the exported checkpoint, loaded by `Qwen3ForcedAligner.load` (the inference path), on the
  espeak-ng utterances of the held-out set: word-boundary error against espeak-ng's times, mean and 95th
  percentile in ms, beside an even-split baseline (words spread evenly over the speech).

OUTDIR/state.pt (model, optimiser, step) is saved at each evaluation; a rerun resumes from it.
OUTDIR/log.jsonl has one line per evaluation.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from harken.cloud.model.aligner import (TIMESTAMP_SEGMENT_MS, TIMESTAMP_TOKEN_ID, AlignRequest, Qwen3ForcedAligner,
                                        build_aligner_prompt, split_words)
from harken.cloud.model.config import Qwen3ASRConfig
from harken.cloud.model.decoder import DecoderLayer, Qwen3Decoder, precompute_rope, rope_inv_freq
from harken.cloud.model.encoder import AudioEncoder
from harken.cloud.model.tokenizer import Tokenizer
from harken.training import corpus, speech
from harken.training.align_targets import word_spans
from harken.shared.errors import HarkenError

SHARD = 200
SYNTH_CLASSIFY_NUM = 5000  # the release's 400 s of 80-ms bins: the same layout as Qwen3-ForcedAligner-0.6B
SIGMA_BINS = 0.5


@dataclass
class AlignTrainOptions:
    out: str
    utterances: int = 1000
    steps: int = 2000
    batch_frames: int = 3000
    lr: float = 1e-3
    warmup: int = 50
    eval_every: int = 200
    eval_n: int = 40
    threads: int = 2
    workers: int = 1
    seed: int = 0
    tiny: bool = False
    init_from: str | None = None  # a synth-en state.pt, "repo" (the committed warm start) or "none"
    time_limit: float | None = None
    device: str = "cpu"


# --- data ------------------------------------------------------------------------------------------------

def _item(seed: int, i: int) -> tuple[np.ndarray, dict] | None:
    u = corpus.plan(seed, i, piper_share=0.0)
    spans = word_spans(u.recipe)
    if not spans:
        return None
    feats = corpus.render_features(u.recipe)
    return feats.astype(np.float16), {"i": i, "text": u.recipe.text,
                                      "words": [[w.word, round(w.start_s, 4), round(w.end_s, 4)] for w in spans]}


def _build_shard(job: tuple[Path, int, int, int]) -> Path:
    path, seed, a, b = job
    items = [x for x in (_item(seed, i) for i in range(a, b)) if x is not None]
    feats = np.concatenate([f for f, _ in items], axis=1)
    lengths = np.array([f.shape[1] for f, _ in items], dtype=np.int32)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, feats=feats, lengths=lengths)
    (path.with_suffix(".jsonl.tmp")).write_text("\n".join(json.dumps(m, ensure_ascii=False) for _, m in items) + "\n",
                                                encoding="utf-8")
    os.replace(path.with_suffix(".jsonl.tmp"), path.with_suffix(".jsonl"))
    os.replace(tmp, path)
    return path


def build_align_corpus(cdir: Path, n: int, seed: int = 0, workers: int = 1, log=print) -> list[Path]:
    """Shards of `SHARD` utterances (resuming: finished shards are kept)."""
    cdir.mkdir(parents=True, exist_ok=True)
    jobs = [(cdir / f"align-{k:05d}.npz", seed, k * SHARD, min(n, (k + 1) * SHARD)) for k in range(-(-n // SHARD))]
    todo = [j for j in jobs if not j[0].exists()]
    if todo:
        log(f"align corpus: {len(todo)} shard(s) of up to {SHARD} espeak-ng utterances to synthesise in {cdir}")
        if workers > 1:
            from multiprocessing import get_context

            with get_context("spawn").Pool(workers) as pool:
                for p in pool.imap_unordered(_build_shard, todo):
                    log(f"align corpus: {p.name}")
        else:
            for j in todo:
                log(f"align corpus: {_build_shard(j).name}")
    return [j[0] for j in jobs]


@dataclass
class AlignExample:
    feats: np.ndarray  # [128, T] fp16
    words: list[str]
    times: list[float]  # 2 per word: start, end (s)


def load_align_corpus(paths: list[Path]) -> list[AlignExample]:
    out = []
    for p in paths:
        z = np.load(p)
        metas = [json.loads(line) for line in p.with_suffix(".jsonl").read_text(encoding="utf-8").splitlines() if line]
        off = 0
        for n, m in zip(z["lengths"].tolist(), metas):
            out.append(AlignExample(z["feats"][:, off:off + n], [w for w, _, _ in m["words"]],
                                    [t for _, a, b in m["words"] for t in (a, b)]))
            off += n
    return out


def batches(examples: list[AlignExample], rng: random.Random, batch_frames: int):
    """Endless batches of similar-length utterances, about `batch_frames` frames each."""
    order = sorted(range(len(examples)), key=lambda i: examples[i].feats.shape[1])
    groups: list[list[int]] = []
    cur: list[int] = []
    frames = 0
    for i in order:
        t = examples[i].feats.shape[1]
        if cur and frames + t > batch_frames:
            groups.append(cur)
            cur, frames = [], 0
        cur.append(i)
        frames += t
    if cur:
        groups.append(cur)
    while True:
        rng.shuffle(groups)
        yield from groups


# --- the model being trained -----------------------------------------------------------------------------

class AlignTrainee(nn.Module):
    """Encoder + decoder layers + the embedding rows of `vocab` + the classification head."""

    def __init__(self, cfg: Qwen3ASRConfig, vocab: list[int], classify_num: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.cfg = cfg
        self.vocab = sorted(set(vocab))
        self.row = {t: i for i, t in enumerate(self.vocab)}
        self.encoder = AudioEncoder(cfg.audio)
        dec = Qwen3Decoder(replace(cfg.text, vocab_size=1), tie_word_embeddings=True)
        self.layers = dec.model.layers
        self.norm = dec.model.norm
        self.emb = nn.Parameter(torch.randn(len(self.vocab), cfg.text.hidden_size) * 0.02)
        self.head = nn.Linear(cfg.text.hidden_size, classify_num, bias=False)
        nn.init.normal_(self.head.weight, 0.0, 0.02)

    def warm_start(self, state: dict) -> int:
        """synth-en's encoder, decoder layers, final norm and embedding rows (by token id); returns the
        number of tensors taken."""
        old = state["model"]
        own = self.state_dict()
        take = {k: v for k, v in old.items() if k in own and k not in ("emb",) and v.shape == own[k].shape}
        self.load_state_dict(take, strict=False)
        index = {t: i for i, t in enumerate(state["vocab"])}
        with torch.no_grad():
            for t, r in self.row.items():
                if t in index:
                    self.emb[r] = old["emb"][index[t]]
        return len(take)

    def rows(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([self.row[t] for t in ids], dtype=torch.long)

    def timestamp_logits(self, feats: list[torch.Tensor], prompts: list) -> torch.Tensor:
        """[sum of 2 * words, classify_num] at every <timestamp> position of the batch."""
        audio = self.encoder.encode_items(feats)
        embeds = []
        for p, a in zip(prompts, audio):
            e = self.emb[self.rows(p.ids).to(self.emb.device)]
            e = torch.cat([e[:p.audio_start], a.to(e.dtype), e[p.audio_start + p.audio_len:]])
            embeds.append(e)
        S = max(e.shape[0] for e in embeds)
        x = torch.stack([F.pad(e, (0, 0, 0, S - e.shape[0])) for e in embeds])  # right padding: causal-safe
        t = self.cfg.text
        pos = torch.arange(S, device=x.device).expand(len(embeds), S)
        cos, sin = precompute_rope(pos, rope_inv_freq(t.head_dim, t.rope_theta, x.device))
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            x = layer(x, cos, sin)
        h = self.norm(x)
        picks = torch.cat([h[b, torch.tensor(p.timestamp_index, device=h.device)] for b, p in enumerate(prompts)])
        return self.head(picks)


def soft_targets(times_s: list[float], classify_num: int, segment_ms: float = TIMESTAMP_SEGMENT_MS) -> torch.Tensor:
    """[len, classify_num]: a Gaussian of SIGMA_BINS bins around each time (in bins), normalised."""
    t = torch.tensor(times_s, dtype=torch.float32)[:, None] * 1000.0 / segment_ms
    b = torch.arange(classify_num, dtype=torch.float32)[None, :]
    w = torch.exp(-0.5 * ((b - t) / SIGMA_BINS) ** 2)
    return w / w.sum(-1, keepdim=True)


# --- export and evaluation -----------------------------------------------------------------------------

def export_aligner(model: AlignTrainee, out: Path, tokenizer_dir: Path) -> Path:
    """The official aligner layout: every embedding row the run did not train is zero."""
    from harken.cloud.model.tiny import official_shapes
    from harken.cloud.model.tiny_aligner import write_aligner_checkpoint

    cfg = model.cfg
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    w: dict[str, np.ndarray] = {}
    for k, v in sd.items():
        if k.startswith("encoder."):
            w["thinker.audio_tower." + k[len("encoder."):]] = v.numpy()
        elif k.startswith("layers.") or k.startswith("norm."):
            w["thinker.model." + k] = v.numpy()
    emb = np.zeros((cfg.text.vocab_size, cfg.text.hidden_size), dtype=np.float32)
    emb[np.array(model.vocab)] = sd["emb"].numpy()
    w["thinker.model.embed_tokens.weight"] = emb
    w["thinker.lm_head.weight"] = sd["head.weight"].numpy()
    missing = set(official_shapes(replace(cfg, tie_word_embeddings=True))) - set(w)
    if missing:
        raise AssertionError(f"export misses {sorted(missing)[:4]}")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for f in tokenizer_dir.iterdir():
        (tmp / f.name).write_bytes(f.read_bytes())
    write_aligner_checkpoint(tmp, w, cfg, model.head.out_features, vocab=None)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def held_out_items(n: int) -> list[tuple[np.ndarray, str, list[float]]]:
    """The first `n` espeak-ng utterances of the held-out set: (features, text, 2 times per unit)."""
    out: list[tuple[np.ndarray, str, list[float]]] = []
    for u in corpus.read_held_out():
        if len(out) >= n:
            break
        spans = word_spans(u.recipe)
        if not spans:
            continue
        text = " ".join(w.word for w in spans)
        out.append((corpus.render_features(u.recipe), text, [t for w in spans for t in (w.start_s, w.end_s)]))
    return out


def boundary_errors(aligner: Qwen3ForcedAligner, items, batch: int = 8) -> dict:
    """Word-boundary error (ms) of the aligner against espeak-ng's times, and of an even split."""
    errs, base = [], []
    for k in range(0, len(items), batch):
        chunk = items[k:k + batch]
        results = aligner.align_batch([AlignRequest(f, t) for f, t, _ in chunk])
        for (f, text, truth), words in zip(chunk, results):
            pred = [x for w in words for x in (w.start, w.end)]
            errs += [abs(p - t) * 1000 for p, t in zip(pred, truth)]
            a, b, n = truth[0], truth[-1], len(truth) // 2
            even = [a + (b - a) * (i + j) / n for i in range(n) for j in (0, 1)]  # first/last sound known
            base += [abs(p - t) * 1000 for p, t in zip(even, truth)]

    def stats(x):
        x = np.asarray(x)
        return {"mean_ms": round(float(x.mean()), 1), "p50_ms": round(float(np.percentile(x, 50)), 1),
                "p95_ms": round(float(np.percentile(x, 95)), 1)}

    return {"boundaries": len(errs), "utterances": len(items), **stats(errs),
            "even_split": stats(base)}


# --- training ------------------------------------------------------------------------------------------------

def _tokenizer_dir(out: Path) -> Path:
    from harken.cloud.model.tiny import write_tokenizer_files
    from harken.cloud.model.tiny_aligner import add_timestamp_token

    d = out / "tokenizer"
    if not (d / "tokenizer.json").exists():
        tmp = out / "tokenizer.tmp"
        write_tokenizer_files(tmp, "real")
        add_timestamp_token(tmp)
        os.replace(tmp, d)
    return d


def train_aligner(opts: AlignTrainOptions, log=print) -> dict:
    from harken.training import growth
    from harken.training import state as warm
    from harken.training.train import synth_en_config, tiny_train_config

    torch.set_num_threads(opts.threads)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    shards = build_align_corpus(out / "align-corpus", opts.utterances, opts.seed, opts.workers, log)
    examples = load_align_corpus(shards)
    if not examples:
        raise HarkenError("the align corpus is empty")
    tok = Tokenizer.from_dir(_tokenizer_dir(out))
    eval_items = held_out_items(opts.eval_n)
    word_ids = {t for ex in examples for w in ex.words for t in tok.encode(w)}
    word_ids |= {t for _, text, _ in eval_items for w in split_words(text) for t in tok.encode(w)}  # rows only
    specials = [tok.token_id(s) for s in ("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>")] + [TIMESTAMP_TOKEN_ID]

    init = None
    state_path = out / "state.pt"
    resume = torch.load(state_path, map_location="cpu", weights_only=False) if state_path.exists() else None
    if resume is None and not opts.tiny and opts.init_from != "none":
        init = warm.load() if opts.init_from in (None, "repo") else torch.load(opts.init_from, map_location="cpu",
                                                                                weights_only=False)
    depth = growth.decoder_layers_of((resume or init or {}).get("model", {}))  # synth-en's, however deep it grew
    layers = {"decoder_layers": depth} if depth else {}
    cfg = tiny_train_config(**layers) if opts.tiny else synth_en_config(**layers)
    vocab = sorted(word_ids | set(specials) | set(init["vocab"] if init else []) | set(resume["vocab"] if resume else []))
    model = AlignTrainee(cfg, vocab, SYNTH_CLASSIFY_NUM, opts.seed).to(opts.device)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.01)
    step, history = 0, []
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["optim"])
        step, history = resume["step"], resume.get("history", [])
        log(f"resumed at step {step}")
    elif init is not None:
        log(f"initialised {model.warm_start(init)} tensors from synth-en (step {init.get('step')})")
    log(f"{len(examples)} utterances ({sum(e.feats.shape[1] for e in examples) / 360000:.2f} h), "
        f"{sum(len(e.words) for e in examples)} words; {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        f"parameters; {len(eval_items)} held-out utterances")

    rng = random.Random(opts.seed + step)
    stream = batches(examples, rng, opts.batch_frames)

    def evaluate_and_save() -> dict:
        ckpt = export_aligner(model, out / "checkpoint", _tokenizer_dir(out))
        aligner = Qwen3ForcedAligner.load(str(ckpt), dtype="fp32", device=opts.device)
        row = {"step": step, "elapsed_s": round(time.monotonic() - t_start, 1),
               **boundary_errors(aligner, eval_items)}
        history.append(row)
        with open(out / "log.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        tmp = out / "state.pt.tmp"
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "vocab": model.vocab,
                    "history": history, "options": asdict(opts)}, tmp)
        os.replace(tmp, state_path)
        log(f"step {step}: boundary error mean {row['mean_ms']} ms, p95 {row['p95_ms']} ms "
            f"(even split: mean {row['even_split']['mean_ms']} ms, p95 {row['even_split']['p95_ms']} ms)")
        return row

    last = None
    model.train()
    t_loss, n_loss = 0.0, 0
    while step < opts.steps:
        if opts.time_limit is not None and time.monotonic() - t_start > opts.time_limit:
            log(f"time limit reached at step {step}")
            break
        idx = next(stream)
        exs = [examples[i] for i in idx]
        feats = [torch.from_numpy(e.feats.astype(np.float32)).to(opts.device) for e in exs]
        prompts = [build_aligner_prompt(tok, model.encoder.num_tokens(f.shape[1]), e.words, TIMESTAMP_TOKEN_ID)
                   for f, e in zip(feats, exs)]
        logits = model.timestamp_logits(feats, prompts)
        target = soft_targets([t for e in exs for t in e.times], SYNTH_CLASSIFY_NUM).to(logits.device)
        loss = -(target * logits.float().log_softmax(-1)).sum(-1).mean()
        lr = opts.lr * min(1.0, (step + 1) / opts.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, opts.steps)))))
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        t_loss, n_loss = t_loss + loss.item(), n_loss + 1
        if step % 20 == 0:
            log(f"step {step}: loss {t_loss / n_loss:.3f} lr {lr:.2e} ({time.monotonic() - t_start:.0f} s)")
            t_loss, n_loss = 0.0, 0
        if step % opts.eval_every == 0:
            model.eval()
            last = evaluate_and_save()
            model.train()
    model.eval()
    if last is None or last["step"] != step:
        last = evaluate_and_save()
    return last


def train_align_command(out: str, **kw) -> int:
    row = train_aligner(AlignTrainOptions(out=out, **kw), log=lambda m: print(f"synth-align: {m}", flush=True))
    print(json.dumps(row))
    return 0
