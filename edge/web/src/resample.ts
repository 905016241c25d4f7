// Streaming resampling to 16 kHz for the capture worklet: windowed-sinc interpolation (Blackman
// window, 16 zero crossings of the output rate each side) with the cutoff a little under the lower
// Nyquist, from a kernel table (512 phases per input sample, linearly interpolated), so any device
// rate (44.1, 48, 96 kHz...) works with one code path and constant memory.

const ZERO_CROSSINGS = 32;
const PHASES = 512;
const CUTOFF = 0.94; // of the lower Nyquist frequency

export class StreamingResampler {
  readonly ratio: number; // input samples per output sample
  private readonly fc: number; // cutoff, cycles per input sample
  private readonly halfWidth: number; // kernel half width, input samples
  private readonly table: Float64Array; // kernel at d = i / PHASES, i = 0 .. halfWidth * PHASES
  private buf = new Float32Array(0);
  private base = 0; // absolute index of buf[0]
  private received = 0;
  private produced = 0;

  constructor(readonly inRate: number, readonly outRate = 16000) {
    this.ratio = inRate / outRate;
    this.fc = (0.5 * CUTOFF) / Math.max(this.ratio, 1);
    this.halfWidth = Math.ceil(ZERO_CROSSINGS * Math.max(this.ratio, 1));
    this.table = new Float64Array(this.halfWidth * PHASES + 2);
    for (let i = 0; i < this.table.length; i++) {
      const d = i / PHASES;
      if (d >= this.halfWidth) continue;
      const x = 2 * this.fc * d;
      const sinc = x === 0 ? 1 : Math.sin(Math.PI * x) / (Math.PI * x);
      const w = 0.42 + 0.5 * Math.cos((Math.PI * d) / this.halfWidth) + 0.08 * Math.cos((2 * Math.PI * d) / this.halfWidth);
      this.table[i] = 2 * this.fc * sinc * w;
    }
  }

  private kernel(d: number): number {
    const p = Math.abs(d) * PHASES;
    const i = Math.floor(p);
    const f = p - i;
    return this.table[i] * (1 - f) + this.table[i + 1] * f;
  }

  /** Input at inRate -> the output samples it completes (each needs halfWidth samples after it). */
  push(x: Float32Array): Float32Array {
    const merged = new Float32Array(this.buf.length + x.length);
    merged.set(this.buf);
    merged.set(x, this.buf.length);
    this.buf = merged;
    this.received += x.length;
    return this.produce(this.received);
  }

  /** End of input: the remaining outputs, with zeros after the last sample. */
  flush(): Float32Array {
    return this.produce(Infinity, Math.floor(this.received / this.ratio));
  }

  private produce(available: number, limit = Infinity): Float32Array {
    const out: number[] = [];
    for (;;) {
      const n = this.produced;
      if (n >= limit) break;
      const t = n * this.ratio;
      const hi = Math.floor(t + this.halfWidth);
      if (hi >= available) break;
      let acc = 0;
      for (let k = Math.max(Math.ceil(t - this.halfWidth), this.base, 0); k <= hi; k++) {
        const v = k - this.base < this.buf.length ? this.buf[k - this.base] : 0;
        acc += v * this.kernel(t - k);
      }
      out.push(acc);
      this.produced++;
    }
    // keep what later outputs still need
    const keepFrom = Math.max(0, Math.ceil(this.produced * this.ratio - this.halfWidth));
    if (keepFrom > this.base) {
      this.buf = this.buf.slice(Math.min(keepFrom - this.base, this.buf.length));
      this.base = keepFrom;
    }
    return Float32Array.from(out);
  }
}
