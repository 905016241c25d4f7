// The edge pipeline: PCM -> VAD-gated, compressed feature packets (a port of edge/pipeline.py).
// Every sample goes through the streaming log-mel and the running-max floor; silero-vad decides
// which frames belong to speech; frames of a segment leave in packets of `packetFrames`, each an
// independent codec payload. Silence sends nothing. Same pushes, same packets as the Python edge.
//
// As edge/pipeline.py: frames of an open segment leave as soon as they are final and the VAD can no
// longer end the segment before them (SpeechSegmenter.earliestEndSample): while speech goes on that
// bound runs ahead of the audio, inside a pause frames past the pause's start plus the padding wait
// for the VAD's decision. So a segment's packets end exactly at the VAD's end (on the frame grid)
// and what a stream sends is a function of its samples alone, however they were cut into pieces.
// On the frame grid a segment [startSample, endSample) is frames [startSample // 160,
// ceil(endSample / 160)), except that a start never goes before the previous segment's end frame.
//
// finalize() (the speaker stopped, push-to-talk released; edge/pipeline.py FeatureStream.finalize):
// the open segment ends at the audio pushed so far (SpeechSegmenter.finalize), its end capped at the
// frames computed so its last packet, `finalized`, leaves at once; speech that goes on is the next
// segment, starting at exactly the frame where the finalized one ended (no frame lost).

import { DEFAULT_MODE, DYNAMIC_RANGE_LOG10, N_MELS, encodeFrames } from "./codec.js";
import type { Frames, Mode } from "./codec.js";
import { HOP_LENGTH, RunningMaxFloor, StreamingLogMel } from "./features.js";
import type { OrtModel } from "./ort.js";
import type { FeaturePacket } from "./protocol.js";
import { DEFAULT_VAD, SileroVad, StreamingVad } from "./vad.js";
import type { SegmentEvent, VadOptions } from "./vad.js";

export const MAX_PACKET_FRAMES = 72;
const VAD_WINDOW_MS = 32;

interface Segment {
  segmentId: number;
  nextFrame: number; // first frame not yet sent
  endFrame: number | null; // exclusive; null while the segment is open
  started: boolean; // a packet with segmentStart has gone out
  finalized: boolean; // ended by a finalize request: its last packet says so
}

export interface FeatureStreamOptions {
  mode?: Mode;
  packetFrames?: number;
  vad?: VadOptions;
  runningMaxLog10?: number; // seed from a previous session to continue its floor
  /** Sees every push's raw log10-mel frames (tests and benchmarks compare them with Python's). */
  onFrames?: (raw: Frames) => void;
}

/** The two ONNX models of the edge, loaded once and shared by every stream. */
export interface EdgeModels { logmel: OrtModel; vad: OrtModel }

function lookbackFrames(o: VadOptions): number {
  const worstMs = o.minSpeechDurationMs + o.minSilenceDurationMs + o.speechPadMs + 2 * VAD_WINDOW_MS;
  return Math.floor(worstMs / 10) + 8;
}

/** One audio stream -> FeaturePackets: push() 16 kHz mono pieces as they arrive, flush() at the end. */
export class FeatureStream {
  readonly mode: Mode;
  readonly packetFrames: number;
  readonly lookbackFrames: number;
  readonly mel: StreamingLogMel;
  readonly vad: StreamingVad;
  readonly floor: RunningMaxFloor;
  private frames: Float32Array[] = []; // floored [128] frames, oldest first
  private running: number[] = []; // the running max after each buffered frame
  private runningBefore: number; // the running max before this.frames[0] (Python's _running_before)
  private firstBuffered = 0; // absolute index of this.frames[0]
  private framesComputed = 0;
  private lastEndFrame = 0; // end frame (exclusive) of the last segment ended
  private segments: Segment[] = [];
  private cutSample = -1; // where the latest finalize ended a segment (the next may start there)
  private readonly onFrames?: (raw: Frames) => void;

  constructor(models: EdgeModels, options: FeatureStreamOptions = {}) {
    this.mode = options.mode ?? DEFAULT_MODE;
    this.packetFrames = options.packetFrames ?? 20;
    if (!(this.packetFrames >= 1 && this.packetFrames <= MAX_PACKET_FRAMES)) {
      throw new Error(`packetFrames must be 1..${MAX_PACKET_FRAMES}`);
    }
    const vadOptions = options.vad ?? DEFAULT_VAD;
    this.mel = new StreamingLogMel(models.logmel);
    this.vad = new StreamingVad(new SileroVad(models.vad), vadOptions);
    this.floor = new RunningMaxFloor(options.runningMaxLog10 ?? -Infinity);
    this.runningBefore = this.floor.maxLog10;
    this.lookbackFrames = lookbackFrames(vadOptions);
    this.onFrames = options.onFrames;
  }

  /** Frames computed so far (the stream's log-mel position). */
  get framesDone(): number {
    return this.framesComputed;
  }

  async push(pcm: Float32Array): Promise<FeaturePacket[]> {
    const frames = await this.mel.push(pcm);
    this.onFrames?.(frames);
    const events = await this.vad.push(pcm);
    return this.advance(frames, events, false);
  }

  async flush(): Promise<FeaturePacket[]> {
    const frames = await this.mel.flush(true);
    this.onFrames?.(frames);
    const events = await this.vad.flush();
    return this.advance(frames, events, true);
  }

  /** Finalize on request (the speaker stopped; push-to-talk released): the open segment ends at the
   * audio pushed so far, its last packet `finalized`, at once. Speech that goes on is the next
   * segment (SpeechSegmenter.finalize). Nothing open: no packets. Call it between pushes, in order
   * with them (a push still running has not been applied yet). */
  finalize(): FeaturePacket[] {
    return this.applyFinalize(this.vad.finalize());
  }

  /** The VAD's finalize events -> the packets they complete (FeatureStream.finalize after the VAD).
   * Public for the tests, which feed the Python edge's events and earliest end (see `advance`). */
  applyFinalize(events: SegmentEvent[],
    earliestEndSample: number | null = this.vad.segmenter.earliestEndSample): FeaturePacket[] {
    const ended = new Set(events.filter((e) => e.kind === "end").map((e) => e.segmentId));
    for (const seg of this.segments) seg.finalized = seg.finalized || ended.has(seg.segmentId);
    return this.advance({ data: new Float32Array(0), k: 0 }, events, false, earliestEndSample);
  }

  /** Raw frames and VAD events of one push -> the packets they complete. `earliestEndSample` is
   * the VAD's SpeechSegmenter.earliestEndSample after the push (Python's `_open_limit` reads it
   * there). Public for the tests, which feed the Python edge's own frames, events and earliest
   * ends to check the packets byte for byte. */
  advance(raw: Frames, events: SegmentEvent[], final: boolean,
    earliestEndSample: number | null = this.vad.segmenter.earliestEndSample): FeaturePacket[] {
    const [floored, running] = this.floor.apply(raw);
    for (let t = 0; t < floored.k; t++) {
      const col = new Float32Array(N_MELS);
      for (let b = 0; b < N_MELS; b++) col[b] = floored.data[b * floored.k + t];
      this.frames.push(col);
      this.running.push(running[t]);
    }
    this.framesComputed += floored.k;
    for (const e of events) {
      if (e.kind === "start") {
        // the VAD never starts a segment before the previous end, but on the frame grid the two
        // may fall into one frame: it belongs to the earlier segment
        let first = Math.max(Math.floor(e.startSample / HOP_LENGTH), this.firstBuffered, this.lastEndFrame);
        if (e.startSample === this.cutSample) first = this.lastEndFrame; // speech that went on after a finalize: no gap
        this.segments.push({ segmentId: e.segmentId, nextFrame: first, endFrame: null, started: false, finalized: false });
      } else {
        const seg = this.segments.find((s) => s.segmentId === e.segmentId);
        if (seg) {
          // no frame past the end has gone out: openLimit held them back
          seg.endFrame = Math.max(seg.nextFrame, Math.ceil(e.endSample / HOP_LENGTH));
          if (seg.finalized) { // at once: not a frame past those computed
            seg.endFrame = Math.max(seg.nextFrame, Math.min(seg.endFrame, this.framesComputed));
            this.cutSample = e.endSample;
          }
          this.lastEndFrame = seg.endFrame;
        }
      }
    }
    const packets = this.emit(final, earliestEndSample);
    this.trim();
    return packets;
  }

  private emit(final: boolean, earliestEndSample: number | null): FeaturePacket[] {
    const packets: FeaturePacket[] = [];
    while (this.segments.length) {
      const seg = this.segments[0];
      const endFrame = seg.endFrame;
      const limit = endFrame === null ? this.openLimit(earliestEndSample) : Math.min(endFrame, this.framesComputed);
      while (limit - seg.nextFrame >= this.packetFrames) packets.push(this.packet(seg, seg.nextFrame + this.packetFrames, false));
      const closing = endFrame !== null && (endFrame <= this.framesComputed || final);
      if (endFrame === null || !closing) break;
      packets.push(this.packet(seg, Math.min(endFrame, this.framesComputed), true));
      this.segments.shift();
    }
    return packets;
  }

  /** Frames of the open segment that may leave: those final and before the earliest end the VAD
   * can still give it (edge/pipeline.py FeatureStream._open_limit). */
  private openLimit(earliestEndSample: number | null): number {
    if (earliestEndSample === null) return this.framesComputed;
    return Math.min(this.framesComputed, Math.ceil(earliestEndSample / HOP_LENGTH));
  }

  /** The running max once frame `frame` was floored (frame -1: before the first frame)
   * (edge/pipeline.py FeatureStream._running_after). */
  private runningAfter(frame: number): number {
    const i = frame - this.firstBuffered;
    return i >= 0 ? this.running[i] : this.runningBefore;
  }

  private packet(seg: Segment, stop: number, end: boolean): FeaturePacket {
    const start = seg.nextFrame;
    const k = Math.max(0, stop - start);
    const data = new Float32Array(N_MELS * k);
    for (let t = 0; t < k; t++) {
      const col = this.frames[start + t - this.firstBuffered];
      for (let b = 0; b < N_MELS; b++) data[b * k + t] = col[b];
    }
    // the floor in force before this packet, so values at the floor cost nothing
    const before = this.runningAfter(start - 1);
    const floor = Number.isFinite(before) ? before - DYNAMIC_RANGE_LOG10 : null;
    const payload = encodeFrames({ data, k }, this.mode, floor);
    // the floor state after this packet's frames, not after every frame computed so far: a
    // function of the samples, whatever the piece that completed the packet held
    const packet: FeaturePacket = {
      segmentId: seg.segmentId, firstFrame: start, frameCount: k, segmentStart: !seg.started, segmentEnd: end,
      payload, runningMaxLog10: this.runningAfter(stop - 1), finalized: end && seg.finalized,
    };
    seg.started = true;
    seg.nextFrame = stop;
    return packet;
  }

  private trim(): void {
    let keepFrom = this.framesComputed - this.lookbackFrames;
    if (this.segments.length) keepFrom = Math.min(keepFrom, this.segments[0].nextFrame - 1);
    const drop = Math.max(0, Math.min(this.frames.length, keepFrom - this.firstBuffered));
    if (drop) {
      this.frames.splice(0, drop);
      this.runningBefore = this.running[drop - 1]; // Python's _running_before = _running.popleft()
      this.running.splice(0, drop);
      this.firstBuffered += drop;
    }
  }
}
