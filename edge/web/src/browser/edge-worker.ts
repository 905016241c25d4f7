// The edge worker: VAD, log-mel and codec off the main thread, on onnxruntime-web (WASM, one
// thread). One FeatureStream per track; the track's 16 kHz audio comes straight from its capture
// worklet over a MessagePort, the packets go to the page's session (client.ts).
//
//   page -> worker: {type: "init", base}                     load onnxruntime-web and the models
//                   {type: "open", id, port, mode, packetFrames, capture}
//                   {type: "captured", id}                   (tests) the 16 kHz audio fed so far
//   worker -> page: {type: "ready"} | {type: "failed", message}
//                   {type: "packets", id, packets, boundS}  boundS: no segment not yet opened starts earlier
//                   {type: "ended", id}                      the flush's packets came before it
//                   {type: "captured", id, samples}

import * as ort from "onnxruntime-web/wasm";

import type { Mode } from "../codec.js";
import { OrtModel } from "../ort.js";
import type { OrtModule } from "../ort.js";
import { FeatureStream } from "../pipeline.js";
import type { EdgeModels } from "../pipeline.js";

declare const self: DedicatedWorkerGlobalScope;

let models: EdgeModels | null = null;
const captures = new Map<number, Float32Array[]>();

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
  const stream = new FeatureStream(models!, { mode, packetFrames });
  let samples = 0;
  let chain = Promise.resolve();
  if (capture) captures.set(id, []);
  port.onmessage = (ev: MessageEvent) => {
    const msg = ev.data;
    chain = chain.then(async () => {
      if (msg.type === "pcm") {
        const pcm = msg.samples as Float32Array;
        captures.get(id)?.push(pcm.slice());
        const packets = await stream.push(pcm);
        samples += pcm.length;
        const newestFrame = Math.max(0, Math.floor((samples - 200) / 160));
        self.postMessage({ type: "packets", id, packets, boundS: (newestFrame - stream.lookbackFrames) / 100 });
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
    const parts = captures.get(msg.id) ?? [];
    const out = new Float32Array(parts.reduce((n, p) => n + p.length, 0));
    let at = 0;
    for (const p of parts) { out.set(p, at); at += p.length; }
    self.postMessage({ type: "captured", id: msg.id, samples: out }, [out.buffer]);
  }
};
