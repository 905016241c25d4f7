"""`harken train synth-en OUTDIR` and `harken eval`: the synth-en commands."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harken.shared.errors import HarkenError


def jemalloc_loaded() -> bool:
    """Whether this process runs on jemalloc (mapped, not merely named in LD_PRELOAD)."""
    try:
        return "libjemalloc" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def train_command(out: str, utterances: int = 16000, corpus_dir: str | None = None, steps: int = 20000,
                  phrases: int = 20000, texts: int = 40000, jumbles: int = 8000, jumble_texts: int = 20000,
                  prose_texts: int = 40000, prose_utterances: int = 8000, wordnet_texts: int = 40000,
                  wordnet_utterances: int = 4000, manpage_texts: int = 0, threads: int = 2, workers: int = 2, seed: int = 0, tiny: bool = False,
                  eval_every: int = 400, eval_n: int = 40, batch_frames: int = 4000,
                  device: str = "cpu", init_from: str | None = None, lr: float = 2e-3,
                  lr_hold: int = 100, warmstart: str | None = "repo", pack: bool = False,
                  time_limit: float | None = None, corpus_only: bool = False, save_every: float = 300.0,
                  piper_share: float = 0.25, bf16: bool | None = None, piper_repeat: int = 2,
                  prose_repeat: int = 2, average_decay: float = 0.999, corpus_first: bool = False,
                  text_batch: int = 4, cooldown: int = 0, decoder_layers: int | None = None,
                  no_build: bool = False, freq_mask: int = 16, time_mask: int = 0,
                  tempo: float = 0.1, tempo_local: float = 0.15, vtlp: float = 0.1) -> int:
    """Build the corpus in a process beside training (training starts on the first shards), then
    train (or resume training: OUTDIR/state.pt, else the warm-start state committed in the repo).
    `corpus_first`: a run that resumes builds whatever the corpus lacks first, `workers` files at a
    time, and trains on all of it. `no_build`: train on the shards already built, build nothing.
    `pack`: OUTDIR/state.pt -> the repo's warm-start files, nothing else."""
    from harken.training import corpus
    from harken.training import state as warm

    outdir = Path(out)
    for flag, n in (("--piper-repeat", piper_repeat), ("--prose-repeat", prose_repeat)):
        if n < 1:
            raise HarkenError(f"{flag} {n}: each utterance at least once a pass (>= 1)")
    if cooldown < 0 or cooldown > steps:
        raise HarkenError(f"--cooldown {cooldown}: steps before --steps {steps} over which the learning rate "
                          "falls to 0 (0 <= N <= --steps)")
    for flag, n in (("--freq-mask", freq_mask), ("--time-mask", time_mask)):
        if n < 0:
            raise HarkenError(f"{flag} {n}: the widest mask (>= 0; 0: none)")
    for flag, x in (("--tempo", tempo), ("--tempo-local", tempo_local), ("--vtlp", vtlp)):
        if not 0.0 <= x < 0.5:
            raise HarkenError(f"{flag} {x}: the largest relative change, in [0, 0.5) (0: none)")
    if decoder_layers is not None and decoder_layers < 1:
        raise HarkenError(f"--decoder-layers {decoder_layers}: at least 1")
    if text_batch < 0:
        raise HarkenError(f"--text-batch {text_batch}: texts without audio per step (>= 0; 0: none)")
    if not 0.0 <= average_decay < 1.0:
        raise HarkenError(f"--average-decay {average_decay}: a decay per step in [0, 1) (0: no average)")
    if no_build and (corpus_first or corpus_only):
        raise HarkenError("--no-build trains on the corpus as it is: not with --corpus-first or --corpus-only")
    if pack:
        target = Path(warmstart) if warmstart not in (None, "repo", "none") else warm.WARMSTART_DIR
        print(json.dumps(warm.pack_run(outdir, target)))
        return 0
    cdir = Path(corpus_dir) if corpus_dir else outdir / "corpus"
    sizes = {"utterances": utterances, "phrases": phrases, "texts": texts, "jumbles": jumbles,
             "jumble_texts": jumble_texts, "prose_texts": prose_texts, "prose_utterances": prose_utterances,
             "wordnet_texts": wordnet_texts, "wordnet_utterances": wordnet_utterances,
             "manpage_texts": manpage_texts}
    if corpus_only:
        build_corpus(cdir, sizes, seed, workers, piper_share)
        return 0
    from harken.training.options import TrainOptions
    from harken.training.train import train

    # glibc's malloc made CPU steps ~1.7x slower than jemalloc once the heap holds the corpus (Makefile `train`)
    print("allocator: " + ("jemalloc" if jemalloc_loaded() else
                           "glibc malloc (LD_PRELOAD=libjemalloc.so.2, as `make train` sets it, makes CPU steps "
                           "~1.7x faster)"), file=sys.stderr, flush=True)
    ws: Path | None = None
    if warmstart == "repo":
        ws = None if tiny else warm.WARMSTART_DIR
    elif warmstart not in (None, "none"):
        ws = Path(warmstart)
    meta = warm.read_meta(ws) if ws is not None and not (outdir / "state.pt").exists() else None
    if meta is not None and warm.config_of(meta) != ("tiny" if tiny else "synth-en"):  # before any corpus work
        raise warm.WarmStartError(f"{ws}: a {warm.config_of(meta)} state, this run trains "
                                  f"{'tiny' if tiny else 'synth-en'}")
    # a run that goes on from a state knows its phoneme table: it may start on the first phrases
    resuming = (outdir / "state.pt").exists() or bool(init_from) or meta is not None
    if corpus_first and resuming and not _corpus_complete(cdir, sizes):
        # a trained model that starts on the first shards goes round their ~2 h of audio again and
        # again while the rest is built (at step 39,200 the raw weights' 40-utterance WER went from
        # ~38% to 42% in 400 such steps, with a fresh optimiser); built first, the run sees it all
        print("corpus: building what is missing before training resumes (--corpus-first)", file=sys.stderr,
              flush=True)
        build_corpus(cdir, sizes, seed, workers, piper_share)
    if no_build and not corpus.shard_path(cdir, "train", 0).exists():
        raise HarkenError(f"--no-build: {cdir} has no utterance shard yet (train without --no-build to build it)")
    builder = None if no_build else _start_corpus_builder(out, cdir, sizes, seed, workers, piper_share)
    try:
        _wait_for_first_shards(cdir, builder, sizes, any_shard=resuming or no_build)
        opts = TrainOptions(corpus=cdir, out=outdir, steps=steps, threads=threads, seed=seed, tiny=tiny,
                            eval_every=eval_every, eval_n=eval_n, batch_frames=batch_frames,
                            device=device, init_from=Path(init_from) if init_from else None, lr=lr,
                            hold_steps=lr_hold, warmstart=ws, time_limit_s=time_limit,
                            save_every_s=save_every, bf16=bf16, piper_repeat=piper_repeat,
                            prose_repeat=prose_repeat, average_decay=average_decay, text_batch=text_batch,
                            cooldown=cooldown, decoder_layers=decoder_layers, freq_mask=freq_mask,
                            time_mask=time_mask, tempo=tempo, tempo_local=tempo_local, vtlp=vtlp)
        ckpt = train(opts, log=lambda s: print(s, file=sys.stderr, flush=True))
    finally:
        if builder is not None and builder.poll() is None:
            builder.terminate()  # shards are written whole: the next run takes up where this one stopped
            builder.wait()
    print(json.dumps({"checkpoint": str(ckpt), "state": str(outdir / "state.pt"), "log": str(outdir / "log.jsonl"),
                      "curve": str(outdir / "curve.png")}))
    return 0


# each size of the corpus: (family, kind) of its files (`corpus.corpus_file`)
CORPUS_FILES = {"phrases": ("shard", "phrase"), "utterances": ("shard", "train"), "jumbles": ("shard", "jumble"),
                "texts": ("text", "text"), "jumble_texts": ("text", "jumble"), "prose_texts": ("text", "prose"),
                "prose_utterances": ("shard", "prose"), "wordnet_texts": ("text", "wordnet"),
                "wordnet_utterances": ("shard", "wordnet"), "manpage_texts": ("text", "manpage")}


def corpus_plan(sizes: dict[str, int]) -> list[tuple[str, str, int, int]]:
    """Every file of the corpus (`corpus.build_files`' tuples), the first of each kind first (what
    training starts on), then the rest interleaved in proportion (round j of R takes the first
    ceil(j N / R) files of each kind), so a trainer that starts on the first shards sees every kind
    grow rather than all phrases first, and a pool of workers has every kind to work on."""
    from harken.training import corpus

    per = {"shard": corpus.SHARD, "text": corpus.TEXT_LINES}
    n_files = {k: -(-sizes.get(k, 0) // per[family]) for k, (family, _) in CORPUS_FILES.items()}
    rounds = max(1, *n_files.values())
    files: list[tuple[str, str, int, int]] = []
    taken = dict.fromkeys(CORPUS_FILES, 0)
    for j in range(1, rounds + 1):
        for size, (family, kind) in CORPUS_FILES.items():
            upto = -(-j * n_files[size] // rounds)
            files += [(family, kind, k, sizes[size]) for k in range(taken[size], upto)]
            taken[size] = upto
    return files


def build_corpus(cdir: Path, sizes: dict[str, int], seed: int, workers: int, piper_share: float = 0.25) -> None:
    """The whole corpus in `corpus_plan`'s order, `workers` files at a time (finished files are kept)."""
    from harken.training import corpus

    t0 = time.time()
    done = [0]

    def progress(path: Path) -> None:
        done[0] += 1
        print(f"corpus: {path.name} ({done[0]} new files, {time.time() - t0:.0f} s)", file=sys.stderr, flush=True)

    print(f"corpus: {sizes['utterances']} utterances, {sizes.get('prose_utterances', 0)} prose utterances, "
          f"{sizes['phrases']} phrases, {sizes['jumbles']} jumbles, {sizes['texts']} texts, "
          f"{sizes['jumble_texts']} jumbles, {sizes['prose_texts']} prose and {sizes.get('wordnet_texts', 0)} "
          f"WordNet texts without audio, {sizes.get('wordnet_utterances', 0)} WordNet utterances, "
          f"{sizes.get('manpage_texts', 0)} manual-page texts without audio in {cdir} "
          f"({workers} at a time; finished files are kept)", file=sys.stderr, flush=True)
    corpus.build_files(cdir, corpus_plan(sizes), seed, workers, progress, piper_share)


def _corpus_complete(cdir: Path, sizes: dict[str, int]) -> bool:
    from harken.training import corpus

    return all(corpus.corpus_file(cdir, family, kind, k).exists() for family, kind, k, _ in corpus_plan(sizes))


def _start_corpus_builder(out: str, cdir: Path, sizes: dict[str, int], seed: int, workers: int,
                          piper_share: float) -> subprocess.Popen | None:
    """`harken train synth-en OUT --corpus-only` in a process of its own (its log beside the run), or
    None when the corpus is complete."""
    if _corpus_complete(cdir, sizes):
        return None
    cdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "harken.cli", "train", "synth-en", out, "--corpus-only", "--corpus", str(cdir),
           "--utterances", str(sizes["utterances"]), "--phrases", str(sizes["phrases"]),
           "--texts", str(sizes["texts"]), "--jumbles", str(sizes["jumbles"]),
           "--jumble-texts", str(sizes["jumble_texts"]), "--prose-texts", str(sizes["prose_texts"]),
           "--prose-utterances", str(sizes.get("prose_utterances", 0)),
           "--wordnet-texts", str(sizes.get("wordnet_texts", 0)),
           "--wordnet-utterances", str(sizes.get("wordnet_utterances", 0)),
           "--seed", str(seed), "--workers", str(workers), "--piper-share", str(piper_share)]
    log = open(cdir / "build.log", "a")  # noqa: SIM115 (the child holds it)
    print(f"corpus: building in the background (log: {cdir / 'build.log'}); training starts on its first "
          f"shards", file=sys.stderr, flush=True)
    # at the trainer's own priority: under SCHED_IDLE (before 2026-11-27) the trainer's two threads
    # left it so little of a 2-core machine that the first utterance shard took 11 minutes and the
    # whole corpus most of a session, while the trainer went round the first 2 h of audio again and
    # again (held-out WER 84% -> 89% in 280 steps). Sharing the cores, the corpus is whole within
    # the session's first hour and the trainer sees all of it.
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _wait_for_first_shards(cdir: Path, builder: subprocess.Popen | None, sizes: dict[str, int],
                           any_shard: bool = False) -> None:
    """Until the first shards exist: the first phrase shard and the first utterance shard (a new run
    reads its phoneme table from the latter), or (`any_shard`) whichever comes first."""
    from harken.training import corpus

    need = [corpus.shard_path(cdir, "train", 0)] + ([corpus.shard_path(cdir, "phrase", 0)] if sizes["phrases"] else [])

    def ready() -> bool:
        return any(p.exists() for p in need) if any_shard else all(p.exists() for p in need)

    while not ready():
        if builder is not None and builder.poll() is not None and not ready():
            raise HarkenError(f"the corpus build stopped (exit {builder.returncode}) before its first shards; "
                              f"see {cdir / 'build.log'}")
        time.sleep(1.0)


def eval_command(model: str, held_set: str = "held-out", n: int | None = None, as_json: bool = False,
                 device: str | None = None, dtype: str | None = None, language: str | None = None,
                 hyps_path: str | None = None) -> int:
    """Offline WER of a model on the held-out set ("held-out"), the out-of-distribution set ("ood":
    text no training source has, in the held-out set's voices) or a JSONL of recipes: the edge's exact log-mel
    of each synthesised utterance -> one greedy pass -> jiwer after the Whisper normaliser; by text
    source and by voice family (espeak-ng, piper), each utterance's hypothesis to `hyps_path`."""
    from harken.cloud.model.asr import Qwen3ASR
    from harken.training import corpus, ood, speech
    from harken.training.evaluation import wer

    named = {"held-out": corpus.HELD_OUT_FILE, "ood": ood.OOD_FILE}  # the sets in the repo, by name
    path = named[held_set] if held_set in named else Path(held_set)
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
    result: dict[str, Any] = {"model": model, "set": held_set if held_set in named else str(path),
              "n_utterances": len(items), "n_words": sum(len(r.split()) for r in refs),
              "audio_s": round(audio_s, 1), "wer": round(wer(refs, hyps), 4),
              "wer_by_source": {}, "wer_by_voice": {}, "seconds": round(time.time() - t0, 1)}
    voices = ["piper" if u.recipe.voice == speech.PIPER else "espeak-ng" for u in items]
    for key, groups in (("wer_by_source", [u.source for u in items]), ("wer_by_voice", voices)):
        for group in sorted(set(groups)):
            idx = [i for i, g in enumerate(groups) if g == group]
            result[key][group] = round(wer([refs[i] for i in idx], [hyps[i] for i in idx]), 4)
    if hyps_path:
        Path(hyps_path).write_text("".join(json.dumps({"source": u.source, "voice": v, "ref": r, "hyp": h}) + "\n"
                                           for u, v, r, h in zip(items, voices, refs, hyps)), encoding="utf-8")
    if as_json:
        print(json.dumps(result))
    else:
        print(f"WER {100 * result['wer']:.2f}% on {result['n_utterances']} utterances "
              f"({result['n_words']} words); by source: "
              + ", ".join(f"{k} {100 * v:.1f}%" for k, v in result["wer_by_source"].items())
              + "; by voice: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in result["wer_by_voice"].items()))
    return 0
