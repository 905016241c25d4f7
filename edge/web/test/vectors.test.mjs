// The TypeScript edge against the Python edge's test vectors (edge/web/vectors/, written by
// tests/web_vectors.py): log-mel and VAD on onnxruntime-node within 1e-4, the codec's payloads and
// the pipeline's wire messages byte for byte; and FeatureStream.finalize mid-speech (each vector's
// "finalize" record) giving Python's packets, the finalized one included.
import assert from "node:assert/strict";
import { readFileSync, readdirSync } from "node:fs";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import * as ort from "onnxruntime-node";

import {
  FeatureStream, OrtModel, RunningMaxFloor, codeBook, crc32c, encodeClientMessage, encodeFrames, keepalive,
} from "../dist/node/index.js";

const here = (p) => fileURLToPath(new URL(p, import.meta.url));
const VECTORS = here("../vectors/");
const MODELS = here("../../models/");
const hex = (b) => Buffer.from(b).toString("hex");
const names = readdirSync(VECTORS).filter((f) => f.endsWith(".wav")).map((f) => f.slice(0, -4)).sort();
const record = (name) => JSON.parse(readFileSync(VECTORS + name + ".json", "utf8"));

/** 16-bit PCM mono WAV -> float32 in [-1, 1] (what soundfile reads: sample / 32768). */
function readWav(path) {
  const buf = readFileSync(path);
  let pos = 12;
  while (pos < buf.length) {
    const id = buf.toString("ascii", pos, pos + 4), size = buf.readUInt32LE(pos + 4);
    if (id === "data") {
      const out = new Float32Array(size / 2);
      for (let i = 0; i < out.length; i++) out[i] = buf.readInt16LE(pos + 8 + 2 * i) / 32768;
      return out;
    }
    pos += 8 + size + (size % 2);
  }
  throw new Error(`${path}: no data chunk`);
}

/** Python's raw log-mel of a vector: [128, T] row-major. */
function pythonMel(name) {
  const b = readFileSync(VECTORS + name + ".logmel.f32");
  const data = new Float32Array(b.buffer.slice(b.byteOffset, b.byteOffset + b.length));
  return { data, k: data.length / 128 };
}

function sliceFrames(x, a, k) {
  const data = new Float32Array(128 * k);
  for (let m = 0; m < 128; m++) data.set(x.data.subarray(m * x.k + a, m * x.k + a + k), m * k);
  return { data, k };
}

const models = (async () => ({
  logmel: await OrtModel.load(ort, MODELS + "logmel.onnx"),
  vad: await OrtModel.load(ort, MODELS + "silero_vad_windows.onnx"),
}))();

/** The JS pipeline on a vector WAV, pushed as the Python one was (or in pieces of `pieceSamples`),
 * finalized once `finalizeAt` samples are in (if given): -> {mel, probs, events, packets}. */
async function runEdge(name, pieceSamples = null, finalizeAt = null) {
  const rec = record(name);
  const audio = readWav(VECTORS + name + ".wav");
  const piece = pieceSamples ?? rec.push_samples;
  const stream = new FeatureStream(await models, { packetFrames: rec.packet_frames });
  const melParts = [], probs = [], events = [], packets = [];
  const pushMel = stream.mel.push.bind(stream.mel), flushMel = stream.mel.flush.bind(stream.mel);
  stream.mel.push = async (x) => { const f = await pushMel(x); melParts.push(f); return f; };
  stream.mel.flush = async (s) => { const f = await flushMel(s); melParts.push(f); return f; };
  const seg = stream.vad.segmenter, pushSeg = seg.push.bind(seg), finishSeg = seg.finish.bind(seg);
  seg.push = (p) => { probs.push(...p); const e = pushSeg(p); events.push(...e); return e; };
  seg.finish = (p, n) => { probs.push(...p); const e = finishSeg(p, n); events.push(...e); return e; };
  const finalizeSeg = seg.finalize.bind(seg);
  seg.finalize = () => { const e = finalizeSeg(); events.push(...e); return e; };
  for (let i = 0; i < audio.length; i += piece) {
    if (i === finalizeAt) packets.push(...stream.finalize());
    packets.push(...await stream.push(audio.subarray(i, i + piece)));
  }
  packets.push(...await stream.flush());
  const k = melParts.reduce((n, f) => n + f.k, 0);
  const mel = { data: new Float32Array(128 * k), k };
  let at = 0;
  for (const f of melParts) {
    for (let m = 0; m < 128; m++) mel.data.set(f.data.subarray(m * f.k, (m + 1) * f.k), m * k + at);
    at += f.k;
  }
  return { rec, mel, probs, events, packets };
}

const runs = new Map(names.map((n) => [n, null]));
const edge = (name) => runs.get(name) ?? runs.set(name, runEdge(name)).get(name);

test("the vectors are there", () => {
  assert.ok(names.length >= 2, `vector WAVs in ${VECTORS}`);
});

for (const name of names) {
  test(`${name}: log-mel within 1e-4 of the Python edge`, async () => {
    const { mel } = await edge(name);
    const ref = pythonMel(name);
    assert.equal(mel.k, ref.k);
    let worst = 0;
    for (let i = 0; i < ref.data.length; i++) worst = Math.max(worst, Math.abs(mel.data[i] - ref.data[i]));
    assert.ok(worst <= 1e-4, `max abs difference ${worst}`);
  });

  test(`${name}: VAD probabilities within 1e-4, the same segments`, async () => {
    const { rec, probs, events } = await edge(name);
    assert.equal(probs.length, rec.vad_probabilities.length);
    const worst = Math.max(0, ...probs.map((p, i) => Math.abs(p - rec.vad_probabilities[i])));
    assert.ok(worst <= 1e-4, `max abs difference ${worst}`);
    assert.deepEqual(events.map((e) => [e.kind, e.segmentId, e.startSample, e.kind === "end" ? e.endSample : null, e.decidedAtSample]),
      rec.vad_events.map((e) => [e.kind, e.segment_id, e.start_sample, e.end_sample, e.decided_at_sample]));
  });

  /** Replays the Python pushes of `run` (a vector record or its "finalize" record): the frames and VAD
   * events each one produced, and the VAD's earliest end after it (an open segment's frames leave
   * only up to that); a finalize entry goes to FeatureStream.applyFinalize. Checks the packets. */
  const replay = (rec, run) => {
    const ref = pythonMel(name);
    assert.ok(run.pushes.every((p) => "earliest_end_sample" in p), "pushes record earliest_end_sample (tests/web_vectors.py)");
    const stream = new FeatureStream({ logmel: null, vad: null }, { packetFrames: rec.packet_frames });
    const events = run.vad_events.map((e) => ({ kind: e.kind, segmentId: e.segment_id, startSample: e.start_sample,
      endSample: e.end_sample, decidedAtSample: e.decided_at_sample }));
    const packets = [];
    let done = 0;
    for (const push of run.pushes) {
      const pushed = push.events.map((i) => events[i]);
      if (push.finalize) packets.push(...stream.applyFinalize(pushed, push.earliest_end_sample));
      else packets.push(...stream.advance(sliceFrames(ref, done, push.frames), pushed, push.final, push.earliest_end_sample));
      done += push.frames;
    }
    assert.equal(done, ref.k);
    assert.equal(packets.length, run.packets.length);
    packets.forEach((p, i) => {
      const want = run.packets[i];
      assert.deepEqual([p.segmentId, p.firstFrame, p.frameCount, p.segmentStart, p.segmentEnd, p.finalized],
        [want.segment_id, want.first_frame, want.frame_count, want.segment_start, want.segment_end, want.finalized], `packet ${i}`);
      assert.equal(hex(p.payload), want.payload, `packet ${i} payload`);
      assert.equal(crc32c(p.payload), want.crc32c);
      assert.equal(hex(encodeClientMessage({ kind: "features", seq: want.seq, packet: p })), want.message, `packet ${i} message`);
    });
  };

  test(`${name}: Python's frames and VAD events give Python's packets, byte for byte`, () => {
    // the pipeline after the models: same floors, segments, payloads, CRCs and wire messages
    const rec = record(name);
    replay(rec, rec);
  });

  test(`${name}: finalized mid-speech, Python's frames and VAD events give Python's packets, byte for byte`, () => {
    const rec = record(name);
    assert.ok(rec.finalize, "a finalize record (tests/web_vectors.py)");
    assert.equal(rec.finalize.pushes.filter((p) => p.finalize).length, 1);
    replay(rec, rec.finalize);
  });

  const summary = (packets) => packets.map((p) => [p.segmentId, p.firstFrame, p.frameCount, p.segmentStart, p.segmentEnd,
    p.finalized, p.runningMaxLog10, hex(p.payload)]);
  const pythonSummary = (run) => run.packets.map((p) => [p.segment_id, p.first_frame, p.frame_count, p.segment_start,
    p.segment_end, p.finalized, p.running_max_log10, p.payload]);

  test(`${name}: the whole JS edge (ONNX models included), finalized mid-speech, sends Python's packets`, async () => {
    const rec = record(name);
    const { events, packets } = await runEdge(name, null, rec.finalize.after_samples);
    assert.deepEqual(events.map((e) => [e.kind, e.segmentId, e.startSample, e.kind === "end" ? e.endSample : null, e.decidedAtSample]),
      rec.finalize.vad_events.map((e) => [e.kind, e.segment_id, e.start_sample, e.end_sample, e.decided_at_sample]));
    assert.deepEqual(summary(packets), pythonSummary(rec.finalize));
    if (rec.packets.length) {
      // the vector's speech: one more segment than without the finalize, cut by the finalized packet,
      // the next one starting at the very frame the finalized one ended
      const cut = packets.findIndex((p) => p.finalized);
      assert.ok(cut >= 0 && packets.filter((p) => p.finalized).length === 1);
      const end = packets[cut].firstFrame + packets[cut].frameCount;
      assert.ok(end <= rec.finalize.after_samples / 160, "no frame past those computed: at once");
      const after = packets[cut + 1];
      if (after) { // speech went on after the cut
        assert.ok(after.segmentStart && after.segmentId === packets[cut].segmentId + 1);
        assert.equal(after.firstFrame, end);
      }
    }
  });

  test(`${name}: the whole JS edge (ONNX models included) sends Python's packets`, async () => {
    const { rec, packets } = await edge(name);
    assert.deepEqual(summary(packets), pythonSummary(rec));
  });

  test(`${name}: the same packets however the audio is cut (20 ms, 1 s, odd pieces, one piece)`, async () => {
    // edge/pipeline.py: what a stream sends is a function of its samples alone (issue 14, defect 5)
    const rec = record(name);
    for (const piece of [320, 16000, 7919, rec.samples]) {
      const { packets } = await runEdge(name, piece);
      assert.deepEqual(summary(packets), pythonSummary(rec), `pieces of ${piece} samples`);
    }
  });
}

test("codec cases: every mode, floor known or not, 1 to 72 frames: byte-identical payloads", () => {
  const { cases } = JSON.parse(readFileSync(VECTORS + "codec.json", "utf8"));
  const floored = new Map(names.map((n) => [n, new RunningMaxFloor().apply(pythonMel(n))[0]]));
  assert.ok(cases.length > 50);
  let mismatched = [];
  for (const c of cases) {
    const payload = encodeFrames(sliceFrames(floored.get(c.wav), c.first_frame, c.frame_count), c.mode, c.floor_log10);
    if (hex(payload) !== c.payload) mismatched.push(`${c.wav}@${c.first_frame}+${c.frame_count} ${c.mode} floor=${c.floor_log10}`);
  }
  assert.deepEqual(mismatched, []);
});

test("entropy code tables equal the Python ones", () => {
  const { classes } = JSON.parse(readFileSync(VECTORS + "entropy_tables.json", "utf8"));
  const book = codeBook();
  classes.forEach((c, i) => {
    assert.equal(book[i].group, c.group);
    assert.equal(book[i].radius, c.radius);
    assert.deepEqual(book[i].lengths, c.lengths, `class ${i}`);
  });
});

test("keep-alive and CRC32C check values", () => {
  assert.equal(hex(keepalive()), "a71000");
  assert.equal(crc32c(new TextEncoder().encode("123456789")), 0xe3069283);
});
