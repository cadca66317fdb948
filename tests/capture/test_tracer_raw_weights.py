"""Raw weights used by a matmul: ``x @ W`` and ``F.linear(x, W, b)`` with a module's own
``nn.Parameter`` (Opacus' custom-layer tests), clipped by the parameter-entry tracer as a
per-sample weight ``W_b[i]`` whose gradient is ``∂L_i/∂W = Σ_t x_{i,t}ᵀ g_{i,t}``; exact against the
float64 one-sample-at-a-time reference (tests/reference.py) in every mode."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from engine_checks import MODES, check_against_reference

pytestmark = pytest.mark.usefixtures("one_thread")


class RawLinear(nn.Module):
    """``F.linear`` on its own weight and bias (no layer rule: the tracer follows them)."""

    def __init__(self, i: int, o: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i) * 0.5)
        self.bias = nn.Parameter(torch.randn(o) * 0.5)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RawModel(nn.Module):
    """A raw Linear, a ruled Linear, and ``x @ extra`` with a raw (d, p) parameter."""

    def __init__(self):
        super().__init__()
        self.fc1 = RawLinear(4, 8)
        self.fc2 = nn.Linear(8, 4)
        self.extra = nn.Parameter(torch.randn(4, 3) * 0.5)

    def forward(self, x):
        return torch.tanh(self.fc2(torch.tanh(self.fc1(x)))) @ self.extra


@pytest.mark.parametrize("shape", [(5, 4), (5, 3, 4)], ids=["vectors", "sequences"])
@pytest.mark.parametrize("mode", MODES)
def test_raw_matmul_weights_are_exact(mode, shape):
    torch.manual_seed(0)
    model = RawModel().double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    t = torch.randn(*shape[:-1], 3, generator=g, dtype=torch.float64)
    for clip in ("abadi", "automatic"):
        check_against_reference(model, [x, t], mode=mode, clip=clip)


def test_raw_weight_with_a_batch_free_input_is_refused_by_name():
    """``const @ W`` with a batch-free ``const`` is a chain op; ``W`` reaching the batch later by
    an op the tracer does not follow is refused, naming it."""

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return torch.einsum("bi,ij->bj", x, self.w)

    model = Odd()
    engine = pe.PrivacyEngine(model, batch_size=3, sample_size=30, max_grad_norm=1.0,
                              noise_multiplier=0.0)
    with pytest.raises(Exception, match=r"\bw\b"):
        engine.clipped_grad_sum(model(torch.randn(3, 4)).sum(1))
