# Sourced by deploy/device/train.sh and bench.sh: unpack what `make device-carry` gathered
# (deploy/device/carry.sh) into $PREFIX and export what the training path needs from it:
#   PY                 the device image's Python (/opt/torch/.venv/bin/python, else python3)
#   PATH               an espeak-ng wrapper first: the carried binary with its own libraries and
#                      data (LD_LIBRARY_PATH is set for espeak-ng alone, never for Python)
#   PYTHONPATH         the repo root and the carried wheels (when they are for this Python)
#   HARKEN_TEXT_DIR    the corpus text (fortune files, the KJV, WordNet's examples)
# Usage: source deploy/device/setup.sh CARRY_DIR
CARRY=$(cd "${1:?usage: source deploy/device/setup.sh CARRY_DIR}" && pwd)
PREFIX=${PREFIX:-/tmp/harken-device}
if [ -z "${PY:-}" ]; then
  if [ -x /opt/torch/.venv/bin/python ]; then PY=/opt/torch/.venv/bin/python; else PY=$(command -v python3); fi
fi
export PY
mkdir -p "$PREFIX/bin" "$PREFIX/root" "$PREFIX/site" "$PREFIX/texts"
REPO=$(pwd)

# the package's own links (harken/edge -> ../edge, ...) if the copy lost them
for d in edge cloud shared proto bench; do
  [ -e "harken/$d" ] || ln -sfn "../$d" "harken/$d"
done

# each part only where the carry has it: `make bench-device` needs none of them (an empty CARRY_DIR)
if { [ ! -x "$PREFIX/bin/espeak-ng" ] || { ls "$CARRY"/debs/libjemalloc2_*.deb >/dev/null 2>&1 &&
     [ ! -f "$PREFIX/root/usr/lib/x86_64-linux-gnu/libjemalloc.so.2" ]; }; } && ls "$CARRY"/debs/*.deb >/dev/null 2>&1; then
  for deb in "$CARRY"/debs/*.deb; do
    if command -v dpkg >/dev/null; then dpkg -x "$deb" "$PREFIX/root"; else "$PY" deploy/device/unpack.py deb "$deb" "$PREFIX/root"; fi
  done
fi
if [ -x "$PREFIX/root/usr/bin/espeak-ng" ]; then
  # libpulse0 keeps libpulsecommon in a private pulseaudio/ folder (its RUNPATH points at /usr, not the prefix)
  lib="$PREFIX/root/usr/lib/x86_64-linux-gnu:$PREFIX/root/usr/lib/x86_64-linux-gnu/pulseaudio:$PREFIX/root/lib/x86_64-linux-gnu"
  cat > "$PREFIX/bin/espeak-ng" <<WRAP
#!/bin/sh
LD_LIBRARY_PATH="$lib" ESPEAK_DATA_PATH="$PREFIX/root/usr/lib/x86_64-linux-gnu" exec "$PREFIX/root/usr/bin/espeak-ng" "\$@"
WRAP
  chmod +x "$PREFIX/bin/espeak-ng"
fi
export PATH="$PREFIX/bin:$PATH"

wheel_tag=$(ls "$CARRY"/wheels/*-cp3*-cp3*.whl 2>/dev/null | head -1 | sed -E 's/.*-(cp3[0-9]+)-cp3[0-9]+-.*/\1/')
py_tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if [ -z "$wheel_tag" ] || [ "$wheel_tag" = "$py_tag" ]; then
  if [ ! -f "$PREFIX/site/.done" ]; then
    for whl in "$CARRY"/wheels/*.whl; do
      if [ -e "$whl" ]; then "$PY" deploy/device/unpack.py wheel "$whl" "$PREFIX/site"; fi
    done
    touch "$PREFIX/site/.done"
  fi
  export PYTHONPATH="$REPO:$PREFIX/site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "setup: the carried wheels are for $wheel_tag, this Python is $py_tag: using its own packages" >&2
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi

if [ ! -f "$PREFIX/texts/wordnet.txt" ] && [ -f "$CARRY/texts.tar.xz" ]; then tar -C "$PREFIX/texts" -xJf "$CARRY/texts.tar.xz"; fi
export HARKEN_TEXT_DIR="$PREFIX/texts"
