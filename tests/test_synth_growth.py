"""Growing synth-en's decoder (lab/training/growth.py): the grown model computes exactly what the
shallower one did, where the copies go, and what cannot be grown."""

from __future__ import annotations

import pytest
import torch

from harken.training import growth
from harken.training import train as T
from harken.shared.errors import HarkenError


def test_copies_go_after_evenly_spaced_layers():
    assert growth.copied_after(4, 4) == []
    assert growth.copied_after(4, 6) == [1, 3]
    assert growth.copied_after(4, 8) == [0, 1, 2, 3]
    assert growth.copied_after(4, 5) == [3]
    assert growth.copied_after(1, 2) == [0]
    with pytest.raises(HarkenError):
        growth.copied_after(4, 9)  # more copies than layers to copy
    with pytest.raises(HarkenError):
        growth.copied_after(4, 3)


def _trained_like(model: torch.nn.Module, seed: int) -> None:
    """Weights away from their initialisation (norms not all ones), as a trained model's are."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize("n_old,n_new", [(1, 2), (2, 3), (2, 4)])
def test_the_grown_decoder_computes_exactly_what_the_shallower_one_did(n_old, n_new):
    vocab = T.Vocab(list(range(40)), 151936)
    small = T.Trainee(T.tiny_train_config(n_old), vocab, 10, seed=1).eval()
    _trained_like(small, 2)
    state = {"model": small.state_dict(), "average": {"decay": 0.9, "updates": 5,
                                                      "params": dict(small.named_parameters())}}
    assert growth.fit(state, n_new) == (n_old, n_new)
    assert growth.decoder_layers_of(state["model"]) == n_new
    big = T.Trainee(T.tiny_train_config(n_new), vocab, 10, seed=1).eval()
    big.load_state_dict(state["model"])  # strict: every key, every shape
    assert state["average"]["params"].keys() == dict(big.named_parameters()).keys()
    x = torch.randn(2, 13, small.cfg.text.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, _ = small.decode_hidden(x)
        got, _ = big.decode_hidden(x)
    assert torch.equal(got, want)
    # and the copies can learn: their output projections get gradients at once
    big.train()
    out, _ = big.decode_hidden(x)
    out.square().mean().backward()
    copy = growth.copied_after(n_old, n_new)[0] + 1  # the first copy's index in the grown decoder
    assert big.layers[copy].self_attn.o_proj.weight.grad.abs().sum() > 0
    assert big.layers[copy].mlp.down_proj.weight.grad.abs().sum() > 0


def test_a_state_that_fits_is_left_alone_and_a_deeper_one_refused():
    model = T.Trainee(T.tiny_train_config(2), T.Vocab(list(range(10)), 151936), 5, seed=0)
    state = {"model": model.state_dict(), "opt": {"x": 1}}
    assert growth.fit(state, 2) is None and "opt" in state
    with pytest.raises(HarkenError, match="more than the 1 of this run"):
        growth.fit(state, 1)
