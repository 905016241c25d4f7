// The browser/meeting-app API: one harken session per audio track, the edge work (VAD, log-mel,
// codec) on this device, feature packets over a WebRTC data channel to `harken serve --http-port`.
//
//   const s = await harken.connect("https://asr.example.com", { apiKey });
//   const t = s.addTrack(mediaStreamTrack, { speaker: "Alice", language: "English" });
//   s.on("transcript", (event, { speaker }) => ...);   // every track's events
//   s.on("word_timings", (timings, { speaker }) => ...); // with { wordTimings: true } in the track's options
//   s.on("relabel", (change, { speaker }) => ...);     // with { diarize: true } (a room's microphone):
//                                                      // finals carry event.speaker ("S1", ...), and a
//                                                      // recent segment's better speaker comes as
//                                                      // {segmentId, speaker}
//   s.on("turn", (turn, { speaker }) => ...);          // with { turnEvents: true }: turn.kind is
//                                                      // "speech_started" | "utterance_end" (also
//                                                      // emitted under those names)
//   await t.finalize();                                // push-to-talk released: the open segment
//                                                      // ends now, its final comes at once (fromFinalize)
//   await t.stop();                                    // End: the last finals, then "end"
//
// The data channel carries the gRPC stream's messages (cloud/adapters/webrtc.py): binary frames are
// serialized ClientMessage/ServerMessage, text frames the call's framing (half-close, status).
// ClientSession (../session.ts) decides what to send, resend and show: a channel that closes
// without a status is a dropped call, resumed on a new peer connection; a server that lost the
// session gets a seeded replacement with every unfinished packet.

import type { Mode } from "../codec.js";
import { decodeServerMessage, encodeClientMessage } from "../proto.js";
import type { FeaturePacket, TranscriptEvent } from "../protocol.js";
import { ClientSession, StreamError } from "../session.js";
import type { ClientOptions, Disconnect, SessionOutput } from "../session.js";
import { transcriptText } from "../text.js";

export const OFFER_PATH = "/v1/webrtc/offer";
const SEND_HIGH_WATER = 1 << 20;

export interface ConnectOptions {
  apiKey?: string;
  /** Where edge-worker.js, capture-worklet.js, the onnxruntime-web .wasm and models/ are served
   * (default: the folder this module was loaded from). */
  assetsUrl?: string;
  /** Codec mode of the feature packets: hifi, balanced (default) or low. */
  codecMode?: Mode;
  packetFrames?: number;
}

export interface TrackOptions extends Partial<ClientOptions> {
  /** Who speaks on this track: passed back with every event. */
  speaker?: string;
  /** (tests) keep the 16 kHz audio fed to the edge, for `TrackStream.captured()`. */
  capture?: boolean;
}

export interface TrackInfo { speaker: string; track: TrackStream }

type Listener = (...args: any[]) => void;

class Emitter {
  private listeners = new Map<string, Set<Listener>>();

  on(name: string, fn: Listener): this {
    if (!this.listeners.has(name)) this.listeners.set(name, new Set());
    this.listeners.get(name)!.add(fn);
    return this;
  }

  off(name: string, fn: Listener): this {
    this.listeners.get(name)?.delete(fn);
    return this;
  }

  protected emit(name: string, ...args: unknown[]): void {
    for (const fn of this.listeners.get(name) ?? []) fn(...args);
  }
}

const now = () => performance.now() / 1000;
const sleep = (s: number) => new Promise((r) => setTimeout(r, s * 1000));

/** A call's end, as the driver saw it. */
class CallEnded extends Error {
  constructor(readonly failure: Disconnect) {
    super(failure.details);
  }
}

/** One track's stream: its capture, its session, its calls. Events: "ready" (session id, on every
 * call's Ready), "transcript" (event, info; a final cut by `finalize()` says `fromFinalize`),
 * "word_timings" (timings, info), "turn" (TurnEvent, info; then the same under its kind's name,
 * "speech_started" or "utterance_end"), "relabel" (SpeakerChange, info: with `diarize`), "progress"
 * (boundS), "end" (text), "error" (StreamError), "bytes" (n, on every write). */
export class TrackStream extends Emitter {
  readonly session: ClientSession;
  readonly speaker: string;
  /** Bytes written on the data channel (Start, Features, End), resends included. */
  bytesSent = 0;
  text = "";
  done: Promise<string>;
  private segments = new Map<number, string>();
  private node: AudioWorkletNode | null = null;
  private source: MediaStreamAudioSourceNode | null = null;
  private pump: (() => void) | null = null;
  private channel: RTCDataChannel | null = null;
  private pc: RTCPeerConnection | null = null;
  private stopping = false;
  private finalizing: (() => void)[] = []; // finalize() calls whose packets the worker has not sent yet
  private resolveDone!: (text: string) => void;
  private rejectDone!: (e: Error) => void;

  constructor(private readonly conn: Connection, readonly id: number, readonly track: MediaStreamTrack,
              options: TrackOptions) {
    super();
    this.speaker = options.speaker ?? "";
    this.session = new ClientSession(options, conn.url);
    this.done = new Promise((resolve, reject) => { this.resolveDone = resolve; this.rejectDone = reject; });
    this.done.catch(() => undefined); // the "error" event reports it too
  }

  async start(capture: boolean): Promise<void> {
    const { context, worker } = this.conn;
    const audio = new MessageChannel();
    this.source = context.createMediaStreamSource(new MediaStream([this.track]));
    this.node = new AudioWorkletNode(context, "harken-capture", { numberOfInputs: 1, numberOfOutputs: 0 });
    this.node.port.postMessage({ type: "port", port: audio.port1 }, [audio.port1]);
    worker.postMessage({ type: "open", id: this.id, port: audio.port2, mode: this.conn.options.codecMode ?? "balanced",
      packetFrames: this.conn.options.packetFrames ?? 20, capture }, [audio.port2]);
    this.source.connect(this.node);
    this.track.addEventListener("ended", () => void this.stop());
    void this.run();
  }

  /** From the worker: packets (and the ended mark) of this track. */
  onWorker(msg: { type: string; packets?: FeaturePacket[]; boundS?: number; finalized?: boolean; message?: string }): void {
    if (msg.type === "packets") {
      try {
        this.deliver([this.session.onPackets(msg.packets!, msg.boundS!)]);
      } catch (e) {
        this.fail(e as Error);
      }
      if (msg.finalized) this.finalizing.shift()?.();
    } else if (msg.type === "ended") {
      this.session.endInput();
      this.settleFinalizing();
    } else if (msg.type === "failed") {
      this.fail(new StreamError("EDGE", msg.message ?? "the edge worker failed"));
    }
    this.pump?.();
  }

  /** Finalize now (the speaker stopped, push-to-talk released): the open segment ends at the audio
   * captured so far (FeatureStream.finalize in the worker, in order with the audio) and its final
   * comes at once, with `fromFinalize`; speech that goes on is the next segment. Resolves once the
   * packets the cut completes are with the session (queued to send). Nothing open, or the track
   * stopping: nothing changes. */
  finalize(): Promise<void> {
    if (this.stopping || !this.node) return Promise.resolve();
    return new Promise((resolve) => {
      this.finalizing.push(resolve);
      this.node!.port.postMessage({ type: "finalize" });
    });
  }

  private settleFinalizing(): void {
    for (const resolve of this.finalizing.splice(0)) resolve();
  }

  /** No more audio: the capture flushes, End follows the last packet; resolves with the final text. */
  async stop(): Promise<string> {
    if (!this.stopping) {
      this.stopping = true;
      this.node?.port.postMessage({ type: "stop" });
      this.source?.disconnect();
    }
    return this.done;
  }

  /** (tests, fault drills) close the current data channel as a network fault would. */
  dropChannel(): void {
    this.channel?.close();
  }

  /** (tests, benchmarks) the 16 kHz audio the edge has been fed and the raw log10-mel it computed,
   * [128, k] row-major (with TrackOptions.capture). */
  captured(): Promise<{ samples: Float32Array; mel: { data: Float32Array; k: number } }> {
    return this.conn.request({ type: "captured", id: this.id }, (m) => m.type === "captured" && m.id === this.id)
      .then((m) => ({ samples: m.samples, mel: m.mel }));
  }

  private deliver(items: SessionOutput[]): void {
    for (const item of items) {
      if ("kind" in item && item.kind === "word_timings") {
        const info: TrackInfo = { speaker: this.speaker, track: this };
        this.emit("word_timings", item, info);
        this.conn.emitFromTrack("word_timings", item, info);
        continue;
      }
      if ("kind" in item && item.kind === "relabel") {
        const info: TrackInfo = { speaker: this.speaker, track: this };
        this.emit("relabel", item, info);
        this.conn.emitFromTrack("relabel", item, info);
        continue;
      }
      if ("kind" in item && item.kind === "progress") {
        this.emit("progress", item.boundS);
        continue;
      }
      if ("kind" in item) { // a TurnEvent
        const info: TrackInfo = { speaker: this.speaker, track: this };
        for (const name of ["turn", item.kind]) {
          this.emit(name, item, info);
          this.conn.emitFromTrack(name, item, info);
        }
        continue;
      }
      const e = item as TranscriptEvent;
      this.segments.set(e.segmentId, (this.segments.get(e.segmentId) ?? "") + e.committedDelta);
      this.text = transcriptText(this.segments);
      const info: TrackInfo = { speaker: this.speaker, track: this };
      this.emit("transcript", e, info);
      this.conn.emitFromTrack("transcript", e, info);
    }
  }

  private fail(e: Error): void {
    if (this.session.lifecycle !== "failed") this.session.lifecycle = "failed";
    this.close();
    this.settleFinalizing();
    this.emit("error", e);
    this.conn.emitFromTrack("error", e, { speaker: this.speaker, track: this });
    this.rejectDone(e);
  }

  private close(): void {
    this.pump = null;
    this.channel?.close();
    this.pc?.close();
    this.channel = this.pc = null;
  }

  /** Calls until the stream is done (edge/client/grpc_client.py's connect loop over data channels). */
  private async run(): Promise<void> {
    for (;;) {
      let failure: Disconnect;
      try {
        if (await this.attempt()) {
          this.close();
          this.emit("end", this.text);
          this.conn.emitFromTrack("end", this.text, { speaker: this.speaker, track: this });
          this.resolveDone(this.text);
          return;
        }
        failure = { details: "the server closed the stream before the end" };
      } catch (e) {
        if (!(e instanceof CallEnded)) {
          this.fail(e as Error);
          return;
        }
        failure = e.failure;
      } finally {
        this.close();
      }
      try {
        const retry = this.session.onDisconnect(failure, now());
        if (retry.delayS > 0) await sleep(retry.delayS);
      } catch (e) {
        this.fail(e as Error);
        return;
      }
    }
  }

  /** One call: a peer connection, its data channel, Start/Ready, then messages both ways until the
   * server's status. Resolves true when the whole stream is done; rejects with CallEnded. */
  private async attempt(): Promise<boolean> {
    const session = this.session;
    const pc = new RTCPeerConnection();
    const channel = pc.createDataChannel("harken", { ordered: true });
    channel.binaryType = "arraybuffer";
    this.pc = pc;
    this.channel = channel;
    return new Promise<boolean>((resolve, reject) => {
      let settled = false, halfClosed = false, ready = false;
      const end = (value: boolean | CallEnded) => {
        if (settled) return;
        settled = true;
        clearInterval(watch);
        clearTimeout(connectTimer);
        this.pump = null;
        if (value instanceof CallEnded) reject(value); else resolve(value);
      };
      const write = (bytes: Uint8Array) => {
        channel.send(bytes as Uint8Array<ArrayBuffer>);
        this.bytesSent += bytes.length;
        this.emit("bytes", bytes.length);
      };
      const pump = () => {
        if (settled || !ready || channel.readyState !== "open") return;
        let msg;
        while (channel.bufferedAmount <= SEND_HIGH_WATER && (msg = session.nextMessage(now())) !== null) {
          write(encodeClientMessage(msg));
          session.sent(msg);
        }
        if (session.lifecycle === "draining" && !halfClosed) {
          halfClosed = true;
          channel.send(JSON.stringify({ half_close: true }));
        }
      };
      channel.bufferedAmountLowThreshold = SEND_HIGH_WATER;
      channel.onbufferedamountlow = pump;
      const connectTimer = setTimeout(() => end(new CallEnded({ details: "no Ready in time" })),
        session.options.connectTimeoutS * 1000);
      const watch = setInterval(() => {
        const reason = ready ? session.checkSilence(now()) : null;
        if (reason) end(new CallEnded({ details: reason }));
        else pump(); // a KeepAlive when nothing has been written for keepaliveS
      }, 1000);
      channel.onopen = () => write(encodeClientMessage(session.startMessage()));
      channel.onclose = () => end(new CallEnded({ details: "the data channel closed", code: "UNAVAILABLE" }));
      channel.onmessage = (ev: MessageEvent) => {
        if (settled) return;
        if (typeof ev.data === "string") { // the call's status, its last message
          let status: { status?: string; message?: string } = {};
          try { status = JSON.parse(ev.data); } catch { status = { status: "INTERNAL", message: "malformed status" }; }
          if (status.status === "OK") end(session.onCallClosed());
          else end(new CallEnded({ details: status.message ?? "", code: status.status ?? "UNKNOWN" }));
          return;
        }
        const msg = decodeServerMessage(new Uint8Array(ev.data));
        if (msg?.kind === "error") return; // the status follows with the same code
        try {
          this.deliver(session.onServerMessage(msg, now()));
        } catch (e) {
          settled = true;
          clearInterval(watch);
          reject(e);
          return;
        }
        if (msg?.kind === "ready") {
          ready = true;
          clearTimeout(connectTimer);
          this.emit("ready", session.sessionId);
        }
        pump();
      };
      this.pump = pump;
      this.conn.signal(pc).catch((e: Error & { code?: string }) => end(new CallEnded({ details: e.message, code: e.code ?? "UNAVAILABLE" })));
    });
  }
}

/** A connection to one harken server: the shared audio context and edge worker of its tracks.
 * Events: "transcript" (event, {speaker, track}), "word_timings" (timings, info), "relabel"
 * (SpeakerChange, info), "turn" (TurnEvent, info) and its kind's name ("speech_started", "utterance_end"), "end" (text, info), "error" (e, info). */
export class Connection extends Emitter {
  readonly tracks: TrackStream[] = [];
  private nextId = 1;
  private waiters: { match: (m: any) => boolean; resolve: (m: any) => void }[] = [];

  constructor(readonly url: string, readonly options: ConnectOptions, readonly context: AudioContext, readonly worker: Worker) {
    super();
    worker.addEventListener("message", (ev: MessageEvent) => {
      const msg = ev.data;
      const waiter = this.waiters.find((w) => w.match(msg));
      if (waiter) {
        this.waiters.splice(this.waiters.indexOf(waiter), 1);
        waiter.resolve(msg);
        return;
      }
      this.tracks.find((t) => t.id === msg.id)?.onWorker(msg);
    });
  }

  /** Start a session for `track` (one per speaker/participant). */
  addTrack(track: MediaStreamTrack, options: TrackOptions = {}): TrackStream {
    const t = new TrackStream(this, this.nextId++, track, options);
    this.tracks.push(t);
    void t.start(!!options.capture);
    return t;
  }

  /** End every track's stream (their last finals come first); resolves with their texts. */
  async close(): Promise<string[]> {
    const texts = await Promise.all(this.tracks.map((t) => t.stop().catch(() => t.text)));
    this.worker.terminate();
    await this.context.close();
    return texts;
  }

  emitFromTrack(name: string, ...args: unknown[]): void {
    this.emit(name, ...args);
  }

  request(msg: object, match: (m: any) => boolean): Promise<any> {
    return new Promise((resolve) => {
      this.waiters.push({ match, resolve });
      this.worker.postMessage(msg);
    });
  }

  /** The offer/answer exchange of one peer connection (POST /v1/webrtc/offer). */
  async signal(pc: RTCPeerConnection): Promise<void> {
    await pc.setLocalDescription(await pc.createOffer());
    await waitForIce(pc);
    const headers: Record<string, string> = { "Content-Type": "application/json" };
    if (this.options.apiKey) headers.Authorization = `Bearer ${this.options.apiKey}`;
    const r = await fetch(new URL(OFFER_PATH, this.url), {
      method: "POST", headers, body: JSON.stringify({ sdp: pc.localDescription!.sdp, type: pc.localDescription!.type }),
    });
    const body = await r.json().catch(() => ({}));
    if (!r.ok) {
      const e = new Error(body.message || r.statusText) as Error & { code?: string };
      e.code = body.code || (r.status === 401 ? "UNAUTHENTICATED" : "UNAVAILABLE");
      throw e;
    }
    await pc.setRemoteDescription(body);
  }
}

async function waitForIce(pc: RTCPeerConnection): Promise<void> {
  if (pc.iceGatheringState === "complete") return;
  await new Promise<void>((resolve) => {
    pc.addEventListener("icegatheringstatechange", () => { if (pc.iceGatheringState === "complete") resolve(); });
    setTimeout(resolve, 3000); // no STUN reachable: host candidates are enough
  });
}

/** Whether this browser can run the edge here (WebAssembly, AudioWorklet, module workers). */
export function edgeSupported(): boolean {
  return typeof WebAssembly === "object" && typeof AudioWorkletNode === "function" && typeof Worker === "function";
}

/**
 * A module worker running `url`. A browser starts workers from the page's own origin only; from a
 * meeting app on another origin (harken.js imported from the harken server), the worker is a
 * same-origin blob that imports the script, which the server allows by CORS (`harken serve
 * --cors-origin`), as it does the models and onnxruntime-web's files the worker fetches.
 */
function moduleWorker(url: URL): Worker {
  if (url.origin === location.origin) return new Worker(url, { type: "module" });
  const shim = URL.createObjectURL(new Blob([`import ${JSON.stringify(url.href)};`], { type: "text/javascript" }));
  const worker = new Worker(shim, { type: "module" });
  const revoke = () => URL.revokeObjectURL(shim); // the worker has fetched it (or failed to)
  worker.addEventListener("message", revoke, { once: true });
  worker.addEventListener("error", revoke, { once: true });
  return worker;
}

/**
 * Connect to a harken server (the URL `harken serve --http-port` serves) with the edge on this
 * device: loads onnxruntime-web and the two ONNX models into a worker, then `addTrack` per speaker.
 */
export async function connect(url: string, options: ConnectOptions = {}): Promise<Connection> {
  if (!edgeSupported()) throw new Error("this browser lacks WebAssembly, AudioWorklet or workers: use the audio (Opus) mode");
  const base = options.assetsUrl ?? new URL(".", import.meta.url).href;
  const worker = moduleWorker(new URL("edge-worker.js", base));
  const ready = new Promise<void>((resolve, reject) => {
    const onMessage = (ev: MessageEvent) => {
      if (ev.data.type === "ready") resolve();
      else if (ev.data.type === "failed") reject(new Error(`the edge could not start: ${ev.data.message}`));
      else return;
      worker.removeEventListener("message", onMessage);
    };
    worker.addEventListener("message", onMessage);
    worker.addEventListener("error", (e) => reject(new Error(`the edge worker failed to load${e.message ? `: ${e.message}` : ` from ${base}`}`)));
  });
  worker.postMessage({ type: "init", base });
  const context = new AudioContext();
  await context.audioWorklet.addModule(new URL("capture-worklet.js", base));
  // a context made outside a user gesture starts suspended: capture would hear nothing
  await context.resume().catch(() => undefined);
  await ready;
  return new Connection(new URL(url, location.href).href, options, context, worker);
}
