// Voice activity detection: a port of edge/vad.py. silero-vad probabilities on the same graph
// (edge/models/silero_vad_windows.onnx: 512-sample windows, each with the previous window's last
// 64 samples in front, the LSTM state carried on), and silero's segmenting rules as a streaming
// state machine (SpeechSegmenter), in the same order of checks as the Python one.
// finalize() (the speaker stopped, push-to-talk released) decides at once what the windows seen so
// far can: the open segment ends at the stream's position, and speech that goes on opens the next.

import type { OrtModel, OrtTensor } from "./ort.js";
import { SAMPLE_RATE } from "./features.js";

export const WINDOW_SAMPLES = 512;
export const CONTEXT_SAMPLES = 64;
const FRAME_SAMPLES = CONTEXT_SAMPLES + WINDOW_SAMPLES;
const STATE_SIZE = 2 * 128;
const MAX_WINDOWS_PER_RUN = 1024;
const MIN_SILENCE_AT_MAX_SPEECH_MS = 98;

export class SileroVad {
  private state = new Float32Array(STATE_SIZE);
  private context = new Float32Array(CONTEXT_SAMPLES);
  private pending = new Float32Array(0);

  constructor(private readonly model: OrtModel) {}

  reset(): void {
    this.state = new Float32Array(STATE_SIZE);
    this.context = new Float32Array(CONTEXT_SAMPLES);
    this.pending = new Float32Array(0);
  }

  private async run(samples: Float32Array): Promise<Float32Array> {
    const k = samples.length / WINDOW_SAMPLES;
    const frames = new Float32Array(k * FRAME_SAMPLES);
    for (let w = 0; w < k; w++) {
      frames.set(w === 0 ? this.context : samples.subarray(w * WINDOW_SAMPLES - CONTEXT_SAMPLES, w * WINDOW_SAMPLES),
        w * FRAME_SAMPLES);
      frames.set(samples.subarray(w * WINDOW_SAMPLES, (w + 1) * WINDOW_SAMPLES), w * FRAME_SAMPLES + CONTEXT_SAMPLES);
    }
    this.context = samples.slice(samples.length - CONTEXT_SAMPLES);
    const out: Record<string, OrtTensor> = await this.model.run({
      frames: this.model.tensor(frames, [k, FRAME_SAMPLES]), state: this.model.tensor(this.state, [2, 1, 128]),
    });
    this.state = Float32Array.from(out.stateN.data as Float32Array);
    return Float32Array.from(out.output.data as Float32Array);
  }

  private async windows(samples: Float32Array): Promise<Float32Array> {
    const step = MAX_WINDOWS_PER_RUN * WINDOW_SAMPLES;
    const parts: Float32Array[] = [];
    for (let i = 0; i < samples.length; i += step) parts.push(await this.run(samples.subarray(i, i + step)));
    const out = new Float32Array(parts.reduce((n, p) => n + p.length, 0));
    let at = 0;
    for (const p of parts) { out.set(p, at); at += p.length; }
    return out;
  }

  /** Feed the next piece (any length); the probabilities of the windows it completed. */
  async push(pcm: Float32Array): Promise<Float32Array> {
    const x = new Float32Array(this.pending.length + pcm.length);
    x.set(this.pending);
    x.set(pcm, this.pending.length);
    const complete = x.length - (x.length % WINDOW_SAMPLES);
    const probs = complete ? await this.windows(x.subarray(0, complete)) : new Float32Array(0);
    this.pending = x.slice(complete);
    return probs;
  }

  /** End of stream: zero-pad a partial last window as silero does; then reset. */
  async flush(): Promise<Float32Array> {
    let probs: Float32Array = new Float32Array(0);
    if (this.pending.length) {
      const last = new Float32Array(WINDOW_SAMPLES);
      last.set(this.pending);
      probs = await this.windows(last);
    }
    this.reset();
    return probs;
  }
}

export interface VadOptions {
  threshold: number;
  minSpeechDurationMs: number;
  minSilenceDurationMs: number;
  speechPadMs: number;
  negThreshold: number | null;
  maxSpeechDurationS: number;
}

export const DEFAULT_VAD: VadOptions = {
  threshold: 0.5, minSpeechDurationMs: 250, minSilenceDurationMs: 300, speechPadMs: 100, negThreshold: null,
  maxSpeechDurationS: Infinity,
};

export interface SegmentStart { kind: "start"; segmentId: number; startSample: number; decidedAtSample: number }
export interface SegmentEnd {
  kind: "end"; segmentId: number; startSample: number; endSample: number; decidedAtSample: number;
}
export type SegmentEvent = SegmentStart | SegmentEnd;

const msToSamples = (ms: number) => Math.round((SAMPLE_RATE * ms) / 1000);

interface Pause { startSample: number; lengthSamples: number }
interface PendingEnd { segmentId: number; startSample: number; rawEndSample: number }

class SegmenterState {
  windowsSeen = 0;
  triggered = false;
  rawStartSample = 0;
  confirmed = false;
  silenceStartSample: number | null = null;
  longestPause: Pause | null = null;
  pendingEnd: PendingEnd | null = null;
  lastEndSample = 0;
  nextSegmentId = 0;
  currentSegmentId = 0;
  paddedStartSample = 0;
}

/** Window probabilities -> segment events (edge/vad.py SpeechSegmenter). */
export class SpeechSegmenter {
  state = new SegmenterState();
  private readonly minSpeech: number;
  private readonly minSilence: number;
  private readonly pad: number;
  private readonly maxSpeech: number;
  private readonly minPauseAtMaxSpeech: number;
  private readonly exitThreshold: number;

  constructor(readonly options: VadOptions = DEFAULT_VAD) {
    this.pad = msToSamples(options.speechPadMs);
    this.minSpeech = msToSamples(options.minSpeechDurationMs);
    this.minSilence = msToSamples(options.minSilenceDurationMs);
    this.maxSpeech = SAMPLE_RATE * options.maxSpeechDurationS - WINDOW_SAMPLES - 2 * this.pad;
    this.minPauseAtMaxSpeech = msToSamples(MIN_SILENCE_AT_MAX_SPEECH_MS);
    this.exitThreshold = options.negThreshold ?? Math.max(options.threshold - 0.15, 0.01);
  }

  /** The earliest sample at which the segment whose start was emitted and whose end was not can
   * still end (padded end), whatever the windows still to come; null when no such segment exists
   * (edge/vad.py SpeechSegmenter.earliest_end_sample). A function of the windows seen so far, never
   * of how the audio was cut, so the frames a stream sends of an open segment (pipeline.ts) never
   * run past its end.
   *
   * While speech goes on, a pause may begin at the next window at the earliest; a pause in
   * progress ends the segment where it began. The padding after the raw end is at least
   * min(pad, min silence). With max speech set (a cut may end the segment at a past pause, its
   * padding stopping at once) no padding is counted. */
  get earliestEndSample(): number | null {
    const s = this.state;
    const nextWindow = s.windowsSeen * WINDOW_SAMPLES; // where a pause can begin at the earliest
    if (s.pendingEnd !== null) {
      // closed, its padding still open: an onset at the next window would clip it there
      return Math.min(s.pendingEnd.rawEndSample + this.pad, nextWindow);
    }
    if (!(s.triggered && s.confirmed)) return null;
    let rawEnd = s.silenceStartSample === null ? nextWindow : s.silenceStartSample;
    if (this.options.maxSpeechDurationS === Infinity) return rawEnd + Math.min(this.pad, this.minSilence);
    if (s.longestPause !== null) rawEnd = Math.min(rawEnd, s.longestPause.startSample);
    return rawEnd;
  }

  push(probabilities: ArrayLike<number>): SegmentEvent[] {
    const events: SegmentEvent[] = [];
    for (let i = 0; i < probabilities.length; i++) {
      this.window(probabilities[i], (this.state.windowsSeen + 1) * WINDOW_SAMPLES, events);
    }
    return events;
  }

  finish(lastProbabilities: ArrayLike<number>, totalSamples: number): SegmentEvent[] {
    const events: SegmentEvent[] = [];
    for (let i = 0; i < lastProbabilities.length; i++) this.window(lastProbabilities[i], totalSamples, events);
    const s = this.state;
    if (s.pendingEnd !== null) this.emitEnd(Math.min(s.pendingEnd.rawEndSample + this.pad, totalSamples), totalSamples, events);
    if (s.triggered && totalSamples - s.rawStartSample > this.minSpeech) {
      this.close(totalSamples, totalSamples, events);
      this.emitEnd(totalSamples, totalSamples, events);
    }
    this.state = new SegmenterState();
    return events;
  }

  /** Finalize on request (the speaker stopped, push-to-talk released): decide now what the windows
   * seen so far can decide (edge/vad.py SpeechSegmenter.finalize). A segment whose end waits for its
   * padding ends at once (the padding cut at the stream's position); the segment in progress ends
   * at the position (in a pause: where the pause began, plus what of the padding has been heard),
   * and speech that goes on opens the next segment there, unconfirmed like any onset. A burst not
   * yet confirmed (shorter than min speech so far) is left to the ordinary rules. */
  finalize(): SegmentEvent[] {
    const s = this.state;
    const events: SegmentEvent[] = [];
    const now = s.windowsSeen * WINDOW_SAMPLES;
    if (s.pendingEnd !== null) this.emitEnd(Math.min(s.pendingEnd.rawEndSample + this.pad, now), now, events);
    if (!(s.triggered && s.confirmed)) return events;
    const pause = s.silenceStartSample;
    this.close(pause === null ? now : pause, now, events);
    this.emitEnd(pause === null ? now : Math.min(pause + this.pad, now), now, events);
    s.silenceStartSample = null;
    s.longestPause = null;
    if (pause !== null) {
      s.triggered = false;
      return events;
    }
    s.rawStartSample = now;
    s.confirmed = false;
    s.currentSegmentId = s.nextSegmentId;
    s.nextSegmentId += 1;
    return events;
  }

  private window(p: number, now: number, events: SegmentEvent[]): void {
    const s = this.state;
    const cur = s.windowsSeen * WINDOW_SAMPLES;
    s.windowsSeen += 1;
    const speech = p >= this.options.threshold;
    if (speech && s.silenceStartSample !== null) this.pauseOver(cur);
    if (speech && !s.triggered) this.open(cur, events);
    else if (s.triggered && cur - s.rawStartSample > this.maxSpeech) this.cut(cur, now, events);
    if (s.triggered && p < this.exitThreshold && s.silenceStartSample === null) s.silenceStartSample = cur;
    if (s.silenceStartSample !== null && cur - s.silenceStartSample >= this.minSilence) this.silenceEnd(now, events);
    this.settle(now, events);
  }

  private pauseOver(cur: number): void {
    const s = this.state;
    const length = cur - s.silenceStartSample!;
    if (length > this.minPauseAtMaxSpeech && (s.longestPause === null || length > s.longestPause.lengthSamples)) {
      s.longestPause = { startSample: s.silenceStartSample!, lengthSamples: length };
    }
    s.silenceStartSample = null;
  }

  private open(cur: number, events: SegmentEvent[]): void {
    const s = this.state;
    if (s.pendingEnd !== null) this.emitEnd(Math.min(s.pendingEnd.rawEndSample + this.pad, cur), cur, events);
    s.triggered = true;
    s.rawStartSample = cur;
    s.confirmed = false;
    s.silenceStartSample = null;
    s.longestPause = null;
    s.currentSegmentId = s.nextSegmentId;
    s.nextSegmentId += 1;
  }

  private cut(cur: number, now: number, events: SegmentEvent[]): void {
    const s = this.state;
    const pause = s.longestPause;
    const end = pause !== null ? pause.startSample : cur;
    this.close(end, now, events);
    s.silenceStartSample = null;
    s.longestPause = null;
    if (pause === null) {
      s.triggered = false;
      return;
    }
    const onset = pause.startSample + pause.lengthSamples;
    this.emitEnd(Math.min(end + this.pad, onset), now, events);
    s.rawStartSample = onset;
    s.confirmed = false;
    s.currentSegmentId = s.nextSegmentId;
    s.nextSegmentId += 1;
  }

  private silenceEnd(now: number, events: SegmentEvent[]): void {
    const s = this.state;
    const end = s.silenceStartSample!;
    if (s.confirmed || end - s.rawStartSample > this.minSpeech) this.close(end, now, events);
    s.triggered = false;
    s.silenceStartSample = null;
    s.longestPause = null;
  }

  private close(rawEnd: number, now: number, events: SegmentEvent[]): void {
    const s = this.state;
    if (!s.confirmed) this.emitStart(now, events);
    s.pendingEnd = { segmentId: s.currentSegmentId, startSample: s.paddedStartSample, rawEndSample: rawEnd };
  }

  private settle(now: number, events: SegmentEvent[]): void {
    const s = this.state;
    if (s.pendingEnd !== null && s.pendingEnd.rawEndSample + this.pad <= now) {
      this.emitEnd(s.pendingEnd.rawEndSample + this.pad, now, events);
    }
    if (s.triggered && !s.confirmed) {
      const earliestEnd = s.silenceStartSample !== null ? s.silenceStartSample : now;
      if (earliestEnd - s.rawStartSample > this.minSpeech) this.emitStart(now, events);
    }
  }

  private emitStart(now: number, events: SegmentEvent[]): void {
    const s = this.state;
    s.confirmed = true;
    s.paddedStartSample = Math.max(s.rawStartSample - this.pad, s.lastEndSample, 0);
    events.push({ kind: "start", segmentId: s.currentSegmentId, startSample: s.paddedStartSample, decidedAtSample: now });
  }

  private emitEnd(endSample: number, now: number, events: SegmentEvent[]): void {
    const s = this.state;
    const pending = s.pendingEnd!;
    events.push({ kind: "end", segmentId: pending.segmentId, startSample: pending.startSample, endSample, decidedAtSample: now });
    s.lastEndSample = endSample;
    s.pendingEnd = null;
  }
}

/** One audio stream -> segment events (edge/vad.py StreamingVad). */
export class StreamingVad {
  readonly segmenter: SpeechSegmenter;
  samplesSeen = 0;

  constructor(readonly vad: SileroVad, options: VadOptions = DEFAULT_VAD) {
    this.vad.reset();
    this.segmenter = new SpeechSegmenter(options);
  }

  async push(pcm: Float32Array): Promise<SegmentEvent[]> {
    this.samplesSeen += pcm.length;
    const probs = await this.vad.push(pcm);
    return probs.length ? this.segmenter.push(probs) : [];
  }

  /** Finalize on request (SpeechSegmenter.finalize): the events it decides now. */
  finalize(): SegmentEvent[] {
    return this.segmenter.finalize();
  }

  async flush(): Promise<SegmentEvent[]> {
    const events = this.segmenter.finish(await this.vad.flush(), this.samplesSeen);
    this.samplesSeen = 0;
    return events;
  }
}
