"""A crafted sample that cancels in three Linear layers of one shape (130 wide, 3 positions): its
loose fast bounds take one second try together (the blocked Grams of the three layers' rows at
once, then float64 Grams), and the released step moves by at most R."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import private_engine.layers.ghost_stack as ghost_stack
from test_privacy_under_attack import Case, R, assert_bounded, run_pair, true_norm

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

D = 130


def three_layer_case() -> Case:
    """``Linear(D, D)`` three times on 3 positions; the crafted sample repeats one input ×10⁴
    (up to 1 + 2⁻¹²ε) with output gradients ±2·10³ alternating over the positions, which every
    layer sees as positions that cancel."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D))
    gen = torch.Generator().manual_seed(2)
    x = 0.1 * torch.randn(3, 3, D, generator=gen)
    with torch.no_grad():
        t = model(x) + 0.02 * torch.randn(3, 3, D, generator=gen)
    xc = 1e4 * torch.randn(1, 1, D, generator=gen).expand(1, 3, D)
    xc = (xc * (1 + 2 ** -12 * torch.randn(1, 3, D, generator=gen))).contiguous()
    with torch.no_grad():
        y = model(xc)
    u = 1e3 * torch.randn(1, 1, D, generator=gen)
    gdir = u * torch.tensor([1.0, -1.0, 0.0]).view(1, 3, 1)
    gdir = gdir * (1 + 1e-5 * torch.randn(y.shape, generator=gen))
    return Case(model, (x, t), (xc, y - gdir / 2))


@pytest.mark.parametrize("mode", ["bk_mixed", "bk"])
def test_cancellation_in_layers_of_one_shape_takes_one_second_try(monkeypatch, mode):
    calls = []
    own = ghost_stack.second_try_rows

    def spy(a, *rest):
        calls.append(a.shape[0])
        return own(a, *rest)

    monkeypatch.setattr(ghost_stack, "second_try_rows", spy)
    case = three_layer_case()
    assert true_norm(case.model, *case.crafted) >= 10 * R
    assert_bounded(*run_pair(case, "native", mode), what=f"three layers {mode}")
    assert any(n >= 3 for n in calls), f"no second try over several layers' rows: {calls}"
