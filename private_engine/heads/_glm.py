"""Per-example-clipped gradients of a linear classification head, without per-example tensors.

For logits ``z_i = W x_i + b`` (W: m×d, b: m) the per-example gradient of the loss is the outer
product ``r_i ⊗ [x_i; 1]`` with residual ``r_i = p_i − y_i``, where ``p_i = s(z_i)`` (sigmoid,
one-vs-rest; ``‖r_i‖ ≤ √m``) or ``softmax(z_i)`` (``‖r_i‖ ≤ √2``). Its Frobenius norm is
``‖r_i‖·‖[x_i; 1]‖``, so the clipped sum (Abadi et al. 2016, "Deep Learning with Differential
Privacy")::

    Σ_i clip_C(∇ℓ_i) = Σ_i c_i r_i ⊗ [x_i; 1],   c_i = min(1, C / (‖r_i‖·‖[x_i; 1]‖))

is one matrix product. It is computed for every finite record, whatever its magnitude: with
``t_i = max(max_j |x_ij|, 1)`` (just ``max_j |x_ij|`` without a bias) and ``v_i = [x_i; 1]/t_i``
(entries ≤ 1, ``‖v_i‖ ≥ 1``), ``c_i r_i ⊗ [x_i; 1] = a_i r_i ⊗ v_i`` with
``a_i = min(t_i, C'/(‖r_i‖·‖v_i‖))``, ``C' = C·(1 − rounding_margin)`` — no square of x is
formed, ``a_i‖r_i‖ ≤ C'`` is finite, and the computed clipped gradient has norm ≤ C. The
logits are ``s_i·(W u_i) + b`` with ``u_i = x_i/s_i`` (:func:`~._row_clipping.row_scales`),
clamped to ``±finfo.max/4``: a record near the largest float saturates the link instead of giving
``inf − inf = NaN``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._row_clipping import RowScales, rounding_margin, row_scales
from .base import DPHeadBase

LOSSES = ("sigmoid", "softmax")


def probabilities(Z: torch.Tensor, loss: str) -> torch.Tensor:
    """``s(Z)`` (one-vs-rest sigmoid) or ``softmax(Z)`` row-wise."""
    if loss == "sigmoid":
        return torch.sigmoid(Z)
    if loss == "softmax":
        return torch.softmax(Z, dim=1)
    raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}.")


def logits(X: torch.Tensor, W: torch.Tensor, b: Optional[torch.Tensor],
           rows: Optional[RowScales] = None) -> torch.Tensor:
    """``Z = X Wᵀ + b`` computed as ``s ⊙ (U Wᵀ) + b`` (``rows = (s, U)`` of
    :func:`~._row_clipping.row_scales`, computed if not given) and clamped to ``±finfo.max/4``.

    ``U Wᵀ`` is finite for finite W, and ``s_i·(Wu_i)`` overflows only to an infinity of the
    right sign, which the clamp turns into a saturated (finite) logit: sigmoid and softmax then
    give the limit probabilities, never NaN.
    """
    s, U = rows if rows is not None else row_scales(X)
    Z = s[:, None] * (U @ W.T)
    if b is not None:
        Z = Z + b
    top = torch.finfo(Z.dtype).max / 4
    return Z.clamp(-top, top)


class ClippedGradients(NamedTuple):
    """The clipped gradient sums of a linear head (:func:`clipped_gradient_sum`)."""

    #: ``Σ_i c_i r_i x_iᵀ``, shape (m, d)
    weight: torch.Tensor
    #: ``Σ_i c_i r_i``, shape (m,), or None for a head without intercept
    bias: Optional[torch.Tensor]
    #: the per-example gradient norms before clipping, ``‖r_i‖·‖[x_i; 1]‖``, shape (n,)
    norms: torch.Tensor


def clipped_gradient_sum(
        X: torch.Tensor, Y: torch.Tensor, W: torch.Tensor, b: Optional[torch.Tensor], loss: str,
        clip: Optional[float], rows: Optional[RowScales] = None,
) -> ClippedGradients:
    """``ClippedGradients(Σ c_i r_i x_iᵀ, Σ c_i r_i or None, per-example gradient norms)``
    (module docstring);
    ``clip=None`` disables clipping. ``rows = row_scales(X)`` may be passed to save recomputing
    it at every step. The norms are ``‖r_i‖·‖[x_i; 1]‖`` (``inf`` only where that exceeds the
    dtype's range); with clipping each clipped gradient has norm ≤ ``clip`` in floating point.
    """
    rows = rows if rows is not None else row_scales(X)
    s = rows.scales
    R = probabilities(logits(X, W, b, rows), loss) - Y
    r_norm = torch.linalg.vector_norm(R, dim=1)
    # v_i = [x_i; 1]/t_i: entries ≤ 1 and ‖v_i‖ ≥ 1 (for a nonzero row or with a bias)
    t = torch.clamp(s, min=1.0) if b is not None else s
    V = X / t[:, None]
    v_sq = (V * V).sum(dim=1)
    if b is not None:
        v_bias = 1.0 / t
        v_sq = v_sq + v_bias * v_bias
    v_norm = torch.sqrt(v_sq)
    norms = r_norm * t * v_norm
    if clip is None:
        gW = R.T @ X
        return ClippedGradients(gW, (R.sum(dim=0) if b is not None else None), norms)
    bound = float(clip) * (1.0 - rounding_margin(X.shape[1] + 1 + R.shape[1], X.dtype))
    # a_i = min(t_i, C'/(‖r_i‖·‖v_i‖)); a zero residual or a zero row gives C'/0 = inf, i.e. t_i
    a = torch.minimum(t, bound / (r_norm * v_norm))
    Ra = R * a[:, None]  # ‖a_i r_i‖ ≤ C'/‖v_i‖: finite
    gW = Ra.T @ V
    gb = (Ra * v_bias[:, None]).sum(dim=0) if b is not None else None
    return ClippedGradients(gW, gb, norms)


class GLMHead(DPHeadBase):
    """Shared prediction of the linear heads trained by (clipped) gradient steps (DP-FC, DP-Adam):
    scores ``Xθᵀ + b`` and probabilities from the training loss's link."""

    def _device(self) -> torch.device:
        return self.coef_.device

    def _decision(self, X: torch.Tensor) -> torch.Tensor:
        return logits(X, self.coef_, self.intercept_)

    def predict_proba(self, X):
        """Class probabilities: softmax, or one-vs-rest sigmoids normalised to sum to 1."""
        Xt, is_torch, dev = self._prepare_predict(X)
        P = probabilities(self._decision(Xt), self.loss)
        return self._out(P / P.sum(dim=1, keepdim=True), is_torch, dev)
