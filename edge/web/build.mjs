// Builds the package with esbuild: dist/node/index.js (node, ESM; the tests import it) and the
// browser files the page serves from /edge/ (cloud/webrtc.py): see README.md.
import * as esbuild from "esbuild";

await esbuild.build({
  entryPoints: ["src/index.ts"], bundle: true, platform: "node", format: "esm", target: "node20",
  outfile: "dist/node/index.js", packages: "external", logLevel: "warning",
});
