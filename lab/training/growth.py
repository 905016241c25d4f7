"""Growing synth-en's decoder in depth without changing what it computes.

The probes of the sixteenth session found the decoder, not the encoder, short: read from the
espeak-ng phonemes of its own training fortunes (no audio at all), it still wrote 28.6% of their
words wrong. A deeper decoder is grown from the trained one the way LLaMA Pro expands a model
(Wu et al. 2024, "block expansion"): after chosen layers, a copy of that layer whose two output
projections (attention's `o_proj`, the MLP's `down_proj`) are zero. In a pre-norm block that adds
exactly nothing to the residual stream, so the grown decoder computes what the old one did, bit for
bit, and training then finds a use for the copies (their output projections get gradients at once,
their other weights as soon as those are non-zero).

The copies go after evenly spaced layers: 4 -> 6 copies layers 1 and 3 ([0, 1, 1', 2, 3, 3']),
4 -> 8 every layer. `fit` grows a saved run (its weights and their average) to the configured depth.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from harken.shared.errors import HarkenError

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_ZEROED = ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight", "mlp.down_proj.bias")


def decoder_layers_of(tensors: dict[str, torch.Tensor]) -> int:
    """How many decoder layers a Trainee state dict holds (its `layers.N.*` keys)."""
    found = {int(m.group(1)) for k in tensors if (m := _LAYER.match(k))}
    return max(found) + 1 if found else 0


def copied_after(n_old: int, n_new: int) -> list[int]:
    """The old layers each followed by a zeroed copy, evenly spaced, in order."""
    copies = n_new - n_old
    if copies < 0 or copies > n_old:
        raise HarkenError(f"a decoder of {n_old} layers grows to between {n_old} and {2 * n_old}, not {n_new}")
    return [(j + 1) * n_old // copies - 1 for j in range(copies)] if copies else []


def grow_decoder(tensors: dict[str, torch.Tensor], n_new: int) -> dict[str, torch.Tensor]:
    """`tensors` (a Trainee state dict, or the parameters of its weight average) with its decoder
    grown to `n_new` layers; every other tensor is the same object."""
    n_old = decoder_layers_of(tensors)
    after = set(copied_after(n_old, n_new))
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for k, t in tensors.items():
        m = _LAYER.match(k)
        if m:
            by_layer.setdefault(int(m.group(1)), {})[m.group(2)] = t
        else:
            out[k] = t
    new = 0
    for i in range(n_old):
        for rest, t in by_layer[i].items():
            out[f"layers.{new}.{rest}"] = t
        new += 1
        if i in after:
            for rest, t in by_layer[i].items():
                out[f"layers.{new}.{rest}"] = torch.zeros_like(t) if rest in _ZEROED else t.clone()
            new += 1
    return out


def fit(state: dict[str, Any], n_layers: int) -> tuple[int, int] | None:
    """Grow a saved run (`state["model"]`, and `state["average"]["params"]` where it keeps an
    average) to `n_layers` decoder layers in place. Its optimiser moments no longer match the
    parameters, so they are dropped (the run warms a fresh AdamW up again). Returns (old, new) layer
    counts where it grew, None where the depth already fits; a deeper state than the run is an error."""
    n_old = decoder_layers_of(state["model"])
    if n_old == n_layers or n_old == 0:
        return None
    if n_old > n_layers:
        raise HarkenError(f"the saved run's decoder has {n_old} layers, more than the {n_layers} of this run "
                          f"(--decoder-layers {n_old} or more)")
    state["model"] = grow_decoder(state["model"], n_layers)
    if state.get("average"):
        state["average"] = state["average"] | {"params": grow_decoder(state["average"]["params"], n_layers)}
    state.pop("opt", None)
    return n_old, n_layers
