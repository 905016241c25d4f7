#!/usr/bin/env bash
# `make train-device`: synth-en training on a lent GPU, in one device call of at most 10 minutes.
#
# Run it on the device from the repo root with `.device-carry` carried (`make device-carry` here):
#     bash deploy/device/train.sh          (what `make train-device` runs)
# It unpacks espeak-ng, the wheels and the texts (setup.sh), builds an espeak-ng corpus with all
# but two cores beside training, trains in bf16 from the warm-start state committed in the repo
# for TRAIN_S seconds, evaluates held-out WER, and writes to $OUT (at most 8 files):
#     warmstart/state.safetensors.zst, warmstart/state.json   the new warm-start state (packed every
#                                                             minute, so a cut-short call still has one)
#     train.log  log.jsonl  device.txt
# Commit what comes back with `cp $FILES_AT/warmstart/* lab/training/warmstart/`.
#
# TOY=1 runs the same path at toy size on any machine (the tiny model, a few utterances, a few
# steps; WARMSTART=DIR a toy state to resume): tests/test_device_train.py runs it on the CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/harken-out}
CARRY=${CARRY:-.device-carry}
TOY=${TOY:-0}
TRAIN_S=${TRAIN_S:-400}  # 330 s ran whole in 479 s on the first GPU call (2026-11-28): 400 ends near 550 of its 590
EVAL_N=${EVAL_N:-40}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
t_start=$(date +%s)
# shellcheck source=deploy/device/setup.sh
source deploy/device/setup.sh "$CARRY"
RUN=${RUN:-$PREFIX/run}
mkdir -p "$RUN"
cp "$CARRY"/heldout-*.npz "$RUN/"  # the held-out features, rendered here with the Piper voice the device lacks

device=$("$PY" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')
cores=$(nproc)
{
  echo "date: $(date -u +%FT%TZ)"
  echo "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
  "$PY" -c 'import torch; print("torch:", torch.__version__, "| device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")'
  echo "cores: $cores"
  echo "espeak-ng: $(command -v espeak-ng) ($(espeak-ng --version | head -1))"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
} | tee "$OUT/device.txt"
espeak-ng -q -x "the device speaks" >/dev/null  # fail here, clearly, if the carried espeak-ng cannot run

if [ "$TOY" = 1 ]; then
  args=(--tiny --warmstart "${WARMSTART:-none}" --utterances 6 --phrases 3 --texts 5 --jumbles 2 --jumble-texts 3 --prose-texts 2 --prose-utterances 2 --wordnet-texts 2 --wordnet-utterances 2 --steps "${STEPS:-2}" --piper-share 0 --bf16
        --eval-every 1000 --eval-n "$EVAL_N" --threads 1 --workers 1 --batch-frames 3000 --save-every 1)
else
  workers=$(( cores > 4 ? cores - 2 : 2 ))
  args=(--warmstart "${WARMSTART:-repo}" --utterances 60000 --phrases 20000 --texts 40000 --text-batch 64 --piper-share 0
        --workers "$workers" --threads 2 --batch-frames "${BATCH_FRAMES:-16000}" --lr 1e-3 --lr-hold 5000
        --eval-every 1000000 --eval-n "$EVAL_N" --steps 10000000 --save-every 60 --time-limit "$TRAIN_S")
fi

pack() { "$PY" -m harken.cli train synth-en "$RUN" --pack --warmstart "$OUT/warmstart" > "$OUT/pack.json.tmp" && mv "$OUT/pack.json.tmp" "$RUN/pack.json"; }
( while sleep 60; do [ -f "$RUN/state.pt" ] && pack 2>>"$RUN/pack.log" || true; done ) &
packer=$!
trap 'kill $packer 2>/dev/null || true' EXIT

echo "train-device: $device, ${cores} cores, $(( $(date +%s) - t_start )) s of setup; $([ "$TOY" = 1 ] && echo "toy run" || echo "training for ${TRAIN_S} s")" | tee -a "$OUT/device.txt"
status=0
# jemalloc for the trainer (glibc's malloc made CPU steps 1.7x slower), where the carry has it and it loads
malloc=()
jemalloc="$PREFIX/root/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
if [ -f "$jemalloc" ] && LD_PRELOAD="$jemalloc" "$PY" -c \
     'import sys, torch; sys.exit("libjemalloc" not in open("/proc/self/maps").read())' 2>/dev/null; then
  malloc=(env "LD_PRELOAD=$jemalloc")  # the trainer and its corpus builder
fi
echo "train-device: allocator $([ ${#malloc[@]} -gt 0 ] && echo jemalloc || echo "glibc malloc")" | tee -a "$OUT/device.txt"
"${malloc[@]}" "$PY" -m harken.cli train synth-en "$RUN" --device "$device" "${args[@]}" 2>&1 | tee "$OUT/train.log" || status=$?
kill $packer 2>/dev/null || true
wait $packer 2>/dev/null || true
pack
cp "$RUN/log.jsonl" "$OUT/"
cat "$RUN/pack.json"
echo "train-device: done in $(( $(date +%s) - t_start )) s (training exit $status)" | tee -a "$OUT/device.txt"
exit $status
