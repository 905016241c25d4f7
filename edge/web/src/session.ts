// `ClientSession`: one stream's whole state and lifecycle, sans-IO — a port of
// edge/client/session.py and the feature half of edge/client/replay.py. No network, no timers inside:
// a driver (client.ts over a WebRTC data channel) moves messages, and the clock is an argument.
//
//   session.onPackets(packets, boundS)                   from the edge pipeline (its finalize's too)
//   session.endInput()                                    the source is exhausted
//   call: write(session.startMessage())
//         session.onServerMessage(msg, now) -> [TranscriptEvent | SegmentTimings | TurnEvent
//                                                | SpeakerChange | StreamProgress]    (Ready first)
//         while ((msg = session.nextMessage())) { write(msg); session.sent(msg) }
//         session.checkSilence(now) -> reason to give the call up, or null
//         session.onCallClosed() -> true when the stream is done
//   session.onDisconnect({details, code}, now) -> {delayS, newSession}, or throws
//
// The rules: every packet stays buffered until its segment is final; a dropped call resumes the
// session (Start{sessionId, lastEventSeq}) and resends every message after the server's
// Ready.resumeAfterSeq; NOT_FOUND (the server lost the session) opens a replacement session at once,
// seeded with the last final's SessionSeed, replaying every unfinished packet from seq 1, and the
// user sees no committed text twice (ReplayFilter); a final before a segment's end splits it.
//
// Turn events (`turnEvents: true`): the Start asks for them, `stats.turnEvents` is the Ready's
// answer; each TurnEvent (speech started, utterance end) is passed on once: by event_seq, and per
// segment and kind across sessions (a replacement session repeats those of unfinished segments),
// none for segments already final. Finalize: a feature client cuts its segment in its pipeline
// (FeatureStream.finalize: the packet that ends it is `finalized`); the final says `fromFinalize`.
// Speaker labels (`diarize: true`): the Start asks for them, `stats.diarize` is the Ready's answer;
// each final says its `speaker`, and a SpeakerChange (kind "relabel") is passed on once, by event_seq.

import { CODEC_NAME } from "./protocol.js";
import type {
  ClientMessage, FeaturePacket, SegmentTimings, ServerMessage, SessionSeed, SpeakerChange, SpeakerLabel, Start, Transcript,
  TranscriptEvent, Turn, TurnEvent, WordTimings,
} from "./protocol.js";

const FRAMES_PER_SECOND = 100;
export const RETRYABLE_STATUS = new Set(["UNAVAILABLE", "INTERNAL", "UNKNOWN", "CANCELLED", "DEADLINE_EXCEEDED", "ABORTED"]);

export interface ClientOptions {
  language: string;
  context: string;
  maxOfflineS: number;
  maxBufferBytes: number;
  connectTimeoutS: number; // one attempt's wait for Ready
  silenceTimeoutS: number;
  /** A call that has written nothing for this long writes a KeepAlive (0 = never): the server ends
   * streams idle past its --idle-timeout-s (30 s), and features stop in silence. */
  keepaliveS: number;
  backoffInitialS: number;
  backoffMaxS: number;
  backoffMultiplier: number;
  /** Ask for each final segment's word timings: a SegmentTimings follows its final event (a server
   * without an aligner says no in its Ready: `stats.wordTimings` false). */
  wordTimings?: boolean;
  /** Ask for the VAD's turn events (TurnEvent: speech started, utterance end), sent as soon as the
   * server has applied the frames that decide them (`stats.turnEvents`: the server's answer). */
  turnEvents?: boolean;
  /** Ask for speaker labels (one microphone, several people): each final says its `speaker`, and a
   * SpeakerChange relabels a recent segment (`stats.diarize`: the server's answer). */
  diarize?: boolean;
}

export const DEFAULT_CLIENT_OPTIONS: ClientOptions = {
  language: "", context: "", maxOfflineS: 120, maxBufferBytes: 64 << 20, connectTimeoutS: 10, silenceTimeoutS: 30, keepaliveS: 10,
  backoffInitialS: 0.05, backoffMaxS: 2.0, backoffMultiplier: 2.0,
};

/** No final event with startS < boundS will come from this stream any more. */
export interface StreamProgress { kind: "progress"; boundS: number }

export type Lifecycle = "idle" | "connecting" | "streaming" | "draining" | "reconnecting" | "done" | "failed";
export type InputState = "open" | "finished" | "end_sent" | "end_held";

/** Why a call ended before the stream was done; `code` the call's status code name, if any. */
export interface Disconnect { details: string; code?: string | null }
export interface Retry { delayS: number; newSession: boolean }

/** The stream failed for good: `code` is the server's status code name (or BUFFER_FULL, OFFLINE, PROTOCOL). */
export class StreamError extends Error {
  constructor(readonly code: string, message: string) {
    super(`${code}: ${message}`);
  }
}

export interface PendingMessage {
  seq: number;
  segmentId: number;
  packet: FeaturePacket;
  nbytes: number;
  frames: number;
  firstFrame: number;
  segmentStartS: number | null;
  timesSent: number;
}

/** Feature packets not yet safe to forget, oldest first, contiguous seqs (edge/replay.FeatureBuffer). */
export class FeatureBuffer {
  entries: PendingMessage[] = [];
  nextSeq = 1;
  nbytes = 0;
  segmentShift = 0; // wire segment id - edge segment id (segments the server ended early)
  openSegment: number | null = null;
  reopenSegment = false;
  readonly codec = CODEC_NAME;

  addPacket(packet: FeaturePacket): PendingMessage {
    const segmentId = packet.segmentId + this.segmentShift;
    const opens = packet.segmentStart || this.reopenSegment;
    this.reopenSegment = false;
    this.openSegment = packet.segmentEnd ? null : segmentId;
    if (segmentId !== packet.segmentId || opens !== packet.segmentStart) packet = { ...packet, segmentId, segmentStart: opens };
    const entry: PendingMessage = {
      seq: this.nextSeq++, segmentId, packet, nbytes: packet.payload.length, frames: packet.frameCount,
      firstFrame: packet.firstFrame, segmentStartS: opens ? packet.firstFrame / FRAMES_PER_SECOND : null, timesSent: 0,
    };
    this.entries.push(entry);
    this.nbytes += entry.nbytes;
    return entry;
  }

  /** The message with seq `seq + 1`, if buffered. */
  after(seq: number): PendingMessage | null {
    if (!this.entries.length) return null;
    const i = seq + 1 - this.entries[0].seq;
    return i >= 0 && i < this.entries.length ? this.entries[i] : null;
  }

  renumber(): void {
    this.entries.forEach((e, i) => { e.seq = i + 1; });
    this.nextSeq = this.entries.length + 1;
  }

  onFinal(segmentId: number, endS: number | null, finalThrough: number): void {
    if (endS !== null) this.splitOpenSegment(segmentId, Math.round(endS * FRAMES_PER_SECOND));
    this.dropSegmentsThrough(finalThrough);
  }

  dropSegmentsThrough(segmentId: number): void {
    while (this.entries.length && this.entries[0].segmentId >= 0 && this.entries[0].segmentId <= segmentId) {
      this.nbytes -= this.entries.shift()!.nbytes;
    }
  }

  private splitOpenSegment(segmentId: number, endFrame: number): void {
    const stillOpen = this.openSegment === segmentId;
    const [split, continued] = this.splitSegment(segmentId, endFrame, stillOpen);
    if (!split) return;
    this.segmentShift += 1;
    if (this.openSegment !== null && this.openSegment >= segmentId) this.openSegment += 1;
    if (stillOpen && !continued) this.reopenSegment = true;
  }

  /** The server finalised `segmentId` at `endFrame`: packets of it from there on continue as
   * segment `segmentId + 1`, later segments move up by one. -> [split, continued here]. */
  splitSegment(segmentId: number, endFrame: number, stillOpen: boolean): [boolean, boolean] {
    const rest = this.entries.filter((e) => e.segmentId === segmentId && e.firstFrame >= endFrame);
    if (!stillOpen && !rest.some((e) => e.frames)) return [false, false];
    let continued = false;
    const kept: PendingMessage[] = [];
    for (const e of this.entries) {
      if (e.segmentId === segmentId && e.firstFrame >= endFrame) {
        if (!continued && e.frames === 0) {
          this.nbytes -= e.nbytes; // a bare end of the segment the server ended already
          continue;
        }
        if (!continued) e.segmentStartS = e.firstFrame / FRAMES_PER_SECOND;
        e.segmentId = segmentId + 1;
        e.packet = { ...e.packet, segmentId: e.segmentId, segmentStart: !continued };
        continued = true;
      } else if (e.segmentId > segmentId) {
        e.segmentId += 1;
        e.packet = { ...e.packet, segmentId: e.segmentId };
      }
      kept.push(e);
    }
    this.entries = kept;
    return [true, continued];
  }
}

/** Committed text per segment as the user has it; drops what a replacement session re-sends. */
export class ReplayFilter {
  delivered = new Map<number, string>();
  shownPartial = new Map<number, string>();
  sessionText = new Map<number, string>();
  droppedChars = 0;
  mismatches = 0;

  newSession(): void {
    this.sessionText.clear();
  }

  forgetThrough(segmentId: number): void {
    for (const texts of [this.delivered, this.shownPartial, this.sessionText]) {
      for (const s of [...texts.keys()]) if (s <= segmentId) texts.delete(s);
    }
  }

  filter(segmentId: number, committedDelta: string, partial: string, isFinal: boolean): [string, string] | null {
    const before = this.sessionText.get(segmentId) ?? "";
    const text = before + committedDelta;
    this.sessionText.set(segmentId, text);
    const have = this.delivered.get(segmentId) ?? "";
    if (!(text.startsWith(have) || have.startsWith(text))) this.mismatches += 1;
    const delta = text.length > have.length ? text.slice(have.length) : "";
    this.droppedChars += committedDelta.length - delta.length;
    const committed = have + delta;
    const hypothesis = text + partial;
    const shown = isFinal ? "" : hypothesis.length > committed.length ? hypothesis.slice(committed.length) : "";
    const catchingUp = before.length < have.length;
    if (catchingUp && !delta && !isFinal && (hypothesis.length <= have.length || shown === (this.shownPartial.get(segmentId) ?? ""))) {
      return null;
    }
    this.delivered.set(segmentId, committed);
    this.shownPartial.set(segmentId, shown);
    return [delta, shown];
  }
}

export interface TransportStats {
  sessionsOpened: number;
  resumes: number;
  failedAttempts: number;
  lastFailure: string;
  messagesSent: number;
  messagesResent: number;
  framesSent: number;
  framesProduced: number;
  payloadBytesProduced: number;
  duplicateEvents: number;
  keepalivesSent: number;
  /** The server's answer to `wordTimings` (its latest Ready); null: not asked, or no Ready yet. */
  wordTimings: boolean | null;
  /** The server's answer to `turnEvents` (its latest Ready); null: not asked, or no Ready yet. */
  turnEvents: boolean | null;
  /** The server's answer to `diarize` (its latest Ready); null: not asked, or no Ready yet. */
  diarize: boolean | null;
}

// what the user sees of a stream, in order: transcript events, word timings and turn events (when
// asked for), progress
export type SessionOutput = TranscriptEvent | StreamProgress | SegmentTimings | TurnEvent | SpeakerChange;

/** One stream's state, from the first Start to the last final (see the top of this file). */
export class ClientSession {
  readonly options: ClientOptions;
  lifecycle: Lifecycle = "idle";
  input: InputState = "open";
  sessionId = "";
  seed: SessionSeed | null = null;
  lastEventSeq = 0;
  lastFinalSegment = -1;
  sentThrough = 0;
  ackedSeq = 0;
  lastHeard = 0;
  private now = 0; // the clock at the latest nextMessage(now)
  private lastWritten = 0; // clock time of this call's last write
  private keepAliveOk = false; // this call's Ready: the server takes KeepAlive
  newSegmentBoundS = 0;
  readonly buffer = new FeatureBuffer();
  readonly texts = new ReplayFilter();
  readonly stats: TransportStats = {
    sessionsOpened: 0, resumes: 0, failedAttempts: 0, lastFailure: "", messagesSent: 0, messagesResent: 0,
    framesSent: 0, framesProduced: 0, payloadBytesProduced: 0, duplicateEvents: 0, keepalivesSent: 0, wordTimings: null,
    turnEvents: null, diarize: null,
  };
  private offlineSince: number | null = null;
  private failures = 0;
  private connectedThisCall = false;
  private writing: PendingMessage | null = null;
  // turn events passed on, per segment not yet final ("segmentId:kind"): a replacement session repeats them
  private turnsSeen = new Set<string>();

  constructor(options: Partial<ClientOptions> = {}, readonly target = "the server", private readonly random = Math.random) {
    this.options = { ...DEFAULT_CLIENT_OPTIONS, ...options };
  }

  // ---- input ----

  onPackets(packets: FeaturePacket[], newSegmentBoundS: number): StreamProgress {
    this.newSegmentBoundS = Math.max(this.newSegmentBoundS, newSegmentBoundS);
    for (const p of packets) {
      this.buffer.addPacket(p);
      this.stats.framesProduced += p.frameCount;
      this.stats.payloadBytesProduced += p.payload.length;
      if (this.buffer.nbytes > this.options.maxBufferBytes) {
        throw this.fail(new StreamError("BUFFER_FULL", `${this.buffer.nbytes} bytes not yet transcribed are buffered (limit ` +
          `${this.options.maxBufferBytes}): the server at ${this.target} is too slow or away`));
      }
    }
    return { kind: "progress", boundS: this.boundS() };
  }

  endInput(): void {
    if (this.input === "open") this.input = "finished";
  }

  boundS(): number {
    const head = this.buffer.entries[0];
    if (!head || head.segmentStartS === null) return this.newSegmentBoundS;
    return Math.min(this.newSegmentBoundS, head.segmentStartS);
  }

  // ---- one call ----

  startMessage(): Start {
    this.lifecycle = "connecting";
    this.connectedThisCall = false;
    return {
      kind: "start", language: this.options.language, context: this.options.context, codec: this.buffer.codec,
      sessionId: this.sessionId, lastEventSeq: this.sessionId ? this.lastEventSeq : 0, seed: this.sessionId ? null : this.seed,
      wordTimings: this.options.wordTimings ?? false, turnEvents: this.options.turnEvents ?? false,
      diarize: this.options.diarize ?? false,
    };
  }

  onServerMessage(msg: ServerMessage | null, now: number): SessionOutput[] {
    this.lastHeard = now;
    if (this.lifecycle === "connecting") {
      if (msg?.kind !== "ready") throw this.fail(new StreamError("PROTOCOL", `expected Ready, got ${msg?.kind ?? null}`));
      this.onReady(msg.sessionId, msg.resumeAfterSeq, msg.keepAlive);
      if (this.options.wordTimings) this.stats.wordTimings = msg.wordTimings;
      if (this.options.turnEvents) this.stats.turnEvents = msg.turnEvents;
      if (this.options.diarize) this.stats.diarize = msg.diarize;
      return [];
    }
    if (msg?.kind === "transcript") return this.onTranscript(msg);
    if (msg?.kind === "word_timings") return this.onWordTimings(msg);
    if (msg?.kind === "turn") return this.onTurn(msg);
    if (msg?.kind === "speaker_label") return this.onSpeakerLabel(msg);
    if (msg?.kind === "ack") return this.onAck(msg.seq, msg.lastFinalSegment);
    return [];
  }

  /** The next message to write (then `sent`), or null. Given the clock `now` (seconds), a KeepAlive
   * once the call has written nothing for `keepaliveS` (see `keepaliveIn`). */
  nextMessage(now?: number): ClientMessage | null {
    if (this.lifecycle !== "streaming") return null;
    if (now !== undefined) this.now = now;
    this.writing = this.buffer.after(this.sentThrough);
    if (this.writing) return { kind: "features", seq: this.writing.seq, packet: this.writing.packet };
    if (this.input === "finished" || this.input === "end_sent") return { kind: "end" };
    if (now !== undefined) {
      const due = this.keepaliveIn(now);
      if (due !== null && due <= 0) return { kind: "keep_alive" };
    }
    return null;
  }

  /** Seconds until a KeepAlive is due (<= 0: now), null: none will be (not streaming, keepaliveS 0, or
   * the call's Ready did not say the server takes them). */
  keepaliveIn(now: number): number | null {
    if (this.lifecycle !== "streaming" || this.options.keepaliveS <= 0 || !this.keepAliveOk) return null;
    return this.lastWritten + this.options.keepaliveS - now;
  }

  sent(msg: ClientMessage): void {
    this.lastWritten = this.now;
    if (msg.kind === "keep_alive") {
      this.stats.keepalivesSent += 1;
      return;
    }
    if (msg.kind === "end") {
      this.input = "end_sent";
      this.lifecycle = "draining";
      return;
    }
    const entry = this.writing;
    this.writing = null;
    if (!entry || msg.kind !== "features" || entry.seq !== msg.seq) throw new Error("sent() takes nextMessage()'s message");
    this.sentThrough = entry.seq;
    this.stats.messagesSent += 1;
    this.stats.framesSent += entry.frames;
    if (entry.timesSent) this.stats.messagesResent += 1;
    entry.timesSent += 1;
    this.drainIfAllSent();
  }

  checkSilence(now: number): string | null {
    const endWritten = this.lifecycle === "draining" && this.input === "end_sent";
    const owed = this.sentThrough > this.ackedSeq || endWritten || this.buffer.entries.length > 0;
    const quietS = now - this.lastHeard;
    if (owed && quietS > this.options.silenceTimeoutS) return `nothing from the server for ${quietS.toFixed(1)} s`;
    return null;
  }

  onCallClosed(): boolean {
    if (this.lifecycle === "draining" || this.input === "end_held") {
      this.lifecycle = "done";
      return true;
    }
    return false;
  }

  onDisconnect(failure: Disconnect, now: number): Retry {
    const o = this.options, code = failure.code ?? null;
    if (code === "NOT_FOUND" && this.sessionId) {
      this.prepareReplacement(); // a replacement session at once: the server is evidently up
      this.lifecycle = "reconnecting";
      return { delayS: 0, newSession: true };
    }
    if (code === "FAILED_PRECONDITION" && this.input === "end_sent") {
      this.input = "end_held";
      this.lifecycle = "reconnecting";
      return { delayS: 0, newSession: false };
    }
    const busy = code === "RESOURCE_EXHAUSTED" && this.stats.sessionsOpened > 0;
    if (code !== null && !RETRYABLE_STATUS.has(code) && !busy) throw this.fail(new StreamError(code, failure.details));
    const reason = code ? `${code}: ${failure.details}` : failure.details;
    if (this.connectedThisCall) {
      this.offlineSince = null;
      this.failures = 0;
    }
    this.stats.failedAttempts += 1;
    this.stats.lastFailure = reason;
    if (this.offlineSince === null) this.offlineSince = now;
    const offlineS = now - this.offlineSince;
    if (offlineS >= o.maxOfflineS) {
      throw this.fail(new StreamError("OFFLINE", `server ${this.target} unreachable for ${offlineS.toFixed(1)} s ` +
        `(maxOfflineS=${o.maxOfflineS}); last error: ${reason}${this.notTranscribed()}`));
    }
    let delay = Math.min(o.backoffMaxS, o.backoffInitialS * o.backoffMultiplier ** this.failures);
    delay *= 0.5 + 0.5 * this.random(); // jitter: clients cut off together retry apart
    this.failures += 1;
    this.lifecycle = "reconnecting";
    return { delayS: Math.min(delay, o.maxOfflineS - offlineS), newSession: false };
  }

  notTranscribed(): string {
    const pending = this.buffer.entries.reduce((n, e) => n + e.frames, 0);
    return `; ${pending} feature frames (${this.buffer.entries.length} messages) were not transcribed`;
  }

  // ---- inside ----

  private onReady(sessionId: string, resumeAfterSeq: number, keepAlive: boolean): void {
    if (!this.sessionId) this.stats.sessionsOpened += 1;
    else this.stats.resumes += 1;
    this.sessionId = sessionId;
    if (resumeAfterSeq >= this.buffer.nextSeq) {
      throw this.fail(new StreamError("PROTOCOL", `server applied seq ${resumeAfterSeq}, but only ${this.buffer.nextSeq - 1} were sent`));
    }
    this.sentThrough = this.ackedSeq = resumeAfterSeq;
    this.keepAliveOk = keepAlive;
    this.lastWritten = this.now = this.lastHeard;
    this.connectedThisCall = true;
    this.lifecycle = "streaming";
    this.drainIfAllSent();
  }

  private drainIfAllSent(): void {
    if (this.input === "end_held" && this.buffer.after(this.sentThrough) === null) this.lifecycle = "draining";
  }

  private onTranscript(t: Transcript): SessionOutput[] {
    if (t.eventSeq && t.eventSeq <= this.lastEventSeq) {
      this.stats.duplicateEvents += 1;
      return [];
    }
    this.lastEventSeq = Math.max(this.lastEventSeq, t.eventSeq);
    const out: SessionOutput[] = [];
    const event = this.visible(t.event);
    if (event) out.push(event);
    if (t.event.isFinal) {
      if (t.seed) this.seed = t.seed;
      this.segmentFinal(t.event.segmentId, t.event.endS);
      out.push({ kind: "progress", boundS: this.boundS() });
    }
    return out;
  }

  private onWordTimings(w: WordTimings): SessionOutput[] {
    if (w.eventSeq && w.eventSeq <= this.lastEventSeq) {
      this.stats.duplicateEvents += 1;
      return [];
    }
    this.lastEventSeq = Math.max(this.lastEventSeq, w.eventSeq);
    return [{ kind: "word_timings", segmentId: w.segmentId, words: w.words }];
  }

  /** A better speaker for a final segment: once (eventSeq). */
  private onSpeakerLabel(l: SpeakerLabel): SessionOutput[] {
    if (l.eventSeq && l.eventSeq <= this.lastEventSeq) {
      this.stats.duplicateEvents += 1;
      return [];
    }
    this.lastEventSeq = Math.max(this.lastEventSeq, l.eventSeq);
    return [{ kind: "relabel", segmentId: l.segmentId, speaker: l.speaker }];
  }

  /** A turn event: once (eventSeq, and per segment and kind across sessions), on the user's timeline
   * (a feature stream's: as the server sends it). */
  private onTurn(t: Turn): SessionOutput[] {
    if (t.eventSeq && t.eventSeq <= this.lastEventSeq) {
      this.stats.duplicateEvents += 1;
      return [];
    }
    this.lastEventSeq = Math.max(this.lastEventSeq, t.eventSeq);
    const e = t.turn;
    const key = `${e.segmentId}:${e.kind}`;
    if (e.segmentId <= this.lastFinalSegment || this.turnsSeen.has(key)) {
      this.stats.duplicateEvents += 1;
      return [];
    }
    this.turnsSeen.add(key);
    return [{ kind: e.kind, segmentId: e.segmentId, audioS: e.audioS }];
  }

  private onAck(seq: number, lastFinalSegment: number): SessionOutput[] {
    this.ackedSeq = Math.max(this.ackedSeq, seq);
    // the server's finals come before its Ack on the stream, so they are with us
    if (lastFinalSegment > this.lastFinalSegment) {
      this.segmentFinal(lastFinalSegment, null);
      return [{ kind: "progress", boundS: this.boundS() }];
    }
    return [];
  }

  private segmentFinal(segmentId: number, endS: number | null): void {
    this.lastFinalSegment = Math.max(this.lastFinalSegment, segmentId);
    this.texts.forgetThrough(this.lastFinalSegment);
    for (const key of [...this.turnsSeen]) {
      if (Number(key.slice(0, key.indexOf(":"))) <= this.lastFinalSegment) this.turnsSeen.delete(key);
    }
    this.buffer.onFinal(segmentId, endS, this.lastFinalSegment);
  }

  private visible(e: TranscriptEvent): TranscriptEvent | null {
    if (e.segmentId <= this.lastFinalSegment) {
      this.stats.duplicateEvents += 1;
      return null;
    }
    const v = this.texts.filter(e.segmentId, e.committedDelta, e.partial, e.isFinal);
    if (v === null) return null;
    return { ...e, committedDelta: v[0], partial: v[1] };
  }

  private prepareReplacement(): void {
    this.sessionId = "";
    if (this.input === "end_sent" || this.input === "end_held") this.input = "finished";
    this.lastEventSeq = 0;
    this.ackedSeq = 0;
    this.texts.newSession();
    this.buffer.renumber();
  }

  private fail(error: StreamError): StreamError {
    this.lifecycle = "failed";
    return error;
  }
}
