#!/usr/bin/env bash
# Regenerates sample.wav: three espeak-ng sentences with pauses, light white noise, 16 kHz PCM16.
set -euo pipefail
t=$(mktemp -d); trap 'rm -rf "$t"' EXIT
espeak-ng -v en-us -s 150 -w "$t/s1.wav" "Good morning everyone. Let's start the weekly meeting with a quick update on the streaming service."
espeak-ng -v en-us -s 150 -w "$t/s2.wav" "The new encoder cache keeps the cost of every update flat, even after an hour of talking."
espeak-ng -v en-us -s 150 -w "$t/s3.wav" "Next week we will test the mobile client on a slow network."
sox -n -r 22050 -c 1 "$t/sil.wav" trim 0.0 1.2
sox -n -r 22050 -c 1 "$t/sil0.wav" trim 0.0 0.6
sox "$t/sil0.wav" "$t/s1.wav" "$t/sil.wav" "$t/s2.wav" "$t/sil.wav" "$t/s3.wav" "$t/sil0.wav" -r 16000 -b 16 "$t/clean.wav"
sox "$t/clean.wav" -p synth whitenoise vol 0.003 | sox -m "$t/clean.wav" - -b 16 "$(dirname "$0")/sample.wav"
