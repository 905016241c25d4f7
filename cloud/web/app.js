// harken browser client, two modes:
// - features on this device (default where the browser edge is served at /edge/ and WebAssembly
//   works): the microphone -> an AudioWorklet (16 kHz) -> a worker running silero VAD, the log-mel
//   and the feature codec on onnxruntime-web -> feature packets over the data channel, with the
//   session rules of the Python client (resume, replay): edge/web/ (`harken.connect`).
// - audio (Opus): microphone -> Opus track -> harken serve, which runs the edge work itself; the
//   protobuf messages of proto/harken.proto over a data channel "harken" (the same stream as gRPC,
//   see cloud/adapters/webrtc.py).
"use strict";

// ---- the few protobuf messages the page needs, encoded and decoded by hand ----

const utf8 = new TextEncoder(), utf8d = new TextDecoder();

function varint(n) {
  const out = [];
  while (n > 127) { out.push((n % 128) | 128); n = Math.floor(n / 128); }
  out.push(n);
  return out;
}

function lenField(field, bytes) {
  return [...varint(field * 8 + 2), ...varint(bytes.length), ...bytes];
}

// ClientMessage{start: Start{language, context}} / {end: End{}} (field numbers from the .proto)
function startMessage(language) {
  const start = language ? lenField(1, utf8.encode(language)) : [];
  return new Uint8Array(lenField(1, start));
}
const END_MESSAGE = new Uint8Array(lenField(5, []));

// Fields of one message: {number: [values]}; LEN values are Uint8Array, fixed32/64 DataViews.
function fields(buf) {
  const out = {};
  let i = 0;
  const readVarint = () => {
    let n = 0, mul = 1, b;
    do { b = buf[i++]; n += (b & 127) * mul; mul *= 128; } while (b & 128);
    return n;
  };
  while (i < buf.length) {
    const tag = readVarint(), field = Math.floor(tag / 8), type = tag % 8;
    let value;
    if (type === 0) value = readVarint();
    else if (type === 2) { const n = readVarint(); value = buf.subarray(i, i + n); i += n; }
    else if (type === 5) { value = new DataView(buf.buffer, buf.byteOffset + i, 4).getFloat32(0, true); i += 4; }
    else if (type === 1) { value = new DataView(buf.buffer, buf.byteOffset + i, 8).getFloat64(0, true); i += 8; }
    else throw new Error("unsupported wire type " + type);
    (out[field] = out[field] || []).push(value);
  }
  return out;
}

const str = (f, n) => (f[n] ? utf8d.decode(f[n][0]) : "");
const num = (f, n) => (f[n] ? f[n][0] : 0);

function serverMessage(buf) {
  const m = fields(buf);
  if (m[1]) { const r = fields(m[1][0]); return { kind: "ready", sessionId: str(r, 1) }; }
  if (m[2]) {
    const t = fields(m[2][0]);
    return { kind: "transcript", segment: num(t, 1), committed: str(t, 2), partial: str(t, 3),
             language: str(t, 7), isFinal: !!num(t, 8) };
  }
  if (m[3]) return { kind: "ack" };
  if (m[4]) { const e = fields(m[4][0]); return { kind: "error", code: str(e, 1), message: str(e, 2) }; }
  return { kind: "unknown" };
}

// ---- the page ----

const $ = (id) => document.getElementById(id);
const ERRORS_IN_WORDS = {
  UNAUTHENTICATED: "The server did not accept the API key.",
  PERMISSION_DENIED: "This session belongs to another API key.",
  RESOURCE_EXHAUSTED: "The server is busy: too many sessions. Try again later.",
  UNAVAILABLE: "The server is not available (it may be restarting).",
  INVALID_ARGUMENT: "The server could not read what this page sent.",
  FAILED_PRECONDITION: "The stream broke the protocol's order.",
  NOT_FOUND: "The session is gone on the server.",
};

let pc = null, channel = null, micStream = null, segments = new Map(), ended = false;
let edge = null, conn = null, trackStream = null, sentBytes = 0, meter = null;
const CAPTURE = new URLSearchParams(location.search).has("capture");  // tests: keep the 16 kHz audio

// The browser edge (edge/web/dist/browser/, served at /edge/): features mode where it loads.
async function loadEdge() {
  try {
    if (typeof WebAssembly !== "object") throw new Error("no WebAssembly");
    const module = await import("/edge/harken.js");
    if (!module.edgeSupported()) throw new Error("no AudioWorklet or workers");
    edge = module;
  } catch (e) {
    edge = null;
  }
  $("mode-features").disabled = !edge;
  $("mode-" + (edge ? "features" : "opus")).checked = true;
  document.body.dataset.edge = edge ? "available" : "unavailable";
}

const selectedMode = () => (document.querySelector("input[name=mode]:checked") || {}).value || "opus";

// live kbps: bytes written to the server over the last second (features: the data channel;
// Opus: the RTP track plus the data channel, from getStats)
function startMeter() {
  let last = 0, lastAt = performance.now();
  sentBytes = 0;
  $("kbps").textContent = "";
  meter = setInterval(async () => {
    let total = sentBytes;
    if (pc && selectedMode() === "opus") {
      const stats = await pc.getStats();
      total = 0;
      stats.forEach((r) => { if (r.type === "outbound-rtp" || r.type === "data-channel") total += r.bytesSent || 0; });
    }
    const t = performance.now();
    const kbps = (8 * (total - last)) / (t - lastAt);
    last = total;
    lastAt = t;
    $("kbps").textContent = `${selectedMode() === "features" ? "features" : "Opus"}: ${kbps.toFixed(1)} kbps`;
  }, 1000);
}

// the languages a stream can be forced to, when /v1/config cannot be read (the server's list wins)
const FALLBACK_LANGUAGES = ["Chinese", "English", "Cantonese", "Arabic", "German", "French", "Spanish",
  "Portuguese", "Indonesian", "Italian", "Korean", "Russian", "Thai", "Vietnamese", "Japanese", "Turkish",
  "Hindi", "Malay", "Dutch", "Swedish", "Danish", "Finnish", "Polish", "Czech", "Filipino", "Persian",
  "Greek", "Romanian", "Hungarian", "Macedonian"].map((name) => ({ name, code: "" }));

function fillLanguages(languages) {
  const select = $("language");
  const wanted = localStorage.getItem("harken-language") || "";
  select.length = 1;  // keep "detect"
  for (const l of languages) {
    const o = document.createElement("option");
    o.value = l.name;
    o.textContent = l.code ? `${l.name} (${l.code})` : l.name;
    select.append(o);
  }
  select.value = [...select.options].some((o) => o.value === wanted) ? wanted : "";
}

// GET /v1/config: which model the server runs (a banner for a test model) and its languages
async function loadConfig() {
  let config = null;
  try {
    const r = await fetch("/v1/config");
    if (r.ok) config = await r.json();
  } catch (e) { /* an older server: no banner, the built-in language list */ }
  fillLanguages(config && config.languages && config.languages.length ? config.languages : FALLBACK_LANGUAGES);
  const banner = $("model-banner");
  if (config && config.test_model) {
    banner.textContent = `This server runs a test model (${config.model || config.model_kind}): ` +
      `${config.model_note || "its transcripts are meaningless"}. Real transcripts need a real model ` +
      "(harken serve --model Qwen/Qwen3-ASR-0.6B).";
    banner.hidden = false;
  } else {
    banner.hidden = true;
  }
  document.body.dataset.model = config ? config.model_kind : "unknown";
}

// the stream ended well but no segment holds a word: say so instead of showing an empty box
function showEmptyResult() {
  const words = [...segments.values()].some((s) => (s.committed + s.partial).trim());
  $("empty-result").hidden = words;
}

function setState(cls, text) {
  $("state").className = cls;
  $("state-text").textContent = text;
  document.body.dataset.state = cls;
}

function showError(text) {
  $("error").textContent = text;
  if (text) setState("failed", "stopped: error");
}

function render() {
  const box = $("transcript");
  box.textContent = "";
  for (const [, s] of [...segments.entries()].sort((a, b) => a[0] - b[0])) {
    const c = document.createElement("span");
    c.className = "committed";
    c.textContent = s.committed;
    const p = document.createElement("span");
    p.className = "partial";
    p.textContent = s.partial;
    box.append(c, p, document.createTextNode(s.final ? "\n" : " "));
  }
}

function onServerMessage(data) {
  if (typeof data === "string") {  // the stream's status, its last message
    const status = JSON.parse(data);
    ended = true;
    if (status.status === "OK") { setState("idle", "finished"); showEmptyResult(); }
    else showError((ERRORS_IN_WORDS[status.status] || "The server ended the stream.") +
                   ` (${status.status}: ${status.message})`);
    hangUp();
    return;
  }
  const m = serverMessage(new Uint8Array(data));
  if (m.kind === "ready") setState("live", "live: listening");
  if (m.kind === "transcript") {
    const s = segments.get(m.segment) || { committed: "", partial: "", final: false };
    s.committed += m.committed;
    s.partial = m.partial;
    s.final = m.isFinal;
    segments.set(m.segment, s);
    render();
  }
}

async function waitForIce(pc) {
  if (pc.iceGatheringState === "complete") return;
  await new Promise((resolve) => {
    const done = () => { if (pc.iceGatheringState === "complete") resolve(); };
    pc.addEventListener("icegatheringstatechange", done);
    setTimeout(resolve, 3000);  // no STUN reachable: host candidates are enough
  });
}

async function start() {
  showError("");
  $("empty-result").hidden = true;
  segments = new Map();
  ended = false;
  render();
  $("start").disabled = true;
  setState("connecting", "asking for the microphone…");
  try {
    micStream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false } });
  } catch (e) {
    showError(`The microphone is not available: ${e.message || e.name}.`);
    $("start").disabled = false;
    return;
  }
  localStorage.setItem("harken-language", $("language").value);
  startMeter();
  if (selectedMode() === "features") return startFeatures();
  setState("connecting", "connecting…");
  pc = new RTCPeerConnection();
  for (const track of micStream.getAudioTracks()) pc.addTrack(track, micStream);
  channel = pc.createDataChannel("harken", { ordered: true });
  channel.binaryType = "arraybuffer";
  channel.onopen = () => { channel.send(startMessage($("language").value)); $("stop").disabled = false; };
  channel.onmessage = (ev) => onServerMessage(ev.data);
  channel.onclose = () => { if (!ended) showError("The connection to the server was lost."); hangUp(); };
  pc.onconnectionstatechange = () => {
    if (pc && pc.connectionState === "failed") showError("The network connection to the server failed.");
    else if (pc && !ended && pc.connectionState !== "connected") setState("connecting", pc.connectionState);
  };
  try {
    await pc.setLocalDescription(await pc.createOffer());
    await waitForIce(pc);
    const key = $("key").value.trim();
    localStorage.setItem("harken-key", key);
    localStorage.setItem("harken-language", $("language").value);
    const headers = { "Content-Type": "application/json" };
    if (key) headers.Authorization = "Bearer " + key;
    const r = await fetch("/v1/webrtc/offer", { method: "POST", headers,
      body: JSON.stringify({ sdp: pc.localDescription.sdp, type: pc.localDescription.type }) });
    const body = await r.json().catch(() => ({}));
    if (!r.ok) {
      ended = true;
      showError((ERRORS_IN_WORDS[body.code] || "The server refused the connection.") +
                ` (${body.code || r.status}: ${body.message || r.statusText})`);
      hangUp();
      return;
    }
    await pc.setRemoteDescription(body);
  } catch (e) {
    ended = true;
    showError(`Could not reach the server: ${e.message || e}.`);
    hangUp();
  }
}

// features mode: harken.connect + one track; the session rules live in the package
async function startFeatures() {
  setState("connecting", "starting the edge on this device…");
  const key = $("key").value.trim();
  localStorage.setItem("harken-key", key);
  try {
    conn = await edge.connect(location.origin, { apiKey: key || undefined });
  } catch (e) {
    ended = true;
    showError(`The edge could not start in this browser: ${e.message || e}. Pick audio (Opus).`);
    hangUp();
    return;
  }
  setState("connecting", "connecting…");
  const t = conn.addTrack(micStream.getAudioTracks()[0], { speaker: "me", language: $("language").value,
                                                          capture: CAPTURE });
  trackStream = t;
  window.harkenTrack = t;  // tests and fault drills: t.dropChannel(), t.captured()
  t.on("ready", () => { if (!ended) { setState("live", "live: listening"); $("stop").disabled = false; } });
  t.on("bytes", (n) => { sentBytes += n; });
  t.on("transcript", (e) => {
    const s = segments.get(e.segmentId) || { committed: "", partial: "", final: false };
    s.committed += e.committedDelta;
    s.partial = e.partial;
    s.final = e.isFinal;
    segments.set(e.segmentId, s);
    render();
  });
  t.on("end", async (text) => {
    ended = true;
    if (CAPTURE) window.harkenCaptured = await t.captured();
    document.body.dataset.finalText = text;
    setState("idle", "finished");
    showEmptyResult();
    hangUp();
  });
  t.on("error", (e) => {
    ended = true;
    showError((ERRORS_IN_WORDS[e.code] || "The stream failed.") + ` (${e.message})`);
    hangUp();
  });
}

function stop() {
  $("stop").disabled = true;
  if (trackStream) {
    setState("connecting", "finishing the last words…");
    trackStream.stop().catch(() => {});
    return;
  }
  if (channel && channel.readyState === "open") {
    setState("connecting", "finishing the last words…");
    channel.send(JSON.stringify({ flush_audio: true }));
    channel.send(END_MESSAGE);
  }
  if (micStream) micStream.getTracks().forEach((t) => t.stop());
}

function hangUp() {
  if (micStream) micStream.getTracks().forEach((t) => t.stop());
  if (pc) pc.close();
  if (conn) conn.close().catch(() => {});
  if (meter) clearInterval(meter);
  pc = channel = micStream = conn = trackStream = meter = null;
  $("start").disabled = false;
  $("stop").disabled = true;
}

$("key").value = localStorage.getItem("harken-key") || "";
loadConfig();
loadEdge();
$("start").onclick = start;
$("stop").onclick = stop;
