// The wire boundary: shared/protocol messages <-> `harken.v1` protobuf bytes (proto/harken.proto),
// encoded by hand for the few messages a client needs. Fields go out in field-number order with
// proto3's rules (zero values of implicit-presence fields omitted), which is what the Python
// protobuf runtime writes: the same message gives the same bytes (tests compare them).
//
// Written: Start (1 language, 2 context, 3 codec, 4 session_id, 5 seed, 6 last_event_seq,
// 7 word_timings, 8 turn_events, 10 diarize), Features (1..9, 10 finalized: with segment_end, the client cut
// its segment on request), End, KeepAlive. Read: Ready (... 5 word_timings, 6 turn_events, 7 diarize),
// Transcript (... 10 event_seq, 11 from_finalize, 13 speaker), Ack, Error, WordTimings, SpeakerLabel
// (ServerMessage 7: 1 segment_id, 2 speaker, 3 event_seq), and Turn
// (ServerMessage 6: 1 segment_id, 2 kind enum (1 SPEECH_STARTED, 2 UTTERANCE_END), 3 audio_s
// double, 4 event_seq); a Turn of a kind this client does not know reads as null, as in Python.

import { crc32c } from "./crc32c.js";
import type { ClientMessage, FeaturePacket, ServerMessage, SessionSeed, TimedWord, TurnEvent } from "./protocol.js";

const utf8 = new TextEncoder();
const utf8d = new TextDecoder();

class Writer {
  bytes: number[] = [];

  varint(value: number | bigint): void {
    let v = BigInt.asUintN(64, BigInt(value));
    for (;;) {
      const byte = Number(v & 0x7fn);
      v >>= 7n;
      this.bytes.push(byte | (v ? 0x80 : 0));
      if (!v) return;
    }
  }

  tag(field: number, wireType: number): void {
    this.varint(field * 8 + wireType);
  }

  uint(field: number, value: number): void { // uint32/uint64/int64/bool, omitted when 0
    if (value) { this.tag(field, 0); this.varint(value); }
  }

  bool(field: number, value: boolean): void {
    if (value) { this.tag(field, 0); this.varint(1); }
  }

  bytesField(field: number, value: Uint8Array, always = false): void {
    if (!value.length && !always) return;
    this.tag(field, 2);
    this.varint(value.length);
    for (const b of value) this.bytes.push(b);
  }

  string(field: number, value: string): void {
    this.bytesField(field, utf8.encode(value));
  }

  fixed32(field: number, value: number): void {
    this.tag(field, 5);
    const b = new Uint8Array(4);
    new DataView(b.buffer).setUint32(0, value >>> 0, true);
    this.bytes.push(...b);
  }

  float(field: number, value: number, always = false): void {
    const b = new Uint8Array(4);
    new DataView(b.buffer).setFloat32(0, value, true);
    if (!always && b.every((x) => x === 0)) return; // +0.0 is the default; -0.0 has a bit set
    this.tag(field, 5);
    this.bytes.push(...b);
  }

  finish(): Uint8Array {
    return Uint8Array.from(this.bytes);
  }
}

function seedBytes(s: SessionSeed): Uint8Array {
  const w = new Writer();
  w.bool(1, true);
  w.float(2, s.runningMaxLog10);
  w.string(3, s.contextTail);
  w.uint(4, s.nextSegmentId);
  return w.finish();
}

/** The `Features` message of one packet, its payload's CRC32C beside it. */
export function featuresBytes(seq: number, p: FeaturePacket): Uint8Array {
  const w = new Writer();
  w.uint(1, seq);
  w.uint(2, p.segmentId);
  w.uint(3, p.firstFrame);
  w.uint(4, p.frameCount);
  w.bool(5, p.segmentStart);
  w.bool(6, p.segmentEnd);
  w.bytesField(7, p.payload);
  w.float(8, p.runningMaxLog10, true); // `optional`: present whenever set
  w.fixed32(9, crc32c(p.payload));
  w.bool(10, p.finalized ?? false);
  return w.finish();
}

/** A client message, serialized as `harken.v1.ClientMessage`. */
export function encodeClientMessage(msg: ClientMessage): Uint8Array {
  const w = new Writer();
  if (msg.kind === "start") {
    const s = new Writer();
    s.string(1, msg.language);
    s.string(2, msg.context);
    s.string(3, msg.codec);
    s.string(4, msg.sessionId);
    if (msg.seed) s.bytesField(5, seedBytes(msg.seed), true);
    s.uint(6, msg.lastEventSeq);
    s.bool(7, msg.wordTimings ?? false);
    s.bool(8, msg.turnEvents ?? false);
    s.bool(10, msg.diarize ?? false);
    w.bytesField(1, s.finish(), true);
  } else if (msg.kind === "features") {
    w.bytesField(2, featuresBytes(msg.seq, msg.packet), true);
  } else if (msg.kind === "keep_alive") {
    w.bytesField(6, new Uint8Array(0), true);
  } else {
    w.bytesField(5, new Uint8Array(0), true);
  }
  return w.finish();
}

// ---- decoding ----

type Field = bigint | Uint8Array | number; // varint | LEN | fixed32/64 (as their bytes' DataView value)

function fields(buf: Uint8Array): Map<number, Field[]> {
  const out = new Map<number, Field[]>();
  let i = 0;
  const varint = (): bigint => {
    let v = 0n, shift = 0n, b: number;
    do {
      if (i >= buf.length) throw new Error("truncated protobuf message");
      b = buf[i++];
      v |= BigInt(b & 0x7f) << shift;
      shift += 7n;
    } while (b & 0x80);
    return v;
  };
  while (i < buf.length) {
    const tag = Number(varint()), field = tag >>> 3, type = tag & 7;
    let value: Field;
    if (type === 0) value = varint();
    else if (type === 2) {
      const n = Number(varint());
      if (i + n > buf.length) throw new Error("truncated protobuf message");
      value = buf.subarray(i, i + n);
      i += n;
    } else if (type === 5) { value = new DataView(buf.buffer, buf.byteOffset + i, 4).getFloat32(0, true); i += 4; }
    else if (type === 1) { value = new DataView(buf.buffer, buf.byteOffset + i, 8).getFloat64(0, true); i += 8; }
    else throw new Error(`unsupported protobuf wire type ${type}`);
    const list = out.get(field) ?? [];
    list.push(value);
    out.set(field, list);
  }
  return out;
}

const last = (f: Map<number, Field[]>, n: number): Field | undefined => f.get(n)?.at(-1);
const str = (f: Map<number, Field[]>, n: number) => { const v = last(f, n); return v instanceof Uint8Array ? utf8d.decode(v) : ""; };
const uint = (f: Map<number, Field[]>, n: number) => { const v = last(f, n); return typeof v === "bigint" ? Number(v) : 0; };
const int64 = (f: Map<number, Field[]>, n: number) => { const v = last(f, n); return typeof v === "bigint" ? Number(BigInt.asIntN(64, v)) : 0; };
const real = (f: Map<number, Field[]>, n: number) => { const v = last(f, n); return typeof v === "number" ? v : 0; };
const sub = (f: Map<number, Field[]>, n: number) => { const v = last(f, n); return v instanceof Uint8Array ? fields(v) : null; };

function seed(f: Map<number, Field[]> | null): SessionSeed | null {
  if (!f || !uint(f, 1)) return null;
  return { runningMaxLog10: real(f, 2), contextTail: str(f, 3), nextSegmentId: uint(f, 4) };
}

// `Turn.Kind`'s values (KIND_UNSPECIFIED = 0 is none of them)
const TURN_KINDS: Record<number, TurnEvent["kind"] | undefined> = { 1: "speech_started", 2: "utterance_end" };

/** A received `harken.v1.ServerMessage`; null for an empty one (no kind set). */
export function decodeServerMessage(buf: Uint8Array): ServerMessage | null {
  const m = fields(buf);
  let f: Map<number, Field[]> | null;
  if ((f = sub(m, 1))) {
    return {
      kind: "ready", sessionId: str(f, 1), resumeAfterSeq: uint(f, 2), lastFinalSegment: int64(f, 3), keepAlive: uint(f, 4) !== 0,
      wordTimings: uint(f, 5) !== 0, turnEvents: uint(f, 6) !== 0, diarize: uint(f, 7) !== 0,
    };
  }
  if ((f = sub(m, 2))) {
    const speaker = str(f, 13); // only on finals of sessions that asked for speaker labels
    return {
      kind: "transcript", eventSeq: uint(f, 10), seed: seed(sub(f, 9)),
      event: { segmentId: uint(f, 1), committedDelta: str(f, 2), partial: str(f, 3), stability: real(f, 4),
               startS: real(f, 5), endS: real(f, 6), language: str(f, 7), isFinal: !!uint(f, 8),
               fromFinalize: !!uint(f, 11), ...(speaker ? { speaker } : {}) },
    };
  }
  if ((f = sub(m, 5))) {
    const words: TimedWord[] = (f.get(2) ?? []).filter((v): v is Uint8Array => v instanceof Uint8Array).map((b) => {
      const w = fields(b);
      return { text: str(w, 1), startS: real(w, 2), endS: real(w, 3) };
    });
    return { kind: "word_timings", segmentId: uint(f, 1), words, eventSeq: uint(f, 3) };
  }
  if ((f = sub(m, 6))) {
    const kind = TURN_KINDS[uint(f, 2)];
    if (kind === undefined) return null; // a kind from a newer server: nothing this client knows to show
    return { kind: "turn", turn: { kind, segmentId: uint(f, 1), audioS: real(f, 3) }, eventSeq: uint(f, 4) };
  }
  if ((f = sub(m, 7))) return { kind: "speaker_label", segmentId: uint(f, 1), speaker: str(f, 2), eventSeq: uint(f, 3) };
  if ((f = sub(m, 3))) return { kind: "ack", seq: uint(f, 1), lastFinalSegment: int64(f, 2) };
  if ((f = sub(m, 4))) return { kind: "error", code: str(f, 1), message: str(f, 2) };
  return null;
}
