"""An exponential moving average of synth-en's weights: what each evaluation measures and exports.

At a learning rate of ~4e-4 the raw weights wander: the 40-utterance held-out WER swung between
43% and 49% over 2,000 steps (steps 27,200-29,200) while the trend moved 1-2 points a session. The
average of the recent weights sits nearer the bottom of the valley the optimiser is bouncing
across, the effect a learning-rate cool-down buys, without stopping the run to cool it down. The
raw weights go on training; the average is only read.

After n updates the decay is min(decay, n / (n + 1)): the plain mean of every step's weights since
the average began until that span reaches the decay's time constant (1,000 steps at 0.999), an
exponential average after it. (The (1 + n) / (10 + n) ramp of some trainers holds the span near
n / 10 for the first ~9,000 steps: at step 345 of this run it averaged ~40 steps.)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn


class WeightAverage:
    def __init__(self, model: nn.Module, decay: float, state: dict[str, Any] | None = None):
        self.decay = decay
        self.updates = 0
        named = dict(model.named_parameters())
        self.params = {k: p.detach().float().clone() for k, p in named.items()}
        if state is not None and state["params"].keys() == named.keys() and all(
                state["params"][k].shape == p.shape for k, p in named.items()):
            self.params = {k: state["params"][k].to(p.device, torch.float32) for k, p in named.items()}
            self.updates = int(state["updates"])

    def update(self, model: nn.Module) -> None:
        d = min(self.decay, self.updates / (self.updates + 1))
        with torch.no_grad():
            torch._foreach_lerp_(list(self.params.values()),
                                 [p.detach().float() for p in model.parameters()], 1.0 - d)
        self.updates += 1

    @contextmanager
    def applied(self, model: nn.Module) -> Iterator[None]:
        """The model holds the averaged weights inside the block and its own again after it."""
        named = dict(model.named_parameters())
        own = {k: p.detach().clone() for k, p in named.items()}
        with torch.no_grad():
            for k, p in named.items():
                p.copy_(self.params[k])
        try:
            yield
        finally:
            with torch.no_grad():
                for k, p in named.items():
                    p.copy_(own[k])

    def state_dict(self) -> dict[str, Any]:
        """{"decay", "updates", "params": {parameter name: fp32 tensor}}: `params` updates a model's
        state dict to the averaged model (`state.pack_run` packs that)."""
        return {"decay": self.decay, "updates": self.updates, "params": {k: t.cpu() for k, t in self.params.items()}}
