// AudioWorklet "harken-capture": the track's audio at the device rate, mixed to mono, resampled to
// 16 kHz here in the audio thread, and posted in pieces of 100 ms (1600 samples) to the edge worker
// over the MessagePort it is given ({type: "port"}). {type: "stop"} flushes and ends the stream.
// {type: "finalize"} (TrackStream.finalize) sends the part-filled piece at once, then the finalize
// request on the same port, so the worker cuts the segment after exactly the audio captured before it.

import { StreamingResampler } from "../resample.js";

declare const sampleRate: number;
declare function registerProcessor(name: string, ctor: unknown): void;
declare class AudioWorkletProcessor {
  readonly port: MessagePort;
}

const PIECE = 1600;

class CaptureProcessor extends AudioWorkletProcessor {
  private resampler = new StreamingResampler(sampleRate, 16000);
  private out: MessagePort | null = null;
  private piece = new Float32Array(PIECE);
  private fill = 0;
  private stopped = false;

  constructor() {
    super();
    this.port.onmessage = (ev: MessageEvent) => {
      if (ev.data.type === "port") this.out = ev.data.port as MessagePort;
      else if (ev.data.type === "stop" && !this.stopped) {
        this.stopped = true;
        this.emit(this.resampler.flush());
        if (this.fill) this.send(this.piece.slice(0, this.fill));
        this.out?.postMessage({ type: "end" });
      } else if (ev.data.type === "finalize" && !this.stopped) {
        if (this.fill) {
          this.send(this.piece.slice(0, this.fill));
          this.fill = 0;
        }
        this.out?.postMessage({ type: "finalize" });
      }
    };
  }

  private send(samples: Float32Array): void {
    this.out?.postMessage({ type: "pcm", samples }, [samples.buffer]);
  }

  private emit(y: Float32Array): void {
    for (let i = 0; i < y.length; i++) {
      this.piece[this.fill++] = y[i];
      if (this.fill === PIECE) {
        this.send(this.piece);
        this.piece = new Float32Array(PIECE);
        this.fill = 0;
      }
    }
  }

  process(inputs: Float32Array[][]): boolean {
    if (this.stopped) return false;
    const channels = inputs[0];
    if (channels && channels.length) {
      const n = channels[0].length;
      const mono = new Float32Array(n);
      for (const c of channels) for (let i = 0; i < n; i++) mono[i] += c[i] / channels.length;
      this.emit(this.resampler.push(mono));
    }
    return true;
  }
}

registerProcessor("harken-capture", CaptureProcessor);
