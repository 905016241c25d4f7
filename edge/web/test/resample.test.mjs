// The capture worklet's resampler (src/resample.ts): a known signal at device rates comes out at
// 16 kHz as the same signal; pushed in pieces or whole gives the same samples; the sample count is
// the input's duration at 16 kHz.
import assert from "node:assert/strict";
import { test } from "node:test";

import { StreamingResampler } from "../dist/node/index.js";

function sine(rate, seconds, hz, amp) {
  return Float32Array.from({ length: Math.round(rate * seconds) }, (_, i) => amp * Math.sin((2 * Math.PI * hz * i) / rate));
}

function run(r, x, piece) {
  const out = [];
  for (let i = 0; i < x.length; i += piece) out.push(...r.push(x.subarray(i, i + piece)));
  out.push(...r.flush());
  return Float32Array.from(out);
}

for (const rate of [48000, 44100, 96000, 16000]) {
  test(`${rate} Hz: a 1 kHz sine comes out at 16 kHz within 1e-3 (edges aside)`, () => {
    const x = sine(rate, 1.0, 1000, 0.5);
    const y = run(new StreamingResampler(rate), x, 128); // AudioWorklet render quanta
    assert.equal(y.length, 16000);
    const want = sine(16000, 1.0, 1000, 0.5);
    let worst = 0;
    for (let i = 200; i < 15800; i++) worst = Math.max(worst, Math.abs(y[i] - want[i]));
    assert.ok(worst < 1e-3, `max error ${worst}`);
  });
}

test("a 7 kHz tone at 48 kHz is kept, a 9 kHz one (above 8 kHz) is removed", () => {
  const rms = (y) => Math.sqrt(y.slice(500, -500).reduce((s, v) => s + v * v, 0) / (y.length - 1000));
  const kept = run(new StreamingResampler(48000), sine(48000, 0.5, 7000, 0.5), 128);
  const removed = run(new StreamingResampler(48000), sine(48000, 0.5, 9000, 0.5), 128);
  assert.ok(Math.abs(rms(kept) - 0.5 / Math.SQRT2) < 0.02, `7 kHz rms ${rms(kept)}`);
  assert.ok(rms(removed) < 0.01, `9 kHz rms ${rms(removed)}`);
});

test("pieces of any size give the same samples", () => {
  const x = sine(44100, 0.3, 440, 0.3);
  const a = run(new StreamingResampler(44100), x, 128), b = run(new StreamingResampler(44100), x, 1000);
  assert.deepEqual(a, b);
});
