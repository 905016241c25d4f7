// Log-mel features, streaming-exact: a port of edge/features.py's StreamingLogMel. The spectrogram
// runs in the same ONNX graph (edge/models/logmel.onnx); this file does the reference's reflect
// padding and the bookkeeping. Frame t covers input samples [160t - 200, 160t + 200) and is final
// once 160t + 200 samples exist (frame 0 needs 201); the rest come at flush().

import type { Frames } from "./codec.js";
import { N_MELS } from "./codec.js";
import type { OrtModel } from "./ort.js";

export const SAMPLE_RATE = 16000;
export const N_FFT = 400;
export const HOP_LENGTH = 160;
export const PAD = N_FFT / 2;
export const MIN_SAMPLES = PAD + 1;

const empty = (): Frames => ({ data: new Float32Array(0), k: 0 });

function framesIn(nPadded: number): number {
  return nPadded < N_FFT ? 0 : Math.floor((nPadded - N_FFT) / HOP_LENGTH) + 1;
}

function concat(a: Float32Array, b: Float32Array): Float32Array {
  const out = new Float32Array(a.length + b.length);
  out.set(a);
  out.set(b, a.length);
  return out;
}

/** One stream's log-mel state: push PCM pieces, get each frame as soon as it is final. */
export class StreamingLogMel {
  nSamples = 0;
  framesEmitted = 0;
  finished = false;
  private buffer: Float32Array = new Float32Array(0);
  private leftPadded = false;

  constructor(private readonly model: OrtModel) {}

  /** pcm: 16 kHz mono in [-1, 1] -> raw log10-mel frames [128, k] that became final (k may be 0). */
  async push(pcm: Float32Array): Promise<Frames> {
    if (this.finished) throw new Error("StreamingLogMel.push after flush: start a new stream");
    this.nSamples += pcm.length;
    this.buffer = concat(this.buffer, pcm);
    if (!this.leftPadded) {
      if (this.nSamples < MIN_SAMPLES) return empty();
      // numpy "reflect": x[200], x[199], ..., x[1]
      const left = new Float32Array(PAD);
      for (let i = 0; i < PAD; i++) left[i] = this.buffer[PAD - i];
      this.buffer = concat(left, this.buffer);
      this.leftPadded = true;
    }
    return this.take(framesIn(this.buffer.length));
  }

  /** End of input: reflect-pad the end; the stream's total is nSamples // 160 frames. */
  async flush(shortOk = false): Promise<Frames> {
    if (this.finished) throw new Error("StreamingLogMel.flush called twice");
    this.finished = true;
    if (this.nSamples < MIN_SAMPLES) {
      this.buffer = new Float32Array(0);
      if (shortOk) return empty();
      throw new Error(`${this.nSamples} samples is too short for log-mel features (need ${MIN_SAMPLES})`);
    }
    const n = this.buffer.length;
    const right = new Float32Array(PAD); // x[-2], x[-3], ..., x[-201]
    for (let i = 0; i < PAD; i++) right[i] = this.buffer[n - 2 - i];
    this.buffer = concat(this.buffer, right);
    const frames = await this.take(Math.floor(this.nSamples / HOP_LENGTH) - this.framesEmitted);
    this.buffer = new Float32Array(0);
    return frames;
  }

  private async take(k: number): Promise<Frames> {
    if (k <= 0) return empty();
    const input = this.buffer.slice(0, HOP_LENGTH * (k - 1) + N_FFT);
    this.buffer = this.buffer.slice(HOP_LENGTH * k);
    this.framesEmitted += k;
    const out = await this.model.run({ padded: this.model.tensor(input, [input.length]) });
    const mel = out.log_mel;
    if (mel.dims[0] !== N_MELS || mel.dims[1] !== k) throw new Error(`log-mel graph gave [${mel.dims}], expected [128, ${k}]`);
    return { data: mel.data as Float32Array, k };
  }
}

/** Floors raw log10-mel frames at (running max - 8) as they arrive (shared/features_spec.RunningMaxFloor). */
export class RunningMaxFloor {
  constructor(public maxLog10 = -Infinity) {}

  /** -> [floored frames, the running max after each frame (float32 values)] */
  apply(frames: Frames): [Frames, Float64Array] {
    const { data, k } = frames;
    const running = new Float64Array(k);
    let r = this.maxLog10;
    for (let t = 0; t < k; t++) {
      let m = -Infinity;
      for (let b = 0; b < N_MELS; b++) m = Math.max(m, data[b * k + t]);
      r = Math.fround(Math.max(m, r));
      running[t] = r;
    }
    if (k) this.maxLog10 = running[k - 1];
    const out = new Float32Array(data.length);
    for (let b = 0; b < N_MELS; b++) {
      for (let t = 0; t < k; t++) out[b * k + t] = Math.max(data[b * k + t], Math.fround(running[t] - 8.0));
    }
    return [{ data: out, k }, running];
  }
}
