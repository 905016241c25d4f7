"""`harken train synth-en OUTDIR` and `harken eval`: the synth-en commands."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from harken.shared.errors import HarkenError


def train_command(out: str, utterances: int = 16000, corpus_dir: str | None = None, steps: int = 20000,
                  phrases: int = 20000, texts: int = 40000,
                  threads: int = 2, workers: int = 2, seed: int = 0, tiny: bool = False,
                  eval_every: int = 400, eval_n: int = 40, batch_frames: int = 4000,
                  device: str = "cpu", init_from: str | None = None, lr: float = 2e-3,
                  lr_hold: int = 100) -> int:
    """Build (or finish building) the corpus, then train (or resume training)."""
    from harken.cloud.synth import corpus
    from harken.cloud.synth.train import TrainOptions, train

    outdir = Path(out)
    cdir = Path(corpus_dir) if corpus_dir else outdir / "corpus"
    t0 = time.time()
    done = [0]
    total = -(-utterances // corpus.SHARD)

    def progress(path: Path) -> None:
        done[0] += 1
        print(f"corpus: {path.name} ({done[0]} new shards of at most {total}, {time.time() - t0:.0f} s)",
              file=sys.stderr, flush=True)

    print(f"corpus: {utterances} utterances in {cdir} (finished shards are kept)", file=sys.stderr)
    print(f"corpus: {phrases} phrases in {cdir}", file=sys.stderr)
    corpus.build(cdir, phrases, seed=seed, workers=workers, progress=progress, kind="phrase")
    corpus.build(cdir, utterances, seed=seed, workers=workers, progress=progress)
    print(f"corpus: {texts} texts without audio (espeak-ng phonemes only) in {cdir}", file=sys.stderr)
    corpus.build_text_phonemes(cdir, texts, seed=seed, progress=progress)
    opts = TrainOptions(corpus=cdir, out=outdir, steps=steps, threads=threads, seed=seed, tiny=tiny,
                        eval_every=eval_every, eval_n=eval_n, batch_frames=batch_frames,
                        device=device, init_from=Path(init_from) if init_from else None, lr=lr,
                        hold_steps=lr_hold)
    ckpt = train(opts, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(json.dumps({"checkpoint": str(ckpt), "log": str(outdir / "log.jsonl"),
                      "curve": str(outdir / "curve.png")}))
    return 0


def eval_command(model: str, held_set: str = "held-out", n: int | None = None, as_json: bool = False,
                 device: str | None = None, dtype: str | None = None, language: str | None = None) -> int:
    """Offline WER of a model on the held-out set (or a JSONL of recipes): the edge's exact log-mel
    of each synthesised utterance -> one greedy pass -> jiwer after the Whisper normaliser."""
    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.synth import corpus
    from harken.cloud.synth.evaluation import wer

    path = corpus.HELD_OUT_FILE if held_set == "held-out" else Path(held_set)
    if not path.exists():
        raise HarkenError(f"{path}: no such recipe file")
    items = corpus.read_held_out(path)[:n]
    asr = Qwen3ASR.load(model, dtype=dtype, device=device)
    refs, hyps, audio_s, t0 = [], [], 0.0, time.time()
    for i, u in enumerate(items):
        feats = corpus.render_features(u.recipe)
        audio_s += feats.shape[1] / 100
        hyps.append(asr.transcribe(feats, language=language).text)
        refs.append(u.recipe.text)
        if not as_json:
            print(f"[{i + 1}/{len(items)}] {hyps[-1]}", file=sys.stderr, flush=True)
    result: dict[str, Any] = {"model": model, "set": str(path) if held_set != "held-out" else "held-out",
              "n_utterances": len(items), "n_words": sum(len(r.split()) for r in refs),
              "audio_s": round(audio_s, 1), "wer": round(wer(refs, hyps), 4),
              "wer_by_source": {}, "seconds": round(time.time() - t0, 1)}
    for source in sorted({u.source for u in items}):
        idx = [i for i, u in enumerate(items) if u.source == source]
        result["wer_by_source"][source] = round(wer([refs[i] for i in idx], [hyps[i] for i in idx]), 4)
    if as_json:
        print(json.dumps(result))
    else:
        print(f"WER {100 * result['wer']:.2f}% on {result['n_utterances']} utterances "
              f"({result['n_words']} words); by source: "
              + ", ".join(f"{k} {100 * v:.1f}%" for k, v in result["wer_by_source"].items()))
    return 0
