// Entropy coding of integer levels that come with a class: a port of shared/entropy.py (encoder
// side). Each class owns a static canonical Huffman code over tuples of 1-4 levels, built from a
// two-sided geometric model with only IEEE basic operations, so it is the same table, bit for bit,
// as the Python one. Levels are coded class by class (stable within a class), each class run
// zero-padded to whole tuples; a run of a sparse class (4-tuples) opens with an "all zero" bit.

export const N_CLASSES = 28;
export const CLASS_ZERO = 16;
export const SPARSE_GROUP = 4;
const WEIGHT_BITS = 40;
const MIN_WEIGHT = 2 ** (WEIGHT_BITS - 18);
export const MAX_LEVEL = 2 ** 31;

/** Expected |level| of class c: 2 ** ((c - 16) / 2), from exact power-of-two scaling and sqrt. */
export function classMeanAbs(c: number): number {
  const h = c - CLASS_ZERO;
  const odd = ((h % 2) + 2) % 2 === 1;
  return (odd ? Math.SQRT2 : 1) * 2 ** Math.floor(h / 2);
}

function tupleShape(meanAbs: number): [number, number] {
  if (meanAbs < 0.03) return [4, 1];
  if (meanAbs < 0.16) return [4, 2];
  if (meanAbs < 0.3) return [3, 3];
  if (meanAbs < 0.42) return [2, 5];
  if (meanAbs < 1.7) return [2, 7];
  return [1, Math.max(24, Math.ceil(5 * meanAbs))];
}

export interface CodeTable {
  group: number;
  radius: number;
  escape: number; // symbol index of the escape
  codes: number[]; // codeword per symbol (< 2**53), MSB first
  lengths: number[];
}

/** Huffman code lengths for integer weights; ties broken by (weight, insertion index) as Python's heapq. */
function huffmanLengths(weights: number[]): number[] {
  type Node = { w: number; tie: number; members: number[] };
  const heap: Node[] = [];
  const less = (a: Node, b: Node) => a.w < b.w || (a.w === b.w && a.tie < b.tie);
  const push = (n: Node) => {
    heap.push(n);
    let i = heap.length - 1;
    while (i > 0) {
      const p = (i - 1) >> 1;
      if (!less(heap[i], heap[p])) break;
      [heap[i], heap[p]] = [heap[p], heap[i]];
      i = p;
    }
  };
  const pop = (): Node => {
    const top = heap[0];
    const last = heap.pop()!;
    if (heap.length) {
      heap[0] = last;
      let i = 0;
      for (;;) {
        const l = 2 * i + 1, r = l + 1;
        let m = i;
        if (l < heap.length && less(heap[l], heap[m])) m = l;
        if (r < heap.length && less(heap[r], heap[m])) m = r;
        if (m === i) break;
        [heap[i], heap[m]] = [heap[m], heap[i]];
        i = m;
      }
    }
    return top;
  };
  weights.forEach((w, i) => push({ w, tie: i, members: [i] }));
  const lengths = new Array<number>(weights.length).fill(0);
  let tie = weights.length;
  while (heap.length > 1) {
    const a = pop(), b = pop();
    const members = a.members.concat(b.members);
    for (const s of members) lengths[s] += 1;
    push({ w: a.w + b.w, tie: tie++, members });
  }
  return lengths;
}

function buildTable(meanAbs: number): CodeTable {
  const theta = (Math.sqrt(1 + meanAbs * meanAbs) - 1) / meanAbs;
  const [group, radius] = tupleShape(meanAbs);
  const powers = [1.0];
  for (let i = 0; i < radius; i++) powers.push(powers[powers.length - 1] * theta);
  const p0 = (1 - theta) / (1 + theta);
  const p1: number[] = [];
  for (let v = -radius; v <= radius; v++) p1.push(p0 * powers[Math.abs(v)]);
  let p = p1;
  for (let g = 1; g < group; g++) {
    const next: number[] = [];
    for (const a of p) for (const b of p1) next.push(a * b); // first digit high, as numpy's ravel
    p = next;
  }
  const scale = 2 ** WEIGHT_BITS;
  const weights = p.map((w) => Math.max(Math.floor(w * scale), MIN_WEIGHT));
  const total = weights.reduce((s, w) => s + w, 0); // integers < 2**53: exact
  weights.push(Math.max(scale - total, MIN_WEIGHT)); // the escape
  const lengths = huffmanLengths(weights);
  const order = weights.map((_, i) => i).sort((a, b) => lengths[a] - lengths[b] || a - b);
  const codes = new Array<number>(weights.length).fill(0);
  let code = 0, prev = lengths[order[0]];
  for (const s of order) {
    code *= 2 ** (lengths[s] - prev);
    prev = lengths[s];
    codes[s] = code;
    code += 1;
  }
  return { group, radius, escape: weights.length - 1, codes, lengths };
}

let book: CodeTable[] | null = null;

/** One table per class; built once (about 10 ms), deterministic, part of the format version. */
export function codeBook(): CodeTable[] {
  if (book === null) book = Array.from({ length: N_CLASSES }, (_, c) => buildTable(classMeanAbs(c)));
  return book;
}

/** MSB-first bit writer, zero-padded to a byte at the end. */
export class BitWriter {
  private bytes: number[] = [];
  private acc = 0; // bits not yet flushed, as an integer < 2**8
  private n = 0;

  write(value: number, nbits: number): void {
    // value < 2**53; written from its highest bit down
    for (let i = nbits - 1; i >= 0; i--) {
      const bit = Math.floor(value / 2 ** i) % 2;
      this.acc = (this.acc << 1) | bit;
      if (++this.n === 8) {
        this.bytes.push(this.acc);
        this.acc = 0;
        this.n = 0;
      }
    }
  }

  zeros(nbits: number): void {
    for (let i = 0; i < nbits; i++) this.write(0, 1);
  }

  finish(): Uint8Array {
    const out = this.bytes.slice();
    if (this.n) out.push(this.acc << (8 - this.n));
    return Uint8Array.from(out);
  }
}

/** Signed order-0 Exp-Golomb over the zigzag mapping. */
function writeExpGolomb(w: BitWriter, v: number): void {
  const u = (v >= 0 ? 2 * v : -2 * v - 1) + 1;
  let nbits = 0;
  for (let x = u; x >= 1; x = Math.floor(x / 2)) nbits++;
  w.zeros(nbits - 1);
  w.write(u, nbits);
}

/** q, classes: [n] -> the entropy-coded bytes of all of them, class by class. |q| < 2**31. */
export function encodeSymbols(q: ArrayLike<number>, classes: ArrayLike<number>): Uint8Array {
  const n = q.length;
  if (n === 0) return new Uint8Array(0);
  const byClass: number[][] = Array.from({ length: N_CLASSES }, () => []);
  for (let i = 0; i < n; i++) {
    if (Math.abs(q[i]) >= MAX_LEVEL) throw new Error(`level out of range: |q| must stay below ${MAX_LEVEL}`);
    byClass[classes[i]].push(q[i]);
  }
  const tables = codeBook();
  const w = new BitWriter();
  for (let c = 0; c < N_CLASSES; c++) {
    const run = byClass[c];
    if (!run.length) continue;
    const t = tables[c];
    const g = t.group, r = t.radius, width = 2 * r + 1;
    while (run.length % g) run.push(0);
    if (g === SPARSE_GROUP) {
      const allZero = run.every((v) => v === 0);
      w.write(allZero ? 1 : 0, 1);
      if (allZero) continue;
    }
    for (let i = 0; i < run.length; i += g) {
      let index = 0, outside = false;
      for (let d = 0; d < g; d++) {
        const v = run[i + d];
        if (Math.abs(v) > r) outside = true;
        index = index * width + (Math.min(Math.max(v, -r), r) + r);
      }
      const sym = outside ? t.escape : index;
      w.write(t.codes[sym], t.lengths[sym]);
      if (outside) for (let d = 0; d < g; d++) writeExpGolomb(w, run[i + d]);
    }
  }
  return w.finish();
}
