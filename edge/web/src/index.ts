// @harken/edge-web: harken's edge agent in JavaScript (see README.md in this folder).
export { CODEC_NAME, CodecError, DEFAULT_MODE, encodeFrames, frameFloors, keepalive } from "./codec.js";
export type { Frames, Mode } from "./codec.js";
export { crc32c } from "./crc32c.js";
export { codeBook, encodeSymbols } from "./entropy.js";
export { RunningMaxFloor, StreamingLogMel } from "./features.js";
export { OrtModel } from "./ort.js";
export type { OrtModule } from "./ort.js";
export { FeatureStream, MAX_PACKET_FRAMES } from "./pipeline.js";
export type { EdgeModels, FeatureStreamOptions } from "./pipeline.js";
export { decodeServerMessage, encodeClientMessage, featuresBytes } from "./proto.js";
export type * from "./protocol.js";
export { DEFAULT_VAD, SileroVad, SpeechSegmenter, StreamingVad } from "./vad.js";
export type { SegmentEvent, VadOptions } from "./vad.js";
export { ClientSession, DEFAULT_CLIENT_OPTIONS, FeatureBuffer, ReplayFilter, StreamError } from "./session.js";
export type { ClientOptions, Disconnect, Retry, SessionOutput, StreamProgress } from "./session.js";
export { StreamingResampler } from "./resample.js";
export { joinTexts, transcriptText } from "./text.js";
