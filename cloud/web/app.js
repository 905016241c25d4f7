// harken browser client: microphone -> Opus track -> harken serve; the protobuf messages of
// proto/harken.proto over a data channel "harken" (the same stream as gRPC, see cloud/webrtc.py).
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

function stop() {
  $("stop").disabled = true;
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
  pc = channel = micStream = null;
  $("start").disabled = false;
  $("stop").disabled = true;
}

$("key").value = localStorage.getItem("harken-key") || "";
loadConfig();
$("start").onclick = start;
$("stop").onclick = stop;
