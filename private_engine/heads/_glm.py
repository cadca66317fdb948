"""Per-example-clipped gradients of a linear classification head, without per-example tensors.

For logits ``z_i = W x_i + b`` (W: m×d, b: m) the per-example gradient of the loss is the outer
product ``r_i ⊗ [x_i; 1]`` with residual ``r_i = p_i − y_i``, where ``p_i = s(z_i)`` (sigmoid,
one-vs-rest; ``‖r_i‖ ≤ √m``) or ``softmax(z_i)`` (``‖r_i‖ ≤ √2``). Its Frobenius norm is
``‖r_i‖·sqrt(‖x_i‖² + [bias])``, so the clipped sum (Abadi et al. 2016)::

    Σ_i clip_C(∇ℓ_i) = Σ_i c_i r_i ⊗ [x_i; 1],   c_i = min(1, C / (‖r_i‖·sqrt(‖x_i‖² + [bias])))

is ``(c ⊙ R)ᵀ X`` (and ``Σ_i c_i r_i`` for the bias): one matrix product.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .base import DPHeadBase

LOSSES = ("sigmoid", "softmax")


def probabilities(Z: torch.Tensor, loss: str) -> torch.Tensor:
    """``s(Z)`` (one-vs-rest sigmoid) or ``softmax(Z)`` row-wise."""
    if loss == "sigmoid":
        return torch.sigmoid(Z)
    if loss == "softmax":
        return torch.softmax(Z, dim=1)
    raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}.")


def clipped_gradient_sum(
        X: torch.Tensor, Y: torch.Tensor, W: torch.Tensor, b: Optional[torch.Tensor], loss: str,
        clip: Optional[float]) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(Σ c_i r_i x_iᵀ, Σ c_i r_i or None, per-example norms)``; ``clip=None`` disables
    clipping."""
    Z = X @ W.T
    if b is not None:
        Z = Z + b
    R = probabilities(Z, loss) - Y
    sq = (X * X).sum(dim=1) + (1.0 if b is not None else 0.0)
    norms = torch.linalg.vector_norm(R, dim=1) * torch.sqrt(sq)
    if clip is not None:
        c = torch.clamp(clip / torch.clamp(norms, min=1e-300), max=1.0)
        R = R * c[:, None]
    gW = R.T @ X
    gb = R.sum(dim=0) if b is not None else None
    return gW, gb, norms


class GLMHead(DPHeadBase):
    """Shared prediction of the linear heads trained by (clipped) gradient steps (DP-FC, DP-Adam):
    scores ``Xθᵀ + b`` and probabilities from the training loss's link."""

    def _device(self) -> torch.device:
        return self.coef_.device

    def _decision(self, X: torch.Tensor) -> torch.Tensor:
        Z = X @ self.coef_.T
        return Z + self.intercept_ if self.intercept_ is not None else Z

    def predict_proba(self, X):
        """Class probabilities: softmax, or one-vs-rest sigmoids normalised to sum to 1."""
        Xt, is_torch, dev = self._prepare_predict(X)
        P = probabilities(self._decision(Xt), self.loss)
        return self._out(P / P.sum(dim=1, keepdim=True), is_torch, dev)
