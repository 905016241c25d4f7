// The session protocol's messages as plain data (shared/protocol.py and shared/transcript.py):
// proto names stay in proto.ts.
//
// Finalize on request: a feature client cuts its own segment (FeatureStream.finalize); the packet
// that ends it says `finalized`, and the segment's final TranscriptEvent says `fromFinalize`.
// Turn events (sessions whose Start says `turnEvents`, servers whose Ready says so): a `Turn` per
// segment onset (speech_started) and end (utterance_end), in the event log with the Transcripts.

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
  /** With segmentEnd: the segment ends here because the client asked to finalize (speech that
   * goes on is the next segment); its final says `fromFinalize`. */
  finalized?: boolean;
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
  /** On finals: the segment ended because the client asked to finalize (a `finalized` packet),
   * not by the VAD's end of speech or the input's end. */
  fromFinalize: boolean;
  /** On finals of sessions that asked (`diarize`): who said the segment, "S1", "S2", ... (a later
   * SpeakerChange may move it); "" otherwise. */
  speaker?: string;
}

/** A turn boundary as the VAD knows it, sent at once, never waiting for text (shared/transcript.py
 * TurnEvent). speech_started: a segment opens, `audioS` its onset (with the VAD's padding);
 * utterance_end: its speech is over, `audioS` its end (plus the padding, or where a finalize cut
 * it). Seconds on the stream's timeline, as TranscriptEvent.startS. Every segment has one of each,
 * in that order, the utterance_end before the segment's final TranscriptEvent. */
export interface TurnEvent { kind: "speech_started" | "utterance_end"; segmentId: number; audioS: number }

/** One word of committed text and when it was said, on the stream's timeline (seconds). */
export interface TimedWord { text: string; startS: number; endS: number }

/** A final segment's words with their times (the server's forced aligner), after its final event;
 * the words of its committed text as the aligner splits them. Empty words: nothing to time. */
export interface SegmentTimings { kind: "word_timings"; segmentId: number; words: TimedWord[] }

/** A better speaker for a segment whose final came before (sessions that asked, `diarize`): additive,
 * its text never changes, only who said it; a later one for the same segment replaces this. */
export interface SpeakerChange { kind: "relabel"; segmentId: number; speaker: string }

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
  /** Ask for the VAD's turn events (`Turn`: speech started, utterance end). */
  turnEvents?: boolean;
  /** Ask for speaker labels: finals say their `speaker`, relabels come as `SpeakerLabel`s. */
  diarize?: boolean;
}
export interface Features { kind: "features"; seq: number; packet: FeaturePacket }
export interface End { kind: "end" }
/** Nothing to send for a while (features in a silence): the server's idle timeout must not reap the stream. */
export interface KeepAlive { kind: "keep_alive" }
export type ClientMessage = Start | Features | End | KeepAlive;

/** keepAlive: the server takes KeepAlive (a client writes them only then: an older server ends the stream over one).
 * wordTimings / turnEvents: the session asked for word timings / turn events and this server sends them. */
export interface Ready {
  kind: "ready"; sessionId: string; resumeAfterSeq: number; lastFinalSegment: number; keepAlive: boolean; wordTimings: boolean;
  turnEvents: boolean; diarize: boolean;
}
export interface Transcript { kind: "transcript"; event: TranscriptEvent; eventSeq: number; seed: SessionSeed | null }
/** A final segment's word timings as the wire carries them: in the event log, eventSeq counting on with the Transcripts'. */
export interface WordTimings { kind: "word_timings"; eventSeq: number; segmentId: number; words: TimedWord[] }
/** A turn event as the wire carries it: in the event log, eventSeq counting on with the Transcripts'. */
export interface Turn { kind: "turn"; turn: TurnEvent; eventSeq: number }
/** A relabel as the wire carries it: in the event log, eventSeq counting on with the Transcripts'. */
export interface SpeakerLabel { kind: "speaker_label"; segmentId: number; speaker: string; eventSeq: number }
export interface Ack { kind: "ack"; seq: number; lastFinalSegment: number }
export interface ServerError { kind: "error"; code: string; message: string }
export type ServerMessage = Ready | Transcript | WordTimings | Turn | SpeakerLabel | Ack | ServerError;
