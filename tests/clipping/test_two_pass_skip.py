"""The second backward of the two-pass modes asks autograd only for the outputs of the layers
whose clipped sums it writes: none when every layer is released from what its norm pass kept
(per-sample gradients, or the operands the ghost-bound stack held to the end of the pass: one
backward per step), and it stops at the lowest such layer."""
import warnings

import pytest
import torch
from torch import nn

import private_engine as pe
from private_engine.clipping import clipper, two_pass


class Counted(nn.Module):
    """LayerNorm, then two Linears; counts the gradients reaching the LayerNorm's output."""

    def __init__(self, hits: list):
        super().__init__()
        self.ln, self.l1, self.l2, self.hits = nn.LayerNorm(6), nn.Linear(6, 16), \
            nn.Linear(16, 3), hits

    def forward(self, x):
        h = self.ln(x)
        if h.requires_grad:
            h.register_hook(lambda g: self.hits.append(1))
        return self.l2(torch.nn.functional.gelu(self.l1(h)))


def _second_step(mode: str, monkeypatch, held: int = clipper.HELD_GRADIENTS,
                 lowest: int = two_pass.HELD_LOWEST):
    """The update of a second step (after the separability probe's backward passes of the
    first), the backward passes it ran, and the gradients that reached the LayerNorm's output;
    ``held`` / ``lowest``: the most output-gradient elements the norm pass holds for deferred
    ghost bounds / of the last layers it normed at once."""
    monkeypatch.setattr(clipper, "HELD_GRADIENTS", held)
    monkeypatch.setattr(two_pass, "HELD_LOWEST", lowest)
    torch.manual_seed(0)
    hits: list = []
    model = Counted(hits)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = pe.PrivacyEngine(model, batch_size=4, sample_size=100, max_grad_norm=0.5,
                                  noise_multiplier=0.0, clipping_mode=mode,
                                  check_sampling=False)
    engine.attach(opt)
    x = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(1))
    x[2] *= 1e3  # a sample far above R
    opt.step(loss=model(x).square().sum((1, 2)))
    grad, passes = torch.autograd.grad, []

    def counted(*args, **kwargs):
        passes.append(1)
        return grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counted)
    before = [p.detach().clone() for p in model.parameters()]
    hits.clear()
    opt.step(loss=model(x).square().sum((1, 2)))
    monkeypatch.undo()
    return [p.detach() - b for p, b in zip(model.parameters(), before)], len(passes), len(hits)


@pytest.mark.parametrize("mode", ["mixed", "per_sample"])
def test_no_second_backward_when_every_layer_kept_its_gradients(mode, monkeypatch):
    """Every layer instantiated with per-sample gradients no larger than its input and output
    gradient (T = 8 positions): one backward, the release of book-keeping (within float32
    rounding: the two certify the LayerNorm's norms their own way)."""
    update, passes, hits = _second_step(mode, monkeypatch)
    bk, _, _ = _second_step("bk", monkeypatch)
    assert (passes, hits) == (1, 1)
    for u, v in zip(update, bk):
        assert float((u - v).norm() / v.norm()) <= 2e-5  # float32 rounding apart
    assert all(bool(u.abs().sum() > 0) for u in update)


def test_second_backward_stops_at_the_lowest_layer_it_writes(monkeypatch):
    """"ghost", with no output gradient held by the norm pass: both Linears are ghost-normed
    and written by the second backward; the LayerNorm below them keeps its per-sample gradients,
    so the second backward does not reach it."""
    update, passes, hits = _second_step("ghost", monkeypatch, held=0, lowest=0)
    bk, _, _ = _second_step("bk", monkeypatch)
    assert (passes, hits) == (2, 1)
    for u, v in zip(update, bk):
        assert float((u - v).norm() / v.norm()) <= 2e-5  # float32 rounding apart


@pytest.mark.parametrize("held,lowest", [(clipper.HELD_GRADIENTS, 0),
                                         (0, two_pass.HELD_LOWEST), (0, 16 * 8 * 4)],
                         ids=["bound-stack", "lowest-layers", "lowest-layer-only"])
def test_no_second_backward_below_the_layers_whose_operands_were_held(held, lowest, monkeypatch):
    """"ghost": the Linears' operands held to the end of the norm pass — by the ghost-bound
    stack, which forms their bounds then, or as the last layers normed at once — release their
    clipped sums: one backward. With room for the lowest Linear's output gradient only (16
    elements at 8 positions of 4 samples), the second backward writes the top Linear's."""
    update, passes, hits = _second_step("ghost", monkeypatch, held=held, lowest=lowest)
    bk, _, _ = _second_step("bk", monkeypatch)
    assert (passes, hits) == (2 if lowest == 16 * 8 * 4 else 1, 1)
    for u, v in zip(update, bk):
        assert float((u - v).norm() / v.norm()) <= 2e-5  # float32 rounding apart
