"""Crafted samples against the grouped kept per-sample gradients at a batch where a LayerNorm's
weight and bias (768 each, 24 samples: 18,432 elements per parameter) are laid side by side on the
CPU: huge (1e30) and cancelling samples move the released step by at most R, and the two
gradients do form one group (the path under attack is the grouped one); and the same for small kept
gradients grouped across a large one between them (a class token's with the layers', a position
embedding's alone)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from test_privacy_under_attack import Case, R, assert_bounded, run_pair, true_norm

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

WIDTH, HONEST = 768, 23


def layer_norm_case(variant: str) -> Case:
    """``Linear(4, 768) → LayerNorm(768) → Linear(768, 2)``, 23 honest samples and a crafted one:
    ``huge``: inputs of 1e30 (a true gradient norm far above R); ``cancel``: the LayerNorm's
    inputs equal but for 1 + jε and output targets of alternating sign."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, WIDTH), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2))
    with torch.no_grad():
        model[1].weight.add_(0.3 * torch.randn(WIDTH))
        model[1].bias.add_(0.3 * torch.randn(WIDTH))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(HONEST, 4, generator=gen)
    with torch.no_grad():
        t = model(x) + 0.02 * torch.randn(HONEST, 2, generator=gen)
    if variant == "huge":
        xc = torch.full((1, 4), 1e30)
        tc = torch.randn(1, 2, generator=gen) * 1e3
    else:
        xc = (1e4 * (1 + 1e-5 * torch.arange(4, dtype=torch.float64))).float().reshape(1, 4)
        with torch.no_grad():
            tc = model(xc) + 1e3 * torch.tensor([[1.0, -1.0]])
    return Case(model, (x, t), (xc, tc))


@pytest.mark.parametrize("mode", ["bk_mixed", "bk"])
@pytest.mark.parametrize("variant", ["huge", "cancel"])
def test_grouped_layer_norm_gradients_under_a_crafted_sample(kept_group_shapes, mode, variant):
    shapes = kept_group_shapes
    case = layer_norm_case(variant)
    if variant == "huge":
        assert true_norm(case.model, *case.crafted) >= 10 * R
    batch = HONEST + 1
    assert_bounded(*run_pair(case, "native", mode, batch=batch), batch=batch,
                   what=f"LayerNorm {variant} {mode}")
    assert (batch, 2 * WIDTH) in shapes, f"the LayerNorm's gradients were not grouped: {shapes}"


class Tokens(nn.Module):
    """A class token and a position embedding (traced, instantiated; the embedding's gradient,
    40·64 elements per sample, large on the CPU, comes between the layers' and the token's), a
    LayerNorm and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Parameter(0.5 * torch.randn(1, 1, 64))
        self.pos = nn.Parameter(0.5 * torch.randn(1, 40, 64))
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 3)

    def forward(self, x):
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return self.head(self.norm(x)).mean(1)


@pytest.mark.parametrize("variant", ["huge", "cancel"])
def test_small_gradients_grouped_across_a_large_one_under_a_crafted_sample(kept_group_shapes,
                                                                          variant):
    """``huge``: a sample of inputs 1e30 and targets 1e4; ``cancel``: positions equal but for
    1 + jε (the LayerNorm's input cancels) and targets of alternating sign."""
    shapes = kept_group_shapes
    torch.manual_seed(0)
    model = Tokens()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 39, 64, generator=gen)
    with torch.no_grad():
        t = model(x) + 0.02 * torch.randn(5, 3, generator=gen)
    if variant == "huge":
        xc, tc = torch.full((1, 39, 64), 1e30), torch.full((1, 3), 1e4)
    else:
        xc = (1e4 * (1 + 1e-5 * torch.arange(64, dtype=torch.float64))).float().expand(
            1, 39, 64).contiguous()
        tc = 1e3 * torch.tensor([[1.0, -1.0, 1.0]])
    case = Case(model, (x, t), (xc, tc))
    assert true_norm(case.model, *case.crafted) >= 10 * R
    assert_bounded(*run_pair(case, "native", "bk_mixed", batch=6), batch=6,
                   what=f"tokens {variant}")
    assert (6, 3 * 64 + 3 + 2 * 64 + 64) in shapes, f"not grouped across the large one: {shapes}"


@pytest.mark.parametrize("variant", ["huge", "cancel"])
def test_layer_norms_instantiated_in_groups_under_a_crafted_sample(monkeypatch, variant):
    """Three LayerNorms whose held operands exceed the stack's budget after each one (their
    gradients instantiated in groups before the end of the pass): a huge or cancelling sample moves
    the released step by at most R."""
    import private_engine.layers.norm_stack as norm_stack

    batch = 6
    monkeypatch.setattr(norm_stack, "HELD_ELEMENTS", 2 * batch * 5 * 16)  # one layer at a time
    stacked = []
    own = norm_stack._instantiate

    def spy(module, As, Gs, names):
        stacked.append(len(As))
        return own(module, As, Gs, names)

    monkeypatch.setattr(norm_stack, "_instantiate", spy)
    torch.manual_seed(0)
    blocks = []
    for _ in range(3):
        blocks += [nn.Linear(16, 16), nn.LayerNorm(16)]
        with torch.no_grad():
            blocks[-1].weight.add_(0.3 * torch.randn(16))
            blocks[-1].bias.add_(0.3 * torch.randn(16))
    model = nn.Sequential(*blocks, nn.Linear(16, 2))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(batch - 1, 5, 16, generator=gen)
    with torch.no_grad():
        t = model(x) + 0.02 * torch.randn(batch - 1, 5, 2, generator=gen)
    if variant == "huge":
        xc, tc = torch.full((1, 5, 16), 1e30), torch.full((1, 5, 2), 1e4)
    else:
        xc = (1e4 * (1 + 1e-5 * torch.arange(16, dtype=torch.float64))).float().expand(
            1, 5, 16).contiguous()
        tc = 1e3 * torch.tensor([1.0, -1.0]).expand(1, 5, 2)
    case = Case(model, (x, t), (xc, tc))
    assert true_norm(case.model, *case.crafted) >= 10 * R
    assert_bounded(*run_pair(case, "native", "bk_mixed", batch=batch), batch=batch,
                   what=f"LayerNorms in groups {variant}")
    assert stacked.count(1) >= 3, f"not instantiated through the stack: {stacked}"
