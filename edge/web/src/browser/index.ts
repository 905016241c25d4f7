// The browser bundle (dist/browser/harken.js): `harken.connect(url, {apiKey})` and the pieces
// under it, for pages and meeting apps.
export { Connection, TrackStream, connect, edgeSupported } from "./client.js";
export type { ConnectOptions, TrackInfo, TrackOptions } from "./client.js";
export { ClientSession, StreamError } from "../session.js";
export type { SegmentTimings, TranscriptEvent, TurnEvent } from "../protocol.js";
export { transcriptText } from "../text.js";
