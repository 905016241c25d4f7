"""What one synth-en training run is told (`TrainOptions`: the recipe's knobs, sizes, where and how
long) and its learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path


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
    piper_repeat: int = 2  # Piper utterances this many times a pass (its phoneme error is 3x espeak-ng's)
    prose_repeat: int = 2  # fortunes and Bible utterances this many times a pass (`batches`)
    # SpecAugment (`examples.spec_augment`) on training audio: two frequency bands of up to `freq_mask`
    # mel bins; a stretch of up to `time_mask` frames every 2 s (30 from step 80,291 to 83,222: the
    # decoder learnt to guess what it did not hear, `audio_gain` fell 7.21 -> 6.47; off since); 0: none
    freq_mask: int = 16
    time_mask: int = 0
    # the pace (`examples.time_warp`): a tempo of 1 +- `tempo` over the utterance, times 1 +- `tempo_local`
    # every 0.25 s; the vocal tract (`examples.warp_vocal_tract`): frequencies scaled by 1 +- `vtlp`
    tempo: float = 0.1
    tempo_local: float = 0.15
    vtlp: float = 0.1
    average_decay: float = 0.999  # evaluate and export an average of the weights (`averaging.py`); 0: the raw ones
    w_guide: float = 1.0  # guided attention (`guided_attention_loss`) while step < guide_steps
    w_match: float = 0.1  # encoder rows towards their phonemes' embeddings
    w_text: float = 1.0  # transcripts of text without audio, read from `pseudo_rows`
    # texts without audio per step. 4 until step ~71,300; then 16: read from their own espeak-ng phonemes
    # (no encoder at all), held-out fortunes came out at 41% WER against 44% from the audio, and trained
    # ones at 27%, with each text seen less than once a session at 4 a step
    text_batch: int = 4
    # the learning rate falls linearly to 0 over the last `cooldown` steps before `steps` (a branch
    # of the run to measure or ship: the main run goes on at its schedule)
    cooldown: int = 0
    guide_steps: int = 12000
    tiny: bool = False
    decoder_layers: int | None = None  # None: a saved run's own depth, else the config's; a shallower saved run is grown
    max_shards: int | None = None
    device: str = "cpu"  # "cuda" when a GPU is lent: the same run in minutes
    init_from: Path | None = None  # a new run starts from another run's state.pt (`warm_start`)
    warmstart: Path | None = None  # else from a warm-start directory (`state.py`), e.g. the committed one
    time_limit_s: float | None = None  # stop (evaluate, save) after this long: a lent GPU's call ends
    bf16: bool | None = None  # autocast matrix products to bf16 (default: on CUDA, and on a CPU with bf16 units)
    whole_tokens: int = 1000  # `pieces.choose`: the output vocabulary synth-en writes with
    part_tokens: int = 600


def learning_rate(opts: TrainOptions, s: int, rewarm_from: int | None = None) -> float:
    """The learning rate at step `s`: a warm-up to `opts.lr`, held to `hold_steps`, then falling as
    1/sqrt(step); warmed up again from `rewarm_from` (a fresh optimiser or a new schedule); and with
    `cooldown`, linearly to 0 over the last `cooldown` steps before `opts.steps`."""
    lr = opts.lr * min((s + 1) / opts.warmup, 1.0, math.sqrt(max(opts.hold_steps, opts.warmup) / (s + 1)))
    if rewarm_from is not None:
        lr *= min(1.0, (s - rewarm_from + 1) / opts.warmup)
    if opts.cooldown > 0:
        lr *= min(1.0, max(0.0, (opts.steps - s) / opts.cooldown))
    return lr
