// The protobuf messages besides Features (edge/web/vectors/wire.json, written by the Python wire):
// Start and End byte for byte, every server message decoded to its fields.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { decodeServerMessage, encodeClientMessage } from "../dist/node/index.js";

const wire = JSON.parse(readFileSync(new URL("../vectors/wire.json", import.meta.url), "utf8"));
const hex = (b) => Buffer.from(b).toString("hex");
const bytes = (h) => new Uint8Array(Buffer.from(h, "hex"));

test("Start, End and KeepAlive messages are the Python wire's bytes", () => {
  for (const c of wire.client) {
    const msg = c.end ? { kind: "end" } : c.keep_alive ? { kind: "keep_alive" } : {
      kind: "start", language: c.start.language, context: c.start.context, codec: c.start.codec,
      sessionId: c.start.session_id, lastEventSeq: c.start.last_event_seq,
      seed: c.start.seed && { runningMaxLog10: c.start.seed.running_max_log10, contextTail: c.start.seed.context_tail,
                              nextSegmentId: c.start.seed.next_segment_id },
      ...(c.start.word_timings ? { wordTimings: true } : {}),
    };
    assert.equal(hex(encodeClientMessage(msg)), c.bytes, JSON.stringify(c));
  }
});

test("server messages decode, negative int64 included", () => {
  const m = wire.server.map((c) => decodeServerMessage(bytes(c.bytes)));
  assert.deepEqual(m.map((x) => x.kind), wire.server.map((c) => c.kind));
  assert.deepEqual(m[0], { kind: "ready", sessionId: "sid-1", resumeAfterSeq: 5, lastFinalSegment: -1, keepAlive: false,
                           wordTimings: false });
  assert.deepEqual(m[1], { kind: "ack", seq: 12, lastFinalSegment: -1 });
  assert.deepEqual(m[2], { kind: "ack", seq: 300, lastFinalSegment: 2 });
  assert.deepEqual(m[3], { kind: "transcript", eventSeq: 9, seed: null, event: { segmentId: 2, committedDelta: "héllo ",
    partial: "wor", stability: 0.5, startS: 1.25, endS: 2.5, language: "English", isFinal: false } });
  assert.equal(m[4].event.isFinal, true);
  assert.deepEqual(m[4].seed, { runningMaxLog10: 1.25, contextTail: "hello", nextSegmentId: 3 });
  assert.deepEqual(m[5], { kind: "error", code: "INVALID_ARGUMENT", message: "bad payload" });
  assert.deepEqual(m[6], { kind: "ready", sessionId: "sid-2", resumeAfterSeq: 0, lastFinalSegment: 3, keepAlive: true,
                           wordTimings: false });
  assert.equal(m[7].wordTimings, true);
  assert.deepEqual(m[8], { kind: "word_timings", segmentId: 2, eventSeq: 11, words: [
    { text: "héllo", startS: 1.25, endS: 1.5 }, { text: "world", startS: 1.625, endS: 2.75 }] });
  assert.deepEqual(m[9], { kind: "word_timings", segmentId: 3, eventSeq: 12, words: [] });
  assert.equal(decodeServerMessage(new Uint8Array(0)), null);
});
