"""`harken train` and `harken eval`: the lab's training commands (registered by `harken.cli` where the
lab is, i.e. in a checkout)."""

from __future__ import annotations

import argparse

from harken.commands.options import Subparsers, given


# synth-en's corpus sizes beside --utterances (`commands.CORPUS_FILES`): flag, default, what it is
_CORPUS_SIZES = (
    ("--phrases", 20000, "short phrases (1-6 words of a training text) beside the utterances: where the decoder "
                         "first learns to find words in the audio"),
    ("--texts", 40000, "training texts without audio, as espeak-ng phonemes: the decoder reads them from "
                       "phoneme-embedding rows and learns words no utterance has spoken"),
    ("--jumbles", 8000, "jumbles: 3-12 words drawn from different training texts, in no predictable order, spoken "
                        "by espeak-ng voices: the decoder can only get them right by reading the audio"),
    ("--jumble-texts", 20000, "jumbles without audio, read from phoneme-embedding rows like --texts"),
    ("--prose-texts", 40000, "fortunes and Bible verses without audio (no meeting talk), read like --texts: open "
                             "text, where the decoder is weakest"),
    ("--prose-utterances", 8000, "utterances of the fortunes and the Bible only (shards prose-*), beside "
                                 "--utterances' mix with meeting talk: more open text spoken, where the model is "
                                 "weakest and had begun to learn its training texts by heart"),
    ("--wordnet-texts", 40000, "WordNet 3.0's usage examples without audio (Debian wordnet-base; ~47,000 distinct "
                               "sentences and phrases of everyday English), read like --texts: words and text the "
                               "other sources never had"),
    ("--wordnet-utterances", 4000, "utterances of WordNet's usage examples (shards wordnet-*)"),
    ("--manpage-texts", 0, "sentences of the manual pages without audio (/usr/share/man; ~29,000 plain "
                           "sentences of technical English, none an out-of-distribution source's), read like "
                           "--texts: phrasing none of the other sources has"),
)


_SIZE_NOTES = {"--phrases": ", ~8 h", "--jumbles": ", ~8 h", "--prose-utterances": ", ~14 h"}


def register_train(sub: Subparsers) -> None:
    s = sub.add_parser("train", help="train harken's own small model (synth-en) on synthetic speech",
                       description="Build the synthetic English corpus (espeak-ng voices and Piper joe, "
                                   "augmented; exact edge log-mel) under OUTDIR/corpus, then train the small "
                                   "Qwen3-ASR synth-en on it. Both steps resume where they stopped; the "
                                   "official-layout checkpoint is OUTDIR/checkpoint, the loss / held-out WER "
                                   "curve OUTDIR/curve.png.")
    s.add_argument("recipe", choices=["synth-en", "synth-align"],
                   help="what to train: synth-en (the recogniser) or synth-align (a Qwen3-ForcedAligner for it, on espeak-ng's word times; docs/word-timings.md)")
    s.add_argument("out", metavar="OUTDIR", help="output directory (corpus, state, checkpoint, log)")
    s.add_argument("--utterances", type=int, default=None,
                   help="corpus size (default 16000, ~25 h; synth-align: 1000 espeak-ng utterances)")
    for flag, default, text in _CORPUS_SIZES:
        s.add_argument(flag, type=int, default=default, help=f"{text} (default {default}{_SIZE_NOTES.get(flag, '')})")
    s.add_argument("--text-batch", type=int, default=4,
                   help="texts without audio per step, read by the decoder from rows made of their phonemes "
                        "(default 4; `make train` uses 16)")
    s.add_argument("--corpus", help="corpus directory (default OUTDIR/corpus)")
    s.add_argument("--steps", type=int, default=None, help="optimiser steps (default 20000; synth-align 2000)")
    s.add_argument("--batch-frames", type=int, default=None,
                   help="feature frames per step (default 4000 = 40 s; synth-align 3000)")
    s.add_argument("--eval-every", type=int, default=None,
                   help="held-out WER (synth-align: word-boundary error) every N steps (default 400; synth-align 200)")
    s.add_argument("--eval-n", type=int, default=40, help="held-out utterances in each evaluation (default 40)")
    s.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    s.add_argument("--workers", type=int, default=2, help="corpus synthesis processes (default 2)")
    s.add_argument("--seed", type=int, default=0, help="seed of the corpus and the model (default 0)")
    s.add_argument("--tiny", action="store_true", help="a tiny model (smoke tests)")
    s.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    s.add_argument("--init-from", metavar="STATE",
                   help="a new run starts from another run's OUTDIR/state.pt: every weight whose shape fits, "
                        "embedding rows by token id (ignored once OUTDIR/state.pt exists)")
    s.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3; synth-align 1e-3)")
    s.add_argument("--lr-hold", type=int, default=100,
                   help="steps the learning rate stays at its peak before it falls as 1/sqrt(step) (default "
                        "100); a resumed run whose --lr or --lr-hold changed warms up to the new schedule")
    s.add_argument("--warmstart", default="repo", metavar="DIR",
                   help="where a run with no OUTDIR/state.pt starts: 'repo' (default: the state committed in "
                        "lab/training/warmstart/, so training goes on across machines), a warm-start directory, "
                        "or 'none' (from scratch); with --pack, where to write")
    s.add_argument("--pack", action="store_true",
                   help="pack OUTDIR/state.pt and its evaluations into the warm-start files (bf16, zstd, at "
                        "most 16 MB; lab/training/warmstart/ unless --warmstart DIR) and stop")
    s.add_argument("--time-limit", type=float, metavar="S",
                   help="stop after S seconds of training: evaluate, save the state (a lent GPU's call ends)")
    s.add_argument("--save-every", type=float, default=300.0, metavar="S",
                   help="save OUTDIR/state.pt every S seconds besides each evaluation (default 300)")
    s.add_argument("--corpus-first", action="store_true",
                   help="a run that resumes (OUTDIR/state.pt or a warm-start state) builds whatever its corpus "
                        "lacks first, --workers files at a time, then trains on all of it, rather than "
                        "starting on the first shards while the rest are built (make train on a fresh machine)")
    s.add_argument("--no-build", action="store_true",
                   help="train on the shards already in the corpus directory and build nothing (a fresh "
                        "machine's session that has built most of the corpus and would rather spend its last "
                        "hours training; the rest is built by a later run)")
    s.add_argument("--corpus-only", action="store_true",
                   help="build the corpus and stop (training runs this in a process beside itself)")
    s.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="autocast the model's matrix products to bf16, softmaxes in fp32 (default: on with --device cuda and on a CPU with bf16 units, avx512_bf16 or amx_bf16)")
    s.add_argument("--piper-share", type=float, default=0.25,
                   help="share of utterances in the Piper voice (default 0.25; 0: espeak-ng voices only)")
    s.add_argument("--piper-repeat", type=int, default=2,
                   help="synth-en: the Piper voice's utterances this many times a pass (default 2: its "
                        "phoneme error is three times espeak-ng's, on training audio too)")
    s.add_argument("--prose-repeat", type=int, default=2,
                   help="synth-en: utterances of the fortunes and the Bible this many times a pass (default 2: "
                        "meeting talk is 55%% of the corpus and its language model drowns the rest)")
    s.add_argument("--freq-mask", type=int, default=16, metavar="BINS",
                   help="synth-en: SpecAugment on training audio, two bands of up to BINS of the 128 mel bins "
                        "(default 16; 0: none)")
    s.add_argument("--time-mask", type=int, default=0, metavar="FRAMES",
                   help="synth-en: SpecAugment on training audio, a stretch of up to FRAMES 10 ms frames every "
                        "2 s (default 0, none: with 30 the decoder learnt to guess what it did not hear)")
    s.add_argument("--tempo", type=float, default=0.1, metavar="X",
                   help="synth-en: each training utterance read at a pace of 1 +- X, drawn anew each time it is "
                        "seen (default 0.1; 0: its own)")
    s.add_argument("--tempo-local", type=float, default=0.15, metavar="X",
                   help="synth-en: and the pace moved by 1 +- X every 0.25 s (default 0.15; 0: even)")
    s.add_argument("--vtlp", type=float, default=0.1, metavar="X",
                   help="synth-en: vocal tract length perturbation, each training utterance's frequencies "
                        "scaled by 1 +- X (default 0.1; 0: none)")
    s.add_argument("--cooldown", type=int, default=0, metavar="N",
                   help="synth-en: the learning rate falls linearly to 0 over the last N steps before --steps "
                        "(a branch of a run, e.g. to measure what a cooldown gives before shipping; default 0)")
    s.add_argument("--decoder-layers", type=int, metavar="N",
                   help="the decoder's depth (default: the saved run's, else synth-en 6, --tiny 1); a saved run "
                        "with fewer layers is grown to N by zeroed copies of its layers, which compute the same "
                        "function, and goes on with a fresh optimiser")
    s.add_argument("--average-decay", type=float, default=0.999, metavar="D",
                   help="synth-en: evaluate, export and pack an exponential moving average of the weights "
                        "with this decay per step (default 0.999; 0: the raw weights)")
    s.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> int | None:
    if args.recipe == "synth-align":
        from harken.training.align_train import train_align_command

        return train_align_command(args.out, **given(args, utterances="utterances", steps="steps", lr="lr",
                                                      batch_frames="batch_frames", eval_every="eval_every"),
                                   eval_n=args.eval_n, threads=args.threads, workers=args.workers, seed=args.seed,
                                   tiny=args.tiny, device=args.device, time_limit=args.time_limit,
                                   init_from=args.init_from or (None if args.warmstart == "repo" else args.warmstart))
    for name, default in (("utterances", 16000), ("steps", 20000), ("batch_frames", 4000), ("eval_every", 400),
                          ("lr", 2e-3)):  # synth-en's defaults (the parser leaves them to the recipe)
        if getattr(args, name) is None:
            setattr(args, name, default)
    from harken.training.commands import train_command

    return train_command(args.out, utterances=args.utterances, corpus_dir=args.corpus, steps=args.steps,
                         phrases=args.phrases, texts=args.texts, jumbles=args.jumbles,
                         jumble_texts=args.jumble_texts, prose_texts=args.prose_texts,
                         prose_utterances=args.prose_utterances, wordnet_texts=args.wordnet_texts,
                         wordnet_utterances=args.wordnet_utterances,
                         manpage_texts=args.manpage_texts, text_batch=args.text_batch,
                         threads=args.threads, workers=args.workers, seed=args.seed, tiny=args.tiny,
                         eval_every=args.eval_every, eval_n=args.eval_n, batch_frames=args.batch_frames,
                         device=args.device, init_from=args.init_from, lr=args.lr,
                         lr_hold=args.lr_hold, warmstart=args.warmstart, pack=args.pack,
                         time_limit=args.time_limit, corpus_only=args.corpus_only,
                         save_every=args.save_every, piper_share=args.piper_share, bf16=args.bf16,
                         piper_repeat=args.piper_repeat, prose_repeat=args.prose_repeat,
                         freq_mask=args.freq_mask, time_mask=args.time_mask,
                         tempo=args.tempo, tempo_local=args.tempo_local, vtlp=args.vtlp,
                         corpus_first=args.corpus_first,
                         average_decay=args.average_decay, cooldown=args.cooldown,
                         decoder_layers=args.decoder_layers, no_build=args.no_build)


def register_eval(sub: Subparsers) -> None:
    s = sub.add_parser("eval", help="word error rate of a model on the synth-en held-out (or OOD) set",
                       description="Synthesise each held-out utterance from its recipe, compute the edge's "
                                   "log-mel, transcribe in one pass and score with jiwer after the Whisper "
                                   "English normaliser.")
    s.add_argument("--model", default="synth-en", help="checkpoint dir, Hugging Face id, 'tiny' or 'synth-en' "
                                                        "(default synth-en)")
    s.add_argument("--set", dest="held_set", default="held-out",
                   help="held-out (default: lab/training/heldout.jsonl, held-out sentences of the training "
                        "sources), ood (lab/training/ood.jsonl: text from sources training never reads, in the "
                        "held-out set's voices and conditions) or a JSONL file of recipes: lines like those "
                        "files', or a corpus shard's .jsonl (its training utterances, rendered again from their "
                        "recipes)")
    s.add_argument("-n", type=int, help="only the first N utterances")
    s.add_argument("--language", help="force the language (a name or code: English, en, en-US)")
    s.add_argument("--json", action="store_true",
                   help='print {"wer", "n_words", "wer_by_source", "wer_by_voice", ...}')
    s.add_argument("--hyps", dest="hyps_path", metavar="FILE",
                   help="write each utterance's source, voice, reference and hypothesis to FILE (JSONL)")
    s.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    s.add_argument("--dtype", help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    s.set_defaults(run=run_eval)


def run_eval(args: argparse.Namespace) -> int | None:
    from harken.training.commands import eval_command

    return eval_command(args.model, held_set=args.held_set, n=args.n, as_json=args.json,
                        device=args.device, dtype=args.dtype, language=args.language, hyps_path=args.hyps_path)
