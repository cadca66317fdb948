"""The audited model: a small MLP classifier with a canary head, and its per-sample loss.

``AuditModel`` splits its input ``[features | canary input]``: the features go through the MLP
(Linear → tanh → Linear), the canary input through the canary head ``W`` (a Linear without
bias, initialised to 0, :mod:`private_engine.audit.canaries`). The per-sample loss is the
cross-entropy for an example and ``weight_i·⟨c_i, W v_i⟩`` for a canary row, selected row by row,
so every parameter of the model goes through the engine's clipping as usual.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AuditModel", "per_sample_loss"]


class AuditModel(nn.Module):
    """MLP ``features → hidden → classes`` and canary head ``W ∈ R^{K×D_c}``."""

    def __init__(self, features: int, classes: int, head_out: int, head_in: int,
                 hidden: int = 32):
        super().__init__()
        self.features = features
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, classes)
        self.canary_head = nn.Linear(head_in, head_out, bias=False)
        nn.init.zeros_(self.canary_head.weight)

    def forward(self, x: torch.Tensor):
        logits = self.fc2(torch.tanh(self.fc1(x[:, :self.features])))
        return logits, self.canary_head(x[:, self.features:])


def per_sample_loss(model: AuditModel, inputs: torch.Tensor, c: torch.Tensor,
                    weight: torch.Tensor, is_canary: torch.Tensor,
                    labels: torch.Tensor) -> torch.Tensor:
    """One loss per row (reduction "none"): cross-entropy for examples, ``weight·⟨c, W v⟩`` for
    canaries (gradient ``weight·c vᵀ`` on the head, 0 elsewhere)."""
    logits, head = model(inputs)
    ce = F.cross_entropy(logits, labels, reduction="none")
    canary = weight * (head * c).sum(1)
    return torch.where(is_canary, canary, ce)
