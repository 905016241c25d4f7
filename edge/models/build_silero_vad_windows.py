"""Build edge/models/silero_vad_windows.onnx: the vendored silero-vad's 16 kHz path, many windows
per call.

Run from the repository root (needs onnx; the edge itself only loads the .onnx):

    .venv/bin/python -m harken.edge.models.build_silero_vad_windows [--out PATH]

The vendored model (silero_vad.onnx, MIT, see LICENSE.silero_vad) takes one 576-sample window
(64 context + 512 new) per call, because its LSTM state runs from window to window. Everything
before the LSTM (reflect pad, STFT conv, magnitude, four convs) sees only its own window, so it can
run on all windows at once as a batch; the LSTM then runs over them as one sequence inside a single
ONNX `LSTM` node. The weights are copied from the vendored graph's 16 kHz branch, the ops are the
same ones (Pow 2 and Sqrt for the magnitude, torch's gate order i,f,g,o permuted to ONNX's i,o,f,c
as the vendored graph does), so the results equal it (tests/test_vad.py checks against silero's
own OnnxWrapper):

    frames [windows, 576] float32, state [2, 1, 128] -> output [windows], stateN [2, 1, 128]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("silero_vad.onnx")
DEFAULT_OUT = Path(__file__).with_name("silero_vad_windows.onnx")
OPSET = 16  # the vendored model's
HIDDEN = 128
FRAME = 576  # 64 context + 512 window samples
RIGHT_PAD = 64  # silero's STFT reflect-pads each frame on the right only
WEIGHTS = ["stft.forward_basis_buffer", "decoder.rnn.weight_ih", "decoder.rnn.weight_hh",
           "decoder.rnn.bias_ih", "decoder.rnn.bias_hh", "decoder.decoder.2.weight",
           "decoder.decoder.2.bias"] + [f"encoder.{k}.reparam_conv.{p}" for k in range(4)
                                        for p in ("weight", "bias")]
ENCODER_STRIDES = [1, 2, 2, 1]


def load_weights(source: Path = SOURCE) -> dict[str, np.ndarray]:
    """The 16 kHz branch's parameters by their torch names (the graph's `sr == 16000` If branch)."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(source)).graph
    branch = next(n for n in graph.node if n.op_type == "If")
    then_graph = next(a.g for a in branch.attribute if a.name == "then_branch")
    found = {}
    for node in then_graph.node:
        if node.op_type == "Constant":
            name = node.output[0].split("__Inline_0__")[-1]
            if name in WEIGHTS:
                found[name] = numpy_helper.to_array(node.attribute[0].t)
    missing = set(WEIGHTS) - set(found)
    if missing:
        raise ValueError(f"{source}: not the expected silero-vad graph, missing {sorted(missing)}")
    return found


def torch_gates_to_onnx(w: np.ndarray) -> np.ndarray:
    """Rows [i, f, g, o] (torch LSTM) -> [i, o, f, c] (ONNX LSTM)."""
    i, f, g, o = np.split(w, 4, axis=0)
    return np.concatenate([i, o, f, g], axis=0)


def _initializers(w: dict[str, np.ndarray]) -> list:
    from onnx import numpy_helper

    def const(name, value):
        return numpy_helper.from_array(np.asarray(value), name)

    lstm_bias = np.concatenate([torch_gates_to_onnx(w["decoder.rnn.bias_ih"]),
                                torch_gates_to_onnx(w["decoder.rnn.bias_hh"])])
    return [
        const("stft_basis", w["stft.forward_basis_buffer"]),
        *[const(f"enc{k}_{p}", w[f"encoder.{k}.reparam_conv.{p}"])
          for k in range(4) for p in ("weight", "bias")],
        const("lstm_W", torch_gates_to_onnx(w["decoder.rnn.weight_ih"])[None]),
        const("lstm_R", torch_gates_to_onnx(w["decoder.rnn.weight_hh"])[None]),
        const("lstm_B", lstm_bias[None]),
        const("head_w", w["decoder.decoder.2.weight"]), const("head_b", w["decoder.decoder.2.bias"]),
        const("pads", np.array([0, 0, 0, RIGHT_PAD], np.int64)),
        const("two", np.array(2.0, np.float32)),
        *[const(f"i{v}", np.array([v], np.int64)) for v in (0, 1, 2, 129, 258)],
        const("seq_shape", np.array([-1, 1, HIDDEN], np.int64)),
        const("head_shape", np.array([-1, HIDDEN, 1], np.int64)),
        const("flat", np.array([-1], np.int64)),
    ]


def _nodes() -> list:
    from onnx import helper

    n = helper.make_node
    nodes = [
        n("Pad", ["frames", "pads"], ["padded"], mode="reflect"),  # [W, 640]
        n("Unsqueeze", ["padded", "i1"], ["padded3"]),  # [W, 1, 640]
        n("Conv", ["padded3", "stft_basis"], ["spec"], kernel_shape=[256], strides=[128],
          pads=[0, 0]),  # [W, 258, 4]: 129 real rows, then 129 imaginary
        n("Slice", ["spec", "i0", "i129", "i1"], ["re"]),
        n("Slice", ["spec", "i129", "i258", "i1"], ["im"]),
        n("Pow", ["re", "two"], ["re2"]), n("Pow", ["im", "two"], ["im2"]),
        n("Add", ["re2", "im2"], ["power"]), n("Sqrt", ["power"], ["x"]),  # [W, 129, 4]
    ]
    x = "x"
    for k, stride in enumerate(ENCODER_STRIDES):
        nodes += [n("Conv", [x, f"enc{k}_weight", f"enc{k}_bias"], [f"conv{k}"], kernel_shape=[3],
                    pads=[1, 1], strides=[stride]),
                  n("Relu", [f"conv{k}"], [f"enc{k}"])]
        x = f"enc{k}"
    return nodes + [
        n("Reshape", [x, "seq_shape"], ["seq"]),  # [W, 128, 1] -> [W (time), 1 (batch), 128]
        n("Slice", ["state", "i0", "i1", "i0"], ["h0"]),
        n("Slice", ["state", "i1", "i2", "i0"], ["cell0"]),
        n("LSTM", ["seq", "lstm_W", "lstm_R", "lstm_B", "", "h0", "cell0"], ["hidden", "h_n", "c_n"],
          hidden_size=HIDDEN),  # hidden: [W, 1, 1, 128]
        n("Concat", ["h_n", "c_n"], ["stateN"], axis=0),
        n("Reshape", ["hidden", "head_shape"], ["head_in"]),
        n("Relu", ["head_in"], ["head_relu"]),
        n("Conv", ["head_relu", "head_w", "head_b"], ["logit"], kernel_shape=[1]),
        n("Sigmoid", ["logit"], ["prob"]),
        n("Reshape", ["prob", "flat"], ["output"]),
    ]


def build(weights: dict[str, np.ndarray]):
    """The windows graph as an onnx ModelProto."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        _nodes(), "silero_vad_16k_windows",
        [helper.make_tensor_value_info("frames", TensorProto.FLOAT, ["windows", FRAME]),
         helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, 1, HIDDEN])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["windows"]),
         helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [2, 1, HIDDEN])],
        _initializers(weights))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="harken build_silero_vad_windows")
    model.ir_version = 8  # what the vendored model uses; any onnxruntime that runs it runs this
    onnx.checker.check_model(model)
    return model


def export(out: Path = DEFAULT_OUT, source: Path = SOURCE) -> Path:
    """Write the windows graph derived from `source` to `out`; return `out`."""
    out = Path(out)
    out.write_bytes(build(load_weights(source)).SerializeToString())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--source", type=Path, default=SOURCE)
    args = parser.parse_args()
    print(f"wrote {export(args.out, args.source)}")


if __name__ == "__main__":
    main()
