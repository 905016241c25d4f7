"""synth-en: harken's own small Qwen3-ASR, trained here on synthetic English speech.

Data flow, one module each:
    text.py    sentences (Debian fortunes, the KJV Bible, a meeting-sentence generator) and the
               train / held-out split
    speech.py  voices (espeak-ng accents x variants, Piper joe), synthesis and augmentation
    corpus.py  utterance recipes -> audio -> exact edge log-mel, written to shards on disk
    train.py   `harken train synth-en OUTDIR` (torch)
    weights.py the shipped, compressed weights -> an official-layout checkpoint directory
"""
