"""The audited model: a small MLP classifier with canary heads, and its per-sample loss.

``AuditModel`` splits its input ``[features | canary input]``: the features go through the MLP
(Linear → tanh → Linear), the canary input through the ``linear`` path's canary head ``W`` (a
Linear without bias, initialised to 0, :mod:`private_engine.audit.canaries`). Each other audited
path has a head of its own kind (:mod:`private_engine.audit.paths`) fed by an input of its own.
The per-sample loss is the cross-entropy for an example and ``w_i·Σ_heads ⟨c_i, h(x_i)⟩`` for a
canary row (one head is non-zero for it), selected row by row, so every parameter of the model
goes through the engine's clipping as usual.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AuditModel", "per_sample_loss", "head_inputs"]


class AuditModel(nn.Module):
    """MLP ``features → hidden → classes``, the ``linear`` canary head ``W ∈ R^{K×D_c}`` (none
    when ``head_out`` or ``head_in`` is 0) and the other paths' ``heads`` (name → module)."""

    def __init__(self, features: int, classes: int, head_out: int = 0, head_in: int = 0,
                 hidden: int = 32, heads: Optional[Dict[str, nn.Module]] = None):
        super().__init__()
        self.features = features
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, classes)
        self.canary_head = None
        if head_out and head_in:
            self.canary_head = nn.Linear(head_in, head_out, bias=False)
            nn.init.zeros_(self.canary_head.weight)
        self.heads = nn.ModuleDict(heads or {})

    def forward(self, x: torch.Tensor, *inputs: torch.Tensor):
        """``(logits, linear head output or None, [output of each other head])``; ``inputs``: one
        per head of ``heads``, in order."""
        logits = self.fc2(torch.tanh(self.fc1(x[:, :self.features])))
        head = None if self.canary_head is None else self.canary_head(x[:, self.features:])
        return logits, head, [h(z) for h, z in zip(self.heads.values(), inputs)]


def head_inputs(slot: torch.Tensor, paths: Sequence):
    """Each path's head inputs and output vectors ``c`` for the rows of a batch: the canary's
    own for its rows (``slot`` counts the paths' canaries in order), the blank input and 0
    elsewhere."""
    inputs, coefs, start = [], [], 0
    for p in paths:
        local = slot - start
        idx = torch.where((local >= 0) & (local < p.m), local, torch.full_like(local, p.m))
        inputs.append(p.inputs[idx])
        coefs.append(p.coefs[idx])
        start += p.m
    return inputs, coefs


def per_sample_loss(model: AuditModel, inputs: torch.Tensor, c: torch.Tensor,
                    weight: torch.Tensor, is_canary: torch.Tensor, labels: torch.Tensor,
                    slot: Optional[torch.Tensor] = None, paths: Sequence = ()) -> torch.Tensor:
    """One loss per row (reduction "none"): cross-entropy for examples, ``weight·Σ⟨c, h(x)⟩``
    over the canary heads for canaries (gradient ``weight·∇_θ⟨c, h_θ(x)⟩`` on the canary's head,
    0 elsewhere)."""
    extra, coefs = head_inputs(slot, paths) if paths else ([], [])
    logits, head, outs = model(inputs, *extra)
    ce = F.cross_entropy(logits, labels, reduction="none")
    canary = torch.zeros_like(weight)
    if head is not None:
        canary = canary + (head * c).sum(1)
    for out, coef in zip(outs, coefs):
        canary = canary + (out * coef).reshape(out.shape[0], -1).sum(1)
    return torch.where(is_canary, weight * canary, ce)
