// The little of onnxruntime this package uses, typed once, so the same code runs on
// onnxruntime-node (node tests) and onnxruntime-web (the browser): pass either module in.

export interface OrtTensor {
  readonly data: unknown;
  readonly dims: readonly number[];
}

export interface OrtSession {
  run(feeds: Record<string, OrtTensor>): Promise<Record<string, OrtTensor>>;
}

export interface OrtModule {
  InferenceSession: { create(model: string | Uint8Array, options?: object): Promise<OrtSession> };
  Tensor: new (type: "float32", data: Float32Array, dims: readonly number[]) => OrtTensor;
}

/** One loaded model; runs one at a time (onnxruntime-web refuses overlapping runs of a session). */
export class OrtModel {
  private queue: Promise<unknown> = Promise.resolve();

  constructor(readonly ort: OrtModule, readonly session: OrtSession) {}

  static async load(ort: OrtModule, model: string | Uint8Array): Promise<OrtModel> {
    // one thread, sequential: the edge budget is one core (edge/features.py, edge/vad.py)
    const session = await ort.InferenceSession.create(model, {
      intraOpNumThreads: 1, interOpNumThreads: 1, executionMode: "sequential", executionProviders: ["cpu"],
    }).catch(() => ort.InferenceSession.create(model, { executionProviders: ["wasm"] }));
    return new OrtModel(ort, session);
  }

  tensor(data: Float32Array, dims: readonly number[]): OrtTensor {
    return new this.ort.Tensor("float32", data, dims);
  }

  run(feeds: Record<string, OrtTensor>): Promise<Record<string, OrtTensor>> {
    const result = this.queue.then(() => this.session.run(feeds));
    this.queue = result.catch(() => undefined);
    return result;
  }
}
