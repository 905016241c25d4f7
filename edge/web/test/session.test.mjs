// ClientSession (src/session.ts) driven by method calls, no network: the scenarios of
// tests/test_client_session.py (the Python core it ports), same inputs, same outcomes.
import assert from "node:assert/strict";
import { test } from "node:test";

import { ClientSession, StreamError } from "../dist/node/index.js";

const SEED = { runningMaxLog10: 2.5, contextTail: "hello", nextSegmentId: 1 };
const CODEC = "harken-mel/1";

function packet(segmentId, firstFrame, { frames = 10, start = false, end = false, nbytes = 100 } = {}) {
  const payload = new Uint8Array(nbytes).map((_, i) => (i % 2 ? firstFrame : segmentId) % 256);
  return { segmentId, firstFrame, frameCount: frames, segmentStart: start, segmentEnd: end, payload, runningMaxLog10: 2.5 };
}

function transcript(segmentId, eventSeq, delta = "", partial = "", { final = false, startS = 0, endS = 1, seed = null, fromFinalize = false } = {}) {
  return { kind: "transcript", eventSeq, seed, event: { segmentId, committedDelta: delta, partial, stability: 0.5, startS, endS, language: "English",
                                                        isFinal: final, fromFinalize } };
}
const ready = (sessionId, resumeAfterSeq, keepAlive = false) => ({ kind: "ready", sessionId, resumeAfterSeq, lastFinalSegment: -1, keepAlive,
                                                                   wordTimings: false, turnEvents: false, diarize: false });
const turn = (kind, segmentId, audioS, eventSeq) => ({ kind: "turn", turn: { kind, segmentId, audioS }, eventSeq });
const ack = (seq, lastFinalSegment) => ({ kind: "ack", seq, lastFinalSegment });

function writeAll(s) {
  const out = [];
  let msg;
  while ((msg = s.nextMessage()) !== null) { s.sent(msg); out.push(msg); }
  return out;
}

function connect(s, r, now = 0) {
  const start = s.startMessage();
  assert.equal(s.lifecycle, "connecting");
  assert.deepEqual(s.onServerMessage(r, now), []);
  return start;
}

const shown = (out) => out.filter((e) => e.kind === undefined).map((e) => [e.committedDelta, e.partial]);

test("a whole stream", () => {
  const s = new ClientSession({ language: "English", context: "names" });
  const p = [packet(0, 10, { start: true }), packet(0, 20), packet(0, 30, { end: true })];
  assert.deepEqual(s.onPackets(p.slice(0, 2), 0.05), { kind: "progress", boundS: 0.05 });
  const start = connect(s, ready("sid", 0), 1.0);
  assert.deepEqual(start, { kind: "start", language: "English", context: "names", codec: CODEC, sessionId: "", lastEventSeq: 0, seed: null,
                            wordTimings: false, turnEvents: false, diarize: false });
  assert.deepEqual(writeAll(s).map((m) => [m.kind, m.seq]), [["features", 1], ["features", 2]]);
  assert.equal(s.nextMessage(), null);
  assert.deepEqual(shown(s.onServerMessage(transcript(0, 1, "Hel", "lo"), 1.1)), [["Hel", "lo"]]);
  assert.deepEqual(s.onPackets(p.slice(2), 0.3), { kind: "progress", boundS: 0.1 });
  s.onPackets([], Infinity);
  s.endInput();
  assert.deepEqual(writeAll(s).map((m) => m.kind), ["features", "end"]);
  assert.equal(s.lifecycle, "draining");
  const final = s.onServerMessage(transcript(0, 2, "lo.", "", { final: true, startS: 0.1, endS: 0.4, seed: SEED }), 1.2);
  assert.deepEqual(final.at(-1), { kind: "progress", boundS: Infinity });
  assert.equal(s.buffer.entries.length, 0);
  assert.equal(s.buffer.nbytes, 0);
  assert.deepEqual(s.seed, SEED);
  assert.deepEqual(s.onServerMessage(ack(3, 0), 1.3), []);
  assert.ok(s.onCallClosed());
  assert.equal(s.lifecycle, "done");
  assert.equal(s.stats.messagesSent, 3);
  assert.equal(s.stats.framesProduced, 30);
});

test("word timings: asked in Start, the server's answer in stats, each segment's once after its final", () => {
  const s = new ClientSession({ language: "English", wordTimings: true });
  s.onPackets([packet(0, 10, { start: true, end: true })], Infinity);
  s.endInput();
  const start = connect(s, { ...ready("sid", 0), wordTimings: true });
  assert.equal(start.wordTimings, true);
  assert.equal(s.stats.wordTimings, true);
  writeAll(s);
  s.onServerMessage(transcript(0, 1, "Hello there.", "", { final: true, startS: 0.1, endS: 1.2, seed: SEED }), 1);
  const words = [{ text: "Hello", startS: 0.2, endS: 0.6 }, { text: "there", startS: 0.6, endS: 1.1 }];
  const timings = { kind: "word_timings", eventSeq: 2, segmentId: 0, words };
  assert.deepEqual(s.onServerMessage(timings, 1.1), [{ kind: "word_timings", segmentId: 0, words }]);
  assert.deepEqual(s.onServerMessage(timings, 1.2), []); // replayed after a resume: once only
  assert.equal(s.stats.duplicateEvents, 1);
  const plain = new ClientSession({ language: "English", wordTimings: true });
  connect(plain, ready("sid2", 0)); // a server without an aligner (or older than the field)
  assert.equal(plain.stats.wordTimings, false);
  assert.equal(new ClientSession().stats.wordTimings, null);
});

test("a dropped call resumes with exactly what the server had not applied", () => {
  const s = new ClientSession({ backoffInitialS: 0.1, backoffMaxS: 1.0 }, "example", () => 0.5);
  const p = [0, 1, 2, 3, 4].map((i) => packet(0, 10 * i, { start: i === 0 }));
  s.onPackets(p, 0);
  connect(s, ready("sid", 0));
  assert.deepEqual(writeAll(s).map((m) => m.seq), [1, 2, 3, 4, 5]);
  s.onServerMessage(transcript(0, 1, "a", "b"), 0.5);
  s.onServerMessage(ack(3, -1), 0.5);
  const retry = s.onDisconnect({ details: "the data channel closed", code: "UNAVAILABLE" }, 1.0);
  assert.equal(s.lifecycle, "reconnecting");
  assert.ok(!retry.newSession && retry.delayS >= 0.05 && retry.delayS <= 0.1);
  assert.equal(s.nextMessage(), null);
  const start = connect(s, ready("sid", 4), 1.2);
  assert.equal(start.sessionId, "sid");
  assert.equal(start.lastEventSeq, 1);
  const resent = writeAll(s);
  assert.deepEqual(resent.map((m) => [m.seq, m.packet.firstFrame]), [[5, 40]]);
  assert.equal(s.stats.resumes, 1);
  assert.equal(s.stats.messagesResent, 1);
  assert.deepEqual(s.onServerMessage(transcript(0, 1, "a", "b"), 1.3), []);
  assert.equal(s.stats.duplicateEvents, 1);
  assert.equal(s.onServerMessage(transcript(0, 2, "b", ""), 1.3)[0].committedDelta, "b");
});

test("a lost session is replayed into a seeded one without showing text twice", () => {
  const s = new ClientSession();
  const seg0 = [packet(0, 0, { start: true }), packet(0, 10, { end: true })];
  const seg1 = [packet(1, 50, { start: true }), packet(1, 60)];
  s.onPackets([...seg0, ...seg1], 1.0);
  connect(s, ready("old", 0));
  writeAll(s);
  s.onServerMessage(transcript(0, 1, "first.", "", { final: true, endS: 0.2, seed: SEED }), 0.1);
  assert.deepEqual(s.buffer.entries.map((e) => e.segmentId), [1, 1]);
  assert.deepEqual(shown(s.onServerMessage(transcript(1, 2, "hello", " wor"), 0.2)), [["hello", " wor"]]);
  assert.deepEqual(s.onDisconnect({ details: "no session", code: "NOT_FOUND" }, 1.0), { delayS: 0, newSession: true });
  const start = connect(s, ready("new", 0));
  assert.equal(start.sessionId, "");
  assert.deepEqual(start.seed, SEED);
  assert.deepEqual(writeAll(s).map((m) => [m.seq, m.packet]), [[1, seg1[0]], [2, seg1[1]]]);
  assert.equal(s.stats.sessionsOpened, 2);
  assert.deepEqual(s.onServerMessage(transcript(1, 1, "hel", "lo"), 1.1), []);
  assert.deepEqual(shown(s.onServerMessage(transcript(1, 2, "lo wor", "ld"), 1.2)), [[" wor", "ld"]]);
  assert.equal(s.texts.droppedChars, "hello".length);
  assert.deepEqual(s.onServerMessage(transcript(0, 3, "first.", "", { final: true }), 1.3), [{ kind: "progress", boundS: 0.5 }]);
});

test("server errors end the stream; RESOURCE_EXHAUSTED mid-stream is waited out", () => {
  const streaming = () => { const s = new ClientSession({}, "example:1"); s.onPackets([packet(0, 0, { start: true, frames: 7 })], 0); return s; };
  let s = streaming();
  s.startMessage();
  assert.throws(() => s.onDisconnect({ details: "unknown API key", code: "UNAUTHENTICATED" }, 0),
    (e) => e instanceof StreamError && e.code === "UNAUTHENTICATED");
  assert.equal(s.lifecycle, "failed");
  s = streaming();
  s.startMessage();
  assert.throws(() => s.onServerMessage(transcript(0, 1, "x"), 0), /expected Ready, got transcript/);
  s = streaming();
  s.startMessage();
  assert.throws(() => s.onServerMessage(ready("sid", 5), 0), /server applied seq 5, but only 1 were sent/);
  s = streaming();
  s.startMessage();
  assert.throws(() => s.onDisconnect({ details: "busy", code: "RESOURCE_EXHAUSTED" }, 0), /RESOURCE_EXHAUSTED/);
  s = streaming();
  connect(s, ready("sid", 0));
  assert.ok(s.onDisconnect({ details: "busy", code: "RESOURCE_EXHAUSTED" }, 0).delayS > 0);
});

test("a final before the segment's end continues the rest as the next segment", () => {
  const s = new ClientSession();
  const p = [packet(0, 0, { start: true }), packet(0, 10), packet(0, 20), packet(0, 30)];
  s.onPackets(p, 1.0);
  connect(s, ready("old", 0));
  writeAll(s);
  s.onServerMessage(transcript(0, 1, "early", "", { final: true, startS: 0, endS: 0.2, seed: SEED }), 0.1);
  assert.equal(s.boundS(), 0.2);
  assert.ok(!s.onCallClosed());
  s.onDisconnect({ details: "the server closed the stream before the end" }, 0.2);
  s.startMessage();
  s.onDisconnect({ details: "restarted", code: "NOT_FOUND" }, 0.3);
  connect(s, ready("new", 0));
  s.onPackets([packet(0, 40, { end: true }), packet(1, 80, { start: true })], 0);
  const sent = writeAll(s);
  assert.deepEqual(sent.map((m) => [m.seq, m.packet.segmentId, m.packet.firstFrame, m.packet.segmentStart]),
    [[1, 1, 20, true], [2, 1, 30, false], [3, 1, 40, false], [4, 2, 80, true]]);
  assert.ok(sent[2].packet.segmentEnd);
  assert.equal(sent[0].packet.payload, p[2].payload);
});

test("an End the server holds already is not sent again", () => {
  const s = new ClientSession({}, "x", () => 0.1);
  const p = packet(0, 0, { start: true, end: true });
  s.onPackets([p], Infinity);
  s.endInput();
  connect(s, ready("sid", 0));
  assert.deepEqual(writeAll(s).map((m) => m.kind), ["features", "end"]);
  assert.notEqual(s.checkSilence(100), null);
  s.onDisconnect({ details: "reset", code: "UNAVAILABLE" }, 1.0);
  connect(s, ready("sid", 1));
  assert.deepEqual(writeAll(s).map((m) => m.kind), ["end"]);
  assert.deepEqual(s.onDisconnect({ details: "End twice", code: "FAILED_PRECONDITION" }, 2.0), { delayS: 0, newSession: false });
  assert.equal(s.input, "end_held");
  connect(s, ready("sid", 1));
  assert.equal(s.lifecycle, "draining");
  assert.equal(s.nextMessage(), null);
  assert.ok(s.onCallClosed());
});

test("the buffer bound, silence and the offline bound", () => {
  let s = new ClientSession({ maxBufferBytes: 250 }, "example:1");
  s.onPackets([packet(0, 0, { start: true }), packet(0, 10)], 0);
  assert.throws(() => s.onPackets([packet(0, 20)], 0), /300 bytes .* buffered \(limit 250\).*example:1/);
  s = new ClientSession({ silenceTimeoutS: 2.0 });
  s.onPackets([packet(0, 0, { start: true, end: true })], Infinity);
  connect(s, ready("sid", 0), 10);
  writeAll(s);
  assert.equal(s.checkSilence(11), null);
  assert.equal(s.checkSilence(12.5), "nothing from the server for 2.5 s");
  s.onServerMessage(transcript(0, 1, "x", "", { final: true }), 12.5);
  s.onServerMessage(ack(1, 0), 12.5);
  assert.equal(s.checkSilence(100), null);
  s = new ClientSession({ maxOfflineS: 1.0, backoffInitialS: 0.1, backoffMaxS: 0.4 }, "example:1", () => 1);
  s.onPackets([packet(0, 0, { start: true, frames: 12 })], 0);
  let now = 0;
  const delays = [];
  assert.throws(() => {
    for (;;) {
      s.startMessage();
      const r = s.onDisconnect({ details: "refused", code: "UNAVAILABLE" }, now);
      delays.push(r.delayS);
      now += r.delayS;
    }
  }, (e) => e.code === "OFFLINE" && /12 feature frames \(1 messages\) were not transcribed/.test(e.message));
  assert.deepEqual(delays.slice(0, 3).map((d) => Math.round(d * 10) / 10), [0.1, 0.2, 0.4]);
});

test("a call with nothing to send writes a KeepAlive every keepaliveS", () => {
  // as test_client_session.py's: from Ready, then from any write; End first; never outside streaming
  const s = new ClientSession({ keepaliveS: 5 });
  assert.equal(s.nextMessage(100), null);
  assert.equal(s.keepaliveIn(100), null);
  connect(s, ready("sid", 0, true), 10);
  assert.equal(s.keepaliveIn(12), 3);
  assert.equal(s.nextMessage(12), null);
  let msg = s.nextMessage(15);
  assert.deepEqual(msg, { kind: "keep_alive" });
  s.sent(msg);
  assert.equal(s.stats.keepalivesSent, 1);
  assert.equal(s.stats.messagesSent, 0);
  assert.equal(s.nextMessage(19), null);
  assert.equal(s.keepaliveIn(19), 1);
  s.onPackets([packet(0, 0, { start: true })], Infinity);
  msg = s.nextMessage(19.5);
  assert.equal(msg.kind, "features");
  s.sent(msg);
  assert.equal(s.nextMessage(24), null);
  assert.equal(s.keepaliveIn(24), 0.5);
  assert.deepEqual(s.nextMessage(24.5), { kind: "keep_alive" });
  s.endInput();
  assert.deepEqual(s.nextMessage(40), { kind: "end" });
  s.sent({ kind: "end" });
  assert.equal(s.nextMessage(100), null);
  assert.equal(s.keepaliveIn(100), null);
  const never = new ClientSession({ keepaliveS: 0 });
  connect(never, ready("sid", 0, true), 0);
  assert.equal(never.nextMessage(1e6), null);
});

test("no KeepAlive to a server whose Ready does not take them", () => {
  // as test_client_session.py's: an older server ends a stream over one
  const s = new ClientSession({ keepaliveS: 5 });
  connect(s, ready("sid", 0), 0);
  assert.equal(s.keepaliveIn(1e6), null);
  assert.equal(s.nextMessage(1e6), null);
});

test("turn events: asked in Start, once each (across a replacement session too), none for final segments", () => {
  // as test_client_session.py's test_turn_events_once_each_and_on_the_users_timeline
  const s = new ClientSession({ turnEvents: true });
  s.onPackets([packet(0, 0, { start: true }), packet(0, 10, { end: true }), packet(1, 50, { start: true })], 1.0);
  const start = connect(s, { ...ready("old", 0), turnEvents: true });
  assert.equal(start.turnEvents, true);
  assert.equal(s.stats.turnEvents, true);
  writeAll(s);
  const began = { kind: "speech_started", segmentId: 0, audioS: 0.0 };
  assert.deepEqual(s.onServerMessage(turn("speech_started", 0, 0.0, 1), 0.1), [began]);
  assert.deepEqual(s.onServerMessage(turn("speech_started", 0, 0.0, 1), 0.1), []); // a resume's replay: once
  assert.deepEqual(s.onServerMessage(turn("utterance_end", 0, 0.2, 2), 0.2), [{ kind: "utterance_end", segmentId: 0, audioS: 0.2 }]);
  const final = s.onServerMessage(transcript(0, 3, "first.", "", { final: true, endS: 0.2, seed: SEED, fromFinalize: true }), 0.3);
  assert.equal(final[0].fromFinalize, true); // passed on as the server says it
  const second = { kind: "speech_started", segmentId: 1, audioS: 0.5 };
  assert.deepEqual(s.onServerMessage(turn("speech_started", 1, 0.5, 4), 0.4), [second]);
  assert.equal(s.stats.duplicateEvents, 1);
  // the server lost the session: the replacement repeats segment 1's onset, which is not shown again
  assert.deepEqual(s.onDisconnect({ details: "no session", code: "NOT_FOUND" }, 1.0), { delayS: 0, newSession: true });
  const again = connect(s, { ...ready("new", 0), turnEvents: true });
  assert.equal(again.turnEvents, true);
  assert.deepEqual(again.seed, SEED);
  writeAll(s);
  assert.deepEqual(s.onServerMessage(turn("speech_started", 1, 0.5, 1), 1.1), []);
  assert.deepEqual(s.onServerMessage(turn("utterance_end", 1, 0.9, 2), 1.2), [{ kind: "utterance_end", segmentId: 1, audioS: 0.9 }]);
  // a segment already final: its (late or repeated) turn events are not shown
  assert.deepEqual(s.onServerMessage(turn("utterance_end", 0, 0.2, 3), 1.3), []);
  assert.equal(s.stats.duplicateEvents, 3);
  // segment 1's final forgets its turns (the private set the Python one calls _turns_seen): bounded
  assert.equal(s.turnsSeen.size, 2);
  s.onServerMessage(transcript(1, 4, "second.", "", { final: true, endS: 0.9 }), 1.4);
  assert.equal(s.turnsSeen.size, 0);
  assert.equal(s.onServerMessage(turn("speech_started", 2, 1.5, 5), 1.5).length, 1);
  assert.equal(s.turnsSeen.size, 1);
  // not asked: the Start says so and the stats stay null
  const plain = new ClientSession();
  assert.equal(connect(plain, { ...ready("sid", 0), turnEvents: true }).turnEvents, false);
  assert.equal(plain.stats.turnEvents, null);
});

test("speaker labels: asked in the Start, the Ready's answer, finals with speakers, relabels once by event_seq", () => {
  const s = new ClientSession({ diarize: true });
  const start = connect(s, { ...ready("sid", 0), diarize: true });
  assert.equal(start.diarize, true);
  assert.equal(s.stats.diarize, true);
  s.onPackets([packet(0, 0, { start: true, end: true }), packet(1, 20, { start: true, end: true })], 0.5);
  writeAll(s);
  const final0 = transcript(0, 1, "one.", "", { final: true, endS: 0.1 });
  final0.event.speaker = "S1";
  assert.equal(s.onServerMessage(final0, 1.0)[0].speaker, "S1");
  const final1 = transcript(1, 2, "two.", "", { final: true, startS: 0.2, endS: 0.3 });
  final1.event.speaker = "S2";
  s.onServerMessage(final1, 1.1);
  const relabel = { kind: "speaker_label", segmentId: 0, speaker: "S2", eventSeq: 3 };
  assert.deepEqual(s.onServerMessage(relabel, 1.2), [{ kind: "relabel", segmentId: 0, speaker: "S2" }]);
  assert.deepEqual(s.onServerMessage(relabel, 1.3), []); // replayed after a resume: once
  assert.equal(s.stats.duplicateEvents, 1);
  const plain = new ClientSession({});
  assert.equal(connect(plain, { ...ready("sid", 0), diarize: true }).diarize, false);
  assert.equal(plain.stats.diarize, null);
});
