// Log-mel feature frames -> one self-contained payload: a port of shared/codec.py's encoder
// ("harken-mel/1", wire format v1; the format is documented there and in docs/wire.md). Same input,
// same bytes: the format's constants come from the Python codec itself (codec_tables.json, written
// by tests/web_vectors.py), the code tables are built with the same IEEE operations, and the float
// arithmetic follows the Python order of operations (tests compare payloads byte for byte).

import tablesJson from "./codec_tables.json";
import { N_CLASSES, encodeSymbols } from "./entropy.js";

export const N_MELS = 128;
export const DYNAMIC_RANGE_LOG10 = 8.0;
export { CODEC_NAME } from "./protocol.js";
export const DEFAULT_MODE = "balanced";
export const MAX_FRAMES = 6000;
export const VALUE_LIMIT = 100.0;
export type Mode = "hifi" | "balanced" | "low";

interface ModeTables { id: number; step: number; rd_lambda: number; prior_classes: number[][] }
interface Tables {
  magic: number; version: number; modes: Record<Mode, ModeTables>; mel_blocks: number[]; prior_band: number[];
  max_time_block: number; floor_margin: number; shift_limit: number; basis: number[]; dependent: number[];
  source_a: number[]; source_b: number[]; log_ratio_a: number[]; log_ratio_b: (number | null)[];
  log10_ratio_single: (number | null)[]; floor_sink: number[]; ln10: number; class_bit_b: number[];
  value_bits: number[][]; mag_cap: number;
}
const T = tablesJson as unknown as Tables;
const NB = T.basis.length;
const ND = T.dependent.length;

export class CodecError extends Error {}

/** Log-mel frames [128, k], row-major: frame t of bin m at m * k + t (float32 values). */
export interface Frames { data: Float32Array; k: number }

const f32 = Math.fround;

// ---------------------------------------------------------------------------- transforms

const dctCache = new Map<number, Float64Array>();

/** [n, n] orthonormal DCT-II, row-major: coefficients = D @ x. */
function dctMatrix(n: number): Float64Array {
  let d = dctCache.get(n);
  if (d) return d;
  d = new Float64Array(n * n);
  const s = Math.sqrt(2.0 / n);
  for (let k = 0; k < n; k++) for (let i = 0; i < n; i++) d[k * n + i] = Math.cos((Math.PI * (i + 0.5) * k) / n) * s;
  const r2 = Math.sqrt(2.0);
  for (let i = 0; i < n; i++) d[i] /= r2;
  dctCache.set(n, d);
  return d;
}

export function timeBlocks(k: number): [number, number][] {
  const n = Math.ceil(k / T.max_time_block);
  const edges = Array.from({ length: n + 1 }, (_, i) => Math.floor((i * k) / n));
  return Array.from({ length: n }, (_, i) => [edges[i], edges[i + 1] - edges[i]] as [number, number]);
}

/** basis rows [NB, k] (row-major) -> per time block [NB, L] coefficients (block mel DCT x time DCT). */
function forwardTransform(basis: Float64Array, k: number): { coefs: Float64Array; n: number }[] {
  const out: { coefs: Float64Array; n: number }[] = [];
  for (const [s, n] of timeBlocks(k)) {
    // mel: (block-diagonal DCT) @ X[:, s:s+n]
    const mel = new Float64Array(NB * n);
    let b0 = 0;
    for (const size of T.mel_blocks) {
      const d = dctMatrix(size);
      for (let r = 0; r < size; r++) {
        for (let t = 0; t < n; t++) {
          let acc = 0;
          for (let i = 0; i < size; i++) acc += d[r * size + i] * basis[(b0 + i) * k + s + t];
          mel[(b0 + r) * n + t] = acc;
        }
      }
      b0 += size;
    }
    // time: (...) @ D_n.T
    const d = dctMatrix(n);
    const coefs = new Float64Array(NB * n);
    for (let r = 0; r < NB; r++) {
      for (let j = 0; j < n; j++) {
        let acc = 0;
        for (let t = 0; t < n; t++) acc += mel[r * n + t] * d[j * n + t];
        coefs[r * n + j] = acc;
      }
    }
    out.push({ coefs, n });
  }
  return out;
}

// ---------------------------------------------------------------------------- classes

function timeBand(j: number, n: number): number {
  if (j === 0) return 0;
  if (8 * j < n) return 1;
  if (4 * j < n) return 2;
  if (2 * j < n) return 3;
  return 4;
}

function bitLength(n: number): number {
  return n === 0 ? 0 : n.toString(2).length;
}

/** Prior class (before the packet shift) of every basis coefficient, time blocks concatenated. */
function blockPrior(lengths: number[], mode: Mode): Int32Array {
  const table = T.modes[mode].prior_classes;
  const out = new Int32Array(NB * lengths.reduce((a, b) => a + b, 0));
  let at = 0;
  for (const n of lengths) {
    const dc = bitLength(n) - 5; // the DC carries the block mean, whose level grows with n
    for (let r = 0; r < NB; r++) {
      const row = table[T.prior_band[r]];
      for (let j = 0; j < n; j++) out[at++] = row[timeBand(j, n)] + (j === 0 ? dc : 0);
    }
  }
  return out;
}

const clipClass = (c: number) => Math.min(Math.max(c, 0), N_CLASSES - 1);

function quantize(scaled: Float64Array, prior: Int32Array, shift: number, rdLambda: number): Int32Array {
  const q = new Int32Array(scaled.length);
  for (let i = 0; i < scaled.length; i++) {
    const offset = Math.max(0.5 - rdLambda * T.class_bit_b[clipClass(prior[i] + shift)], 0.1);
    const x = scaled[i];
    q[i] = Math.sign(x) * Math.floor(Math.abs(x) + offset);
  }
  return q;
}

/** The shift s minimising the bits of all values in classes prior + s (shared/codec._best_shift). */
function bestShift(mag: ArrayLike<number>, prior: ArrayLike<number>, shifts: number[]): number {
  const width = T.mag_cap + 1;
  let lo = Infinity, hi = -Infinity;
  for (let i = 0; i < prior.length; i++) { lo = Math.min(lo, prior[i]); hi = Math.max(hi, prior[i]); }
  const rows = hi - lo + 1;
  const hist = new Float64Array(rows * width);
  for (let i = 0; i < mag.length; i++) hist[(prior[i] - lo) * width + Math.min(Math.abs(mag[i]), T.mag_cap)] += 1;
  let best = shifts[0], bestCost = Infinity;
  for (const s of shifts) {
    let cost = 0;
    for (let r = 0; r < rows; r++) {
      const bits = T.value_bits[clipClass(lo + r + s)];
      for (let m = 0; m < width; m++) {
        const h = hist[r * width + m];
        if (h) cost += h * bits[m];
      }
    }
    if (cost < bestCost) { bestCost = cost; best = s; } // first minimum, as numpy's argmin
  }
  return best;
}

// ---------------------------------------------------------------------------- header

function varint(value: number, out: number[]): void {
  for (;;) {
    const byte = value % 128;
    value = Math.floor(value / 128);
    out.push(byte | (value ? 0x80 : 0));
    if (!value) return;
  }
}

function pushF32(value: number, out: number[]): void {
  const b = new Uint8Array(4);
  new DataView(b.buffer).setFloat32(0, value, true);
  out.push(...b);
}

function header(mode: Mode | null, k: number, floors: Float32Array, flags: number[]): number[] {
  const out = [T.magic, (T.version << 4) | (mode === null ? 0 : T.modes[mode].id)];
  varint(k, out);
  if (k === 0) return out;
  const changes: number[] = [];
  for (let i = 1; i < k; i++) if (floors[i] !== floors[i - 1]) changes.push(i);
  pushF32(floors[0], out);
  varint(changes.length, out);
  let prev = 0;
  for (const i of changes) {
    varint(i - prev, out);
    pushF32(floors[i], out);
    prev = i;
  }
  out.push(...flags);
  return out;
}

/** A payload with no frames: what the edge may send during silence. */
export function keepalive(): Uint8Array {
  return Uint8Array.from(header(null, 0, new Float32Array(0), []));
}

/** [k] float32 clamp value per frame (shared/codec.frame_floors). */
export function frameFloors(frames: Frames, floorLog10: number | null): Float32Array {
  const { data, k } = frames;
  const colMax = new Float32Array(k).fill(-Infinity), colMin = new Float32Array(k).fill(Infinity);
  let all = Infinity;
  for (let m = 0; m < N_MELS; m++) {
    for (let t = 0; t < k; t++) {
      const v = data[m * k + t];
      if (v > colMax[t]) colMax[t] = v;
      if (v < colMin[t]) colMin[t] = v;
      if (v < all) all = v;
    }
  }
  const base = f32(floorLog10 === null ? all : floorLog10);
  const floors = new Float32Array(k);
  let running = -Infinity;
  for (let t = 0; t < k; t++) {
    running = Math.max(running, colMax[t]);
    floors[t] = Math.min(Math.max(base, f32(running - DYNAMIC_RANGE_LOG10)), colMin[t]);
  }
  return floors;
}

/** numpy's logaddexp. */
function logaddexp(x: number, y: number): number {
  if (x === y) return x + Math.LN2;
  const d = x - y;
  if (d > 0) return x + Math.log1p(Math.exp(-d));
  if (d <= 0) return y + Math.log1p(Math.exp(d));
  return d;
}

function roundHalfEven(x: number): number {
  const r = Math.round(x);
  return Math.abs(x % 1) === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

/**
 * Encode raw log10-mel frames [128, k] (floored at running max - 8) into one self-contained
 * payload, byte-identical to shared/codec.encode_frames. `floorLog10`: the floor before this
 * packet's first frame, if known. k = 0 gives a keep-alive.
 */
export function encodeFrames(frames: Frames, mode: Mode = DEFAULT_MODE, floorLog10: number | null = null): Uint8Array {
  const params = T.modes[mode];
  if (!params) throw new CodecError(`unknown codec mode ${mode}`);
  const { data, k } = frames;
  if (data.length !== N_MELS * k) throw new CodecError(`frames must be [${N_MELS}, k]`);
  if (k > MAX_FRAMES) throw new CodecError(`${k} frames in one payload; the limit is ${MAX_FRAMES}`);
  if (k === 0) return keepalive();
  for (let i = 0; i < data.length; i++) {
    if (!(Math.abs(data[i]) <= VALUE_LIMIT)) throw new CodecError(`frames must be finite log10-mel values within +-${VALUE_LIMIT}`);
  }
  if (floorLog10 !== null && !(Math.abs(floorLog10) <= VALUE_LIMIT)) {
    throw new CodecError(`floor_log10 must be finite and within +-${VALUE_LIMIT}`);
  }
  const step = params.step;
  const floors = frameFloors(frames, floorLog10);
  const atFloor = new Uint8Array(N_MELS * k);
  let everyAtFloor = true;
  for (let m = 0; m < N_MELS; m++) {
    for (let t = 0; t < k; t++) {
      const a = data[m * k + t] <= floors[t];
      atFloor[m * k + t] = a ? 1 : 0;
      if (!a) everyAtFloor = false;
    }
  }
  if (everyAtFloor) return Uint8Array.from(header(mode, k, floors, [0x40 | 32]));

  // values at the floor are sunk below it, so quantisation noise cannot lift them over the clamp
  const xc = new Float64Array(N_MELS * k);
  for (let m = 0; m < N_MELS; m++) {
    const sink = T.floor_margin * step + T.floor_sink[m];
    for (let t = 0; t < k; t++) {
      const i = m * k + t;
      xc[i] = atFloor[i] ? data[i] - sink : data[i];
    }
  }
  // a floored bin whose one-source dependent is not floored has its true value right there
  const updates: [number, Float64Array][] = [];
  for (let j = 0; j < ND; j++) {
    const l10 = T.log10_ratio_single[j];
    if (l10 === null) continue;
    const src = T.source_a[j], dep = T.dependent[j];
    const row = xc.slice(src * k, src * k + k);
    for (let t = 0; t < k; t++) {
      if (atFloor[src * k + t] && !atFloor[dep * k + t]) row[t] = data[dep * k + t] - l10;
    }
    updates.push([src, row]);
  }
  for (const [src, row] of updates) xc.set(row, src * k);

  // dependents: predicted from the basis as the decoder sees it; a residual where flooring broke it
  const res = new Int32Array(ND * k);
  let anyRes = false;
  for (let j = 0; j < ND; j++) {
    const a0 = T.log_ratio_a[j], b0 = T.log_ratio_b[j];
    const sa = T.source_a[j], sb = T.source_b[j], dep = T.dependent[j];
    for (let t = 0; t < k; t++) {
      const a = xc[sa * k + t] * T.ln10 + a0;
      const b = b0 === null ? -Infinity : xc[sb * k + t] * T.ln10 + b0;
      const pred = logaddexp(a, b) / T.ln10;
      const fine = atFloor[dep * k + t] && pred <= floors[t];
      const r = fine ? 0 : roundHalfEven((xc[dep * k + t] - pred) / step);
      res[j * k + t] = r;
      if (r !== 0) anyRes = true;
    }
  }

  // basis: mel DCT x time DCT, dead-zone quantiser
  const basis = new Float64Array(NB * k);
  T.basis.forEach((m, r) => basis.set(xc.subarray(m * k, m * k + k), r * k));
  const blocks = forwardTransform(basis, k);
  const flat = new Float64Array(NB * k);
  let at = 0;
  for (const b of blocks) for (let i = 0; i < b.coefs.length; i++) flat[at++] = b.coefs[i] / step;
  const prior = blockPrior(blocks.map((b) => b.n), mode);
  const shifts = Array.from({ length: 2 * T.shift_limit + 1 }, (_, i) => i - T.shift_limit);
  const shift = bestShift(quantize(flat, prior, 0, params.rd_lambda), prior, shifts);
  const q = quantize(flat, prior, shift, params.rd_lambda);
  const classes = Array.from(prior, (p) => clipClass(p + shift));
  let resClass: number | null = null;
  let levels: ArrayLike<number> = q;
  if (anyRes) {
    resClass = bestShift(res, new Int32Array(res.length), Array.from({ length: N_CLASSES }, (_, i) => i));
    levels = [...q, ...res];
    for (let i = 0; i < res.length; i++) classes.push(resClass);
  }
  const body = encodeSymbols(levels, classes);
  const flags = resClass === null ? [shift + 32] : [(shift + 32) | 0x80, resClass];
  const head = header(mode, k, floors, flags);
  const out = new Uint8Array(head.length + body.length);
  out.set(head);
  out.set(body, head.length);
  return out;
}
