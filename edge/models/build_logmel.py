"""Build edge/models/logmel.onnx: Qwen3-ASR's raw log10-mel as an ONNX graph from plain ops.

Run from the repository root (needs torch, onnx, onnxscript; the edge itself only loads the .onnx):

    .venv/bin/python -m harken.edge.models.build_logmel [--out PATH]

The graph takes a signal that already carries its padding (the streaming code in edge/features.py
adds the reference's reflect padding) and returns every full 400-sample window's log10-mel:

    padded [n_samples] float32 -> raw log10 mel [128, (n_samples - 400) // 160 + 1] float32

There is no max-floor and no (x + 4) / 4: those depend on the whole utterance (or on the running
maximum when streaming) and live in numpy. torch.stft does not export cleanly, so the STFT is a
DFT basis (periodic Hann folded in) applied as one matrix product over the frames.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from harken.shared.features_spec import HOP_LENGTH, LOG10_FLOOR, N_FFT, N_MELS, SAMPLE_RATE, slaney_mel_filters

N_FREQS = N_FFT // 2 + 1  # 201 one-sided frequency bins
BLOCK = 80  # gcd(N_FFT, HOP_LENGTH): frames are 5 blocks long and start every 2 blocks
DEFAULT_OUT = Path(__file__).with_name("logmel.onnx")
OPSET = 18


def periodic_hann(n: int) -> np.ndarray:
    """[n] float64, the window torch.hann_window(n) (periodic) uses."""
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)


def dft_basis(n_fft: int = N_FFT) -> np.ndarray:
    """[2 * (n_fft // 2 + 1), n_fft] float64: windowed cos rows, then windowed -sin rows.

    Row k of the cos half dotted with a frame gives Re(X_k); of the sin half, Im(X_k)."""
    k = np.arange(n_fft // 2 + 1)[:, None]
    n = np.arange(n_fft)[None, :]
    # Reducing k*n mod n_fft keeps the angle small, so cos/sin stay exact to float64 rounding.
    angle = 2.0 * np.pi * ((k * n) % n_fft) / n_fft
    window = periodic_hann(n_fft)[None, :]
    return np.concatenate([np.cos(angle) * window, -np.sin(angle) * window], axis=0)


class LogMel(torch.nn.Module):
    """padded [n_samples] float32 -> raw log10 mel [128, frames] float32, frames = (n - 400) // 160 + 1.

    Frames are the rows of one GEMM ([frames, 400] @ [400, 402]), gathered from 80-sample blocks
    (400 = 5 * 80, hop 160 = 2 * 80) by strided slices. As GEMM rows, every frame is computed with
    the same arithmetic however many frames a call holds, so streaming in pieces is bit-identical
    to one call; a strided conv1d (frames as GEMM columns) was not: onnxruntime picks its blocking
    by the output length, and 90% of values moved by an ulp or more between piece sizes.

    Float32 throughout. The reference itself runs a float32 FFT, and that rounding dominates:
    a float64 DFT came no closer to it (max 6e-5 vs 6e-5 on normalised features) and ran 5x slower
    (onnxruntime has no float64 Conv; framing had to be a Gather)."""

    dft: torch.Tensor  # buffers, declared for the type checker
    mel: torch.Tensor

    def __init__(self):
        super().__init__()
        # [400, 402]: columns are windowed cos (Re) then windowed -sin (Im) per frequency.
        self.register_buffer("dft", torch.from_numpy(dft_basis().T.copy()).to(torch.float32))
        # [201, 128]
        self.register_buffer("mel", torch.from_numpy(slaney_mel_filters()).to(torch.float32))

    def forward(self, padded: torch.Tensor) -> torch.Tensor:
        n_frames = (padded.shape[0] - N_FFT) // HOP_LENGTH + 1
        n_blocks = 2 * n_frames + 3  # frame t spans blocks 2t .. 2t + 4
        blocks = padded[: BLOCK * n_blocks].reshape(n_blocks, BLOCK)  # [2F + 3, 80]
        frames = torch.cat([blocks[j : j + 2 * n_frames : 2] for j in range(N_FFT // BLOCK)],
                           dim=1)  # [F, 400]
        spec = frames @ self.dft  # [F, 402]
        power = spec[:, :N_FREQS] ** 2 + spec[:, N_FREQS:] ** 2  # [F, 201]
        mel = power @ self.mel  # [F, 128]
        return torch.log10(torch.clamp(mel, min=LOG10_FLOOR)).T  # [128, F]


def export(out: Path = DEFAULT_OUT) -> Path:
    """Export LogMel to `out` with a dynamic signal length. Returns `out`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    module = LogMel().eval()
    example = torch.zeros(N_FFT + 3 * HOP_LENGTH, dtype=torch.float32)
    torch.onnx.export(
        module, (example,), str(out), input_names=["padded"], output_names=["log_mel"],
        dynamic_shapes={"padded": {0: torch.export.Dim("n_samples", min=N_FFT)}},
        opset_version=OPSET, dynamo=True, external_data=False, optimize=True, verbose=False,
    )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the .onnx")
    args = parser.parse_args(argv)
    print(export(args.out))


if __name__ == "__main__":
    main()
