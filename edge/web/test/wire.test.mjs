// The protobuf messages besides Features (edge/web/vectors/wire.json, written by the Python wire):
// Start (word_timings, turn_events), End, KeepAlive and finalized Features byte for byte, every server
// message decoded to its fields (Ready.turn_events, Transcript.from_finalize, Turn), and the ones
// Python reads as nothing (a Turn of no known kind) read as null.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { decodeServerMessage, encodeClientMessage } from "../dist/node/index.js";

const wire = JSON.parse(readFileSync(new URL("../vectors/wire.json", import.meta.url), "utf8"));
const hex = (b) => Buffer.from(b).toString("hex");
const bytes = (h) => new Uint8Array(Buffer.from(h, "hex"));

test("Start, End, KeepAlive and finalized Features messages are the Python wire's bytes", () => {
  assert.ok(wire.client.some((c) => c.start?.turn_events), "a Start with turn_events (tests/web_vectors.py)");
  assert.ok(wire.client.some((c) => c.features?.finalized), "a finalized Features (tests/web_vectors.py)");
  assert.ok(wire.client.some((c) => c.start?.diarize), "a Start with diarize (tests/web_vectors.py)");
  for (const c of wire.client) {
    const f = c.features;
    const msg = c.end ? { kind: "end" } : c.keep_alive ? { kind: "keep_alive" } : f ? { kind: "features", seq: f.seq, packet: {
      segmentId: f.segment_id, firstFrame: f.first_frame, frameCount: f.frame_count, segmentStart: f.segment_start,
      segmentEnd: f.segment_end, payload: bytes(f.payload), runningMaxLog10: f.running_max_log10, finalized: f.finalized,
    } } : {
      kind: "start", language: c.start.language, context: c.start.context, codec: c.start.codec,
      sessionId: c.start.session_id, lastEventSeq: c.start.last_event_seq,
      seed: c.start.seed && { runningMaxLog10: c.start.seed.running_max_log10, contextTail: c.start.seed.context_tail,
                              nextSegmentId: c.start.seed.next_segment_id },
      ...(c.start.word_timings ? { wordTimings: true } : {}),
      ...(c.start.turn_events ? { turnEvents: true } : {}),
      ...(c.start.diarize ? { diarize: true } : {}),
    };
    assert.equal(hex(encodeClientMessage(msg)), c.bytes, JSON.stringify(c));
  }
});

test("server messages decode, negative int64 included", () => {
  const m = wire.server.map((c) => decodeServerMessage(bytes(c.bytes)));
  assert.deepEqual(m.map((x) => x.kind), wire.server.map((c) => c.kind));
  assert.deepEqual(m[0], { kind: "ready", sessionId: "sid-1", resumeAfterSeq: 5, lastFinalSegment: -1, keepAlive: false,
                           wordTimings: false, turnEvents: false, diarize: false });
  assert.deepEqual(m[1], { kind: "ack", seq: 12, lastFinalSegment: -1 });
  assert.deepEqual(m[2], { kind: "ack", seq: 300, lastFinalSegment: 2 });
  assert.deepEqual(m[3], { kind: "transcript", eventSeq: 9, seed: null, event: { segmentId: 2, committedDelta: "héllo ",
    partial: "wor", stability: 0.5, startS: 1.25, endS: 2.5, language: "English", isFinal: false, fromFinalize: false } });
  assert.equal(m[4].event.isFinal, true);
  assert.equal(m[4].event.fromFinalize, false);
  assert.deepEqual(m[4].seed, { runningMaxLog10: 1.25, contextTail: "hello", nextSegmentId: 3 });
  assert.deepEqual(m[5], { kind: "error", code: "INVALID_ARGUMENT", message: "bad payload" });
  assert.deepEqual(m[6], { kind: "ready", sessionId: "sid-2", resumeAfterSeq: 0, lastFinalSegment: 3, keepAlive: true,
                           wordTimings: false, turnEvents: false, diarize: false });
  assert.equal(m[7].wordTimings, true);
  assert.equal(m[7].turnEvents, false);
  assert.deepEqual(m[8], { kind: "word_timings", segmentId: 2, eventSeq: 11, words: [
    { text: "héllo", startS: 1.25, endS: 1.5 }, { text: "world", startS: 1.625, endS: 2.75 }] });
  assert.deepEqual(m[9], { kind: "word_timings", segmentId: 3, eventSeq: 12, words: [] });
  assert.equal(decodeServerMessage(new Uint8Array(0)), null);
});

test("turn events, Ready.turn_events and Transcript.from_finalize decode; unknown turn kinds read as null", () => {
  const m = wire.server.map((c) => decodeServerMessage(bytes(c.bytes)));
  assert.deepEqual(m[10], { kind: "ready", sessionId: "sid-4", resumeAfterSeq: 0, lastFinalSegment: 0, keepAlive: true,
                            wordTimings: false, turnEvents: true, diarize: false });
  assert.deepEqual(m[11], { kind: "transcript", eventSeq: 15, seed: null, event: { segmentId: 4, committedDelta: "stop.",
    partial: "", stability: 0, startS: 3.5, endS: 4.25, language: "English", isFinal: true, fromFinalize: true } });
  assert.deepEqual(m[12], { kind: "turn", turn: { kind: "speech_started", segmentId: 4, audioS: 3.5 }, eventSeq: 13 });
  assert.deepEqual(m[13], { kind: "turn", turn: { kind: "utterance_end", segmentId: 4, audioS: 4.26 }, eventSeq: 14 });
  assert.deepEqual(m[14], { kind: "turn", turn: { kind: "speech_started", segmentId: 0, audioS: 0 }, eventSeq: 0 });
  assert.ok(wire.server_none.length >= 3);
  for (const h of wire.server_none) assert.equal(decodeServerMessage(bytes(h)), null, h);
});

test("speaker labels: Ready.diarize, a final's speaker, a SpeakerLabel", () => {
  const m = wire.server.map((c) => decodeServerMessage(bytes(c.bytes)));
  assert.deepEqual(m[15], { kind: "ready", sessionId: "sid-5", resumeAfterSeq: 0, lastFinalSegment: 0, keepAlive: true,
                            wordTimings: false, turnEvents: false, diarize: true });
  assert.deepEqual(m[16], { kind: "transcript", eventSeq: 20, seed: null, event: { segmentId: 6, committedDelta: "yes.",
    partial: "", stability: 0, startS: 5, endS: 5.5, language: "English", isFinal: true, fromFinalize: false, speaker: "S2" } });
  assert.deepEqual(m[17], { kind: "speaker_label", segmentId: 5, speaker: "S1", eventSeq: 21 });
});
