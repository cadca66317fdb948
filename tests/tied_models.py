"""Small models with tied weights, shared by the tied-weight tests (exactness against the
float64 reference, and crafted samples)."""
from __future__ import annotations

import torch
from torch import nn


class SharedLinear(nn.Module):
    """One square weight applied by two Linears, the second with a bias of its own:
    ``y = W·tanh(W·x) + b``. The per-sample gradient of ``W`` is the sum of its two uses; its norm
    needs their cross term."""

    def __init__(self, d: int = 5):
        super().__init__()
        self.first = nn.Linear(d, d, bias=False)
        self.second = nn.Linear(d, d)
        self.second.weight = self.first.weight

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))
