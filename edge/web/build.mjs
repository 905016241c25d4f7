// Builds the package with esbuild (no framework, no type emit; `npx tsc --noEmit` checks types):
//   dist/node/index.js       the edge for node (tests; onnxruntime-node passed in by the caller)
//   dist/browser/            what a page serves from one folder (harken serve: /edge/):
//     harken.js              the API: connect(url, {apiKey}).addTrack(track, {speaker}) (ESM)
//     edge-worker.js         VAD + log-mel + codec on onnxruntime-web (module worker)
//     capture-worklet.js     AudioWorklet: device rate -> 16 kHz mono pieces
//     ort-wasm-simd-threaded.{mjs,wasm}   onnxruntime-web's WASM runtime
//     models/*.onnx          the edge's models (edge/models/: the same files the Python edge loads)
import { copyFileSync, mkdirSync } from "node:fs";
import * as esbuild from "esbuild";

const common = { bundle: true, format: "esm", logLevel: "warning", legalComments: "none" };
await esbuild.build({
  ...common, entryPoints: ["src/index.ts"], platform: "node", target: "node20", outfile: "dist/node/index.js",
  packages: "external",
});
await esbuild.build({
  ...common, entryPoints: {
    harken: "src/browser/index.ts", "edge-worker": "src/browser/edge-worker.ts",
    "capture-worklet": "src/browser/capture-worklet.ts",
  }, platform: "browser", target: "es2022", outdir: "dist/browser", minify: true, sourcemap: true,
});
mkdirSync("dist/browser/models", { recursive: true });
for (const f of ["ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm"]) {
  copyFileSync(`node_modules/onnxruntime-web/dist/${f}`, `dist/browser/${f}`);
}
for (const f of ["logmel.onnx", "silero_vad_windows.onnx"]) copyFileSync(`../models/${f}`, `dist/browser/models/${f}`);
