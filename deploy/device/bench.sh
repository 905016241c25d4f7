#!/usr/bin/env bash
# `make bench-device`: the serving figures on a lent GPU, in one device call of about 4 minutes.
#
# Run it on the device from the repo root (it needs nothing carried: the image's torch, numpy,
# onnxruntime, tokenizers, safetensors, pytest and matplotlib are all it uses; a `.device-carry`
# from `make device-carry`, if carried, is unpacked by setup.sh as for training):
#     bash deploy/device/bench.sh          (what `make bench-device` runs)
# Three steps, each under a hard cap (seconds, env TESTS_S / MODEL_S / LOAD_S), every one run even
# if an earlier one failed; what a cap cut is said in the summary:
#   1. the CUDA tests, tests/test_gpu.py -m gpu (`make test-gpu`'s; bf16 vs fp32, CUDA graphs ==
#      eager, static == plain events, batched == alone, incremental == full encode, transcript on
#      CUDA == on CPU)                                                        cap TESTS_S=50
#   2. `harken bench model --real-dims --device cuda`: encoder, prefill, decode steps at batch 1 to
#      256, plain and CUDA graphs                                              cap MODEL_S=60
#   3. `harken bench engine-load --device cuda`: the engine at the 0.6B dims (random bf16 weights),
#      N = 1, 8, 16, 64, 128, 256, 512 (more while the p95 holds) live streams paced in real time,
#      10 s of audio each; every listed level runs even after one fails; then 3 s at the largest
#      level that kept up (at most 64) under torch.profiler (the tick's time)  cap LOAD_S=130
# A shorter call (less device time left): e.g. TESTS_S=40 MODEL_S=30 LOAD_S=100 LEVELS=8,64,256,512
# (about 3 minutes); a level that would not fit its step's budget is cut, and said so.
# It writes to $OUT: bench-device.json (all of it: device, steps, tests, model, engine-load),
# engine-load.png (streams vs p95 update latency), device.txt, test-gpu.log, bench.log.
#
# TOY=1 runs the same steps at toy size on any machine (the CPU variants of one test, the tiny
# model, two levels of a few seconds): tests/test_device_bench.py runs it on the CPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/harken-out}
TOY=${TOY:-0}
CARRY=${CARRY:-.device-carry}
PREFIX=${PREFIX:-/tmp/harken-bench}  # not train.sh's: its wheels' marker must not be set by an empty carry
TESTS_S=${TESTS_S:-50}
MODEL_S=${MODEL_S:-60}
LOAD_S=${LOAD_S:-130}
LEVELS=${LEVELS:-1,8,16,64,128,256,512}  # engine-load's listed levels (fewer for a shorter call)
mkdir -p "$OUT" "$PREFIX"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "$PREFIX/run.XXXX")
t_start=$(date +%s)
[ -d "$CARRY" ] || { CARRY="$WORK/no-carry"; mkdir -p "$CARRY"; }
export PREFIX
# shellcheck source=deploy/device/setup.sh
source deploy/device/setup.sh "$CARRY" || { echo "bench-device: setup failed" >&2; exit 2; }
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

{
  echo "date: $(date -u +%FT%TZ)"
  echo "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
  "$PY" -c 'import torch; print("torch:", torch.__version__, "| cuda:", torch.version.cuda, "| device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")'
  echo "cores: $(nproc)"
  if git rev-parse --short HEAD >/dev/null 2>&1; then echo "git: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (with changes)')"; fi
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
} 2>&1 | tee "$OUT/device.txt"

if [ "$TOY" = 1 ]; then
  tests=(-m "not gpu" tests/test_gpu.py -k "buckets")
  model=(--tiny-only --quick --device cpu --threads 1)
  load=(--model tiny --device cpu --threads 1 --streams 1,2 --seconds 3 --drain-s 2 --no-more --keep-going --profile-s 2
        --time-budget-s "$(( LOAD_S - 10 ))")
else
  tests=(-m gpu tests/test_gpu.py)
  model=(--real-dims --device cuda)
  load=(--device cuda --streams "$LEVELS" --seconds 10 --keep-going --time-budget-s "$(( LOAD_S - 12 ))")
fi

# step NAME CAP CMD...: run under `timeout`, record status and seconds in $WORK/steps.tsv; its
# own lines go to fd 3 (this script's stdout) and bench.log, whatever the caller redirects
exec 3>&1
step() {
  local name=$1 cap=$2; shift 2
  local t0 rc
  t0=$(date +%s)
  echo "bench-device: $name (cap ${cap} s)" | tee -a "$OUT/bench.log" >&3
  timeout --kill-after=5 "$cap" "$@"
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$cap" >> "$WORK/steps.tsv"
  echo "bench-device: $name exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log" >&3
  return 0
}

step test-gpu "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider -rA "${tests[@]}" > "$OUT/test-gpu.log" 2>&1
tail -3 "$OUT/test-gpu.log"
step bench-model "$MODEL_S" "$PY" -m harken.cli bench model --json --out "$WORK/model.json" "${model[@]}" \
  > "$WORK/model.out" 2>> "$OUT/bench.log"
step engine-load "$LOAD_S" "$PY" -m harken.cli bench engine-load --json --out "$WORK/load" "${load[@]}" \
  > "$WORK/load.out" 2>> "$OUT/bench.log"
grep '^engine-load:' "$WORK/load.out" || true

"$PY" - "$WORK" "$OUT" "$t_start" <<'EOF'
import json, shutil, sys, time
from pathlib import Path

work, out, t_start = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
steps = {}
for line in (work / "steps.tsv").read_text().splitlines():
    name, rc, secs, cap = line.split("\t")
    rc = int(rc)
    steps[name] = {"exit": rc, "seconds": int(secs), "cap_s": int(cap),
                   "cut": rc in (124, 137) and f"killed at its {cap}-s cap: what it had not finished is missing"}

def last_json(path):
    try:
        lines = [l for l in path.read_text().splitlines() if l.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None

def whole_json(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None

log = (out / "test-gpu.log").read_text() if (out / "test-gpu.log").exists() else ""
summary = [l for l in log.splitlines() if " passed" in l or " failed" in l or " error" in l]
tests = {"summary": summary[-1].strip("= ") if summary else None,
         "passed": [l.split(" ", 1)[1] for l in log.splitlines() if l.startswith("PASSED ")],
         "failed": [l.split(" ", 1)[1] for l in log.splitlines() if l.startswith(("FAILED ", "ERROR "))]}
# the file (indented; rewritten after every level) keeps what ran when the cap cut the step; else
# the JSON it printed at the end
load = whole_json(work / "load" / "engine-load.json") or last_json(work / "load.out")
png = work / "load" / "engine-load.png"
if png.exists():
    shutil.copy(png, out / "engine-load.png")
device = (out / "device.txt").read_text().splitlines()
result = {"bench": "bench-device", "device": device, "steps": steps, "tests": tests,
          "model": whole_json(work / "model.json") or last_json(work / "model.out"), "engine_load": load,
          "wall_s": int(time.time()) - t_start}
(out / "bench-device.json").write_text(json.dumps(result, indent=1) + "\n")
print(f"bench-device: tests {tests['summary']}")
if load:
    for lv in load["levels"]:
        print(f"  N={lv['streams']:>5}  update p50/p95 {lv['p50_update_ms']}/{lv['p95_update_ms']} ms  "
              f"first partial p95 {lv['p95_first_partial_ms']} ms  busy {lv['busy_fraction']}  "
              f"gain {lv['batching_gain']}  {lv['mib_per_stream']} MiB/stream  {'ok' if lv['ok'] else 'NOT ok'}")
    print(f"  largest N with p95 update <= {load['target_p95_update_ms']:.0f} ms: {load['max_streams_ok']} "
          f"({load['gpu_s_per_stream_hour_at_max']} GPU-s per stream-hour); cut: {load['cut']}")
    prof = load.get("profile")
    if load.get("profile_error"):
        print(f"  profile failed: {load['profile_error']}")
    if prof:
        print(f"  profile at N={prof['streams']}: device kernels {prof['device_share_of_busy']} of the engine's busy time; "
              + ", ".join(f"{k} {v['cpu_ms']} ms" for k, v in prof["phases"].items()))
for name, s in steps.items():
    if s["exit"]:
        print(f"  step {name}: exit {s['exit']}{' (' + s['cut'] + ')' if s['cut'] else ''}")
sys.exit(0 if all(s["exit"] == 0 for s in steps.values()) and load and png.exists() else 1)
EOF
status=$?
echo "bench-device: done in $(( $(date +%s) - t_start )) s (exit $status); results in $OUT"
exit $status
