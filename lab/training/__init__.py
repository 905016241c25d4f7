"""synth-en: harken's own small Qwen3-ASR, trained here on synthetic English speech.

Data flow, one module each:
    text.py        sentences (Debian fortunes, the KJV Bible, WordNet's examples, a meeting-sentence
                   generator) and the train / held-out split
    speech.py      voices (espeak-ng accents x variants, Piper joe), synthesis and augmentation
    corpus.py      utterance recipes -> audio -> exact edge log-mel, written to shards on disk
    pieces.py      the output vocabulary (1,714 of Qwen's tokens) that spells every text
    examples.py    shards and texts -> training examples and length-bucketed batches
    alignment.py   guided attention (CTC-aligned word rows)
    options.py     a run's options and learning-rate schedule
    train.py       `harken train synth-en OUTDIR` (torch): the model, its losses, the loop
    averaging.py   the weights' moving average; evaluation.py held-out WER, audio_gain, export
    state.py       the warm-start state committed in the repo (pack, resume)
    growth.py      a saved run's decoder made deeper without changing what it computes
    commands.py    the `train` and `eval` commands
    align_*.py, word_timing.py   synth-align, a forced aligner for word times
"""
