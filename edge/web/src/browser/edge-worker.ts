// The edge worker: VAD, log-mel and codec off the main thread, on onnxruntime-web (WASM, one
// thread). One FeatureStream per track; the track's 16 kHz audio comes straight from its capture
// worklet over a MessagePort, the packets go to the page's session (client.ts).
//
//   page -> worker: {type: "init", base}                     load onnxruntime-web and the models
//                   {type: "open", id, port, mode, packetFrames, capture}
//                   {type: "captured", id}                   (tests) the 16 kHz audio fed so far and
//                                                            the raw log-mel computed from it
//   worklet -> worker (the track's port): {type: "pcm", samples} | {type: "finalize"} | {type: "end"}
//                   finalize: FeatureStream.finalize after the audio before it (the open segment
//                   ends there, its last packet `finalized`)
//   worker -> page: {type: "ready"} | {type: "failed", message}
//                   {type: "packets", id, packets, boundS}  boundS: no segment not yet opened starts earlier
//                   {type: "packets", id, packets, boundS, finalized: true}   a finalize's packets
//                   {type: "ended", id}                      the flush's packets came before it
//                   {type: "captured", id, samples, mel: {data: [128, k] row-major, k}}

import * as ort from "onnxruntime-web/wasm";

import type { Frames, Mode } from "../codec.js";
import { OrtModel } from "../ort.js";
import type { OrtModule } from "../ort.js";
import { FeatureStream } from "../pipeline.js";
import type { EdgeModels } from "../pipeline.js";

declare const self: DedicatedWorkerGlobalScope;

let models: EdgeModels | null = null;
const captures = new Map<number, { audio: Float32Array[]; mel: Frames[] }>();

async function init(base: string): Promise<void> {
  ort.env.wasm.wasmPaths = base;
  ort.env.wasm.numThreads = 1; // no SharedArrayBuffer needed (no cross-origin isolation), one core
  ort.env.logLevel = "error";
  const load = async (name: string) => {
    const r = await fetch(new URL(`models/${name}`, base));
    if (!r.ok) throw new Error(`${name}: HTTP ${r.status}`);
    return OrtModel.load(ort as unknown as OrtModule, new Uint8Array(await r.arrayBuffer()));
  };
  models = { logmel: await load("logmel.onnx"), vad: await load("silero_vad_windows.onnx") };
}

function open(id: number, port: MessagePort, mode: Mode, packetFrames: number, capture: boolean): void {
  const kept = capture ? { audio: [] as Float32Array[], mel: [] as Frames[] } : null;
  if (kept) captures.set(id, kept);
  const stream = new FeatureStream(models!, { mode, packetFrames, onFrames: kept ? (f) => kept.mel.push(f) : undefined });
  let samples = 0;
  let chain = Promise.resolve();
  const boundS = () => (Math.max(0, Math.floor((samples - 200) / 160)) - stream.lookbackFrames) / 100;
  port.onmessage = (ev: MessageEvent) => {
    const msg = ev.data;
    chain = chain.then(async () => {
      if (msg.type === "pcm") {
        const pcm = msg.samples as Float32Array;
        kept?.audio.push(pcm.slice());
        const packets = await stream.push(pcm);
        samples += pcm.length;
        self.postMessage({ type: "packets", id, packets, boundS: boundS() });
      } else if (msg.type === "finalize") {
        self.postMessage({ type: "packets", id, packets: stream.finalize(), boundS: boundS(), finalized: true });
      } else if (msg.type === "end") {
        const packets = await stream.flush();
        self.postMessage({ type: "packets", id, packets, boundS: Infinity });
        self.postMessage({ type: "ended", id });
        port.close();
      }
    }).catch((e) => self.postMessage({ type: "failed", id, message: String(e && e.message || e) }));
  };
}

self.onmessage = (ev: MessageEvent) => {
  const msg = ev.data;
  if (msg.type === "init") {
    init(msg.base).then(() => self.postMessage({ type: "ready" }),
      (e) => self.postMessage({ type: "failed", message: String(e && e.message || e) }));
  } else if (msg.type === "open") {
    open(msg.id, msg.port, msg.mode, msg.packetFrames, !!msg.capture);
  } else if (msg.type === "captured") {
    const kept = captures.get(msg.id) ?? { audio: [], mel: [] };
    const out = new Float32Array(kept.audio.reduce((n, p) => n + p.length, 0));
    let at = 0;
    for (const p of kept.audio) { out.set(p, at); at += p.length; }
    const k = kept.mel.reduce((n, f) => n + f.k, 0);
    const mel = new Float32Array(128 * k);
    at = 0;
    for (const f of kept.mel) {
      for (let b = 0; b < 128; b++) mel.set(f.data.subarray(b * f.k, (b + 1) * f.k), b * k + at);
      at += f.k;
    }
    self.postMessage({ type: "captured", id: msg.id, samples: out, mel: { data: mel, k } }, [out.buffer, mel.buffer]);
  }
};
