// The session protocol's messages as plain data (shared/protocol.py and shared/transcript.py):
// proto names stay in proto.ts.

/** `Start.codec` of feature payloads of this codec, wire format v1 (codec.ts). */
export const CODEC_NAME = "harken-mel/1";

/** One `Features` message's worth: frames [firstFrame, firstFrame + frameCount) of a segment. */
export interface FeaturePacket {
  segmentId: number;
  firstFrame: number;
  frameCount: number;
  segmentStart: boolean;
  segmentEnd: boolean;
  payload: Uint8Array; // one self-contained codec payload (codec.ts)
  runningMaxLog10: number; // the floor state after these frames
}

/** The state a session carries from one segment to the next (on final events). */
export interface SessionSeed {
  runningMaxLog10: number;
  contextTail: string;
  nextSegmentId: number;
}

/** One transcript update of a segment (Riva / StreamingRecognize conventions). */
export interface TranscriptEvent {
  segmentId: number;
  committedDelta: string; // appended to the segment's text, never retracted
  partial: string; // the current guess after the committed text
  stability: number;
  startS: number;
  endS: number;
  language: string;
  isFinal: boolean;
}

/** One word of committed text and when it was said, on the stream's timeline (seconds). */
export interface TimedWord { text: string; startS: number; endS: number }

/** A final segment's words with their times (the server's forced aligner), after its final event;
 * the words of its committed text as the aligner splits them. Empty words: nothing to time. */
export interface SegmentTimings { kind: "word_timings"; segmentId: number; words: TimedWord[] }

export interface Start {
  kind: "start";
  language: string;
  context: string;
  codec: string;
  sessionId: string;
  lastEventSeq: number;
  seed: SessionSeed | null;
  /** Ask for each final segment's word timings (`harken serve --aligner`). */
  wordTimings?: boolean;
}
export interface Features { kind: "features"; seq: number; packet: FeaturePacket }
export interface End { kind: "end" }
/** Nothing to send for a while (features in a silence): the server's idle timeout must not reap the stream. */
export interface KeepAlive { kind: "keep_alive" }
export type ClientMessage = Start | Features | End | KeepAlive;

/** keepAlive: the server takes KeepAlive (a client writes them only then: an older server ends the stream over one).
 * wordTimings: the session asked for word timings and this server sends them. */
export interface Ready {
  kind: "ready"; sessionId: string; resumeAfterSeq: number; lastFinalSegment: number; keepAlive: boolean; wordTimings: boolean;
}
export interface Transcript { kind: "transcript"; event: TranscriptEvent; eventSeq: number; seed: SessionSeed | null }
/** A final segment's word timings as the wire carries them: in the event log, eventSeq counting on with the Transcripts'. */
export interface WordTimings { kind: "word_timings"; eventSeq: number; segmentId: number; words: TimedWord[] }
export interface Ack { kind: "ack"; seq: number; lastFinalSegment: number }
export interface ServerError { kind: "error"; code: string; message: string }
export type ServerMessage = Ready | Transcript | WordTimings | Ack | ServerError;
