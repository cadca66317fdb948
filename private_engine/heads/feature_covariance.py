"""DP-FC: DP gradient descent preconditioned by a noisy feature covariance (Algorithm 3 and
Theorem 2.3 of Mehta, Krichene, Thakurta, Kurakin & Cutkosky, "Differentially Private Image
Classification from Features").

1. Clip features for the covariance, ``x̃_i = x_i·min(1, C_G/‖x_i‖)``, and release once
   ``G̃ = (1/n) Σ_i x̃_i x̃_iᵀ + N(0, (σ C_G²/n)²) + λI``                               (lines 1–3)
   (``‖Δ Σ x̃x̃ᵀ‖_F ≤ C_G²``: ``1/(2σ²)``-zCDP). The noise is symmetric (isometric upper-triangle
   noise, see :mod:`~private_engine.heads._noise`) and the noisy matrix is projected on the PSD cone
   before adding λI, so ``G̃ ⪰ λI``.
2. For t = 1..T (full batch):
   ``g̃_t = (1/n)(Σ_i clip_{C_g}(∇ℓ(θ_t; x_i, y_i)) + N(0, (σ C_g)²))``                  (lines 6–7)
   (each ``1/(2σ²)``-zCDP) and ``θ_{t+1} = θ_t − η g̃_t G̃⁻¹``                           (line 8).

Total: ``(T+1)/(2σ²)``-zCDP (Theorem 2.3). The head is W x + b with the loss of Mehta et al.
(sigmoid cross-entropy, one-vs-rest, bias initialised at −10 following their App. D.7) or
softmax cross-entropy. The bias gradient is part of the clipped
per-example gradient; its preconditioner is the second moment of the constant feature, 1
(block-diagonal approximation of the covariance of ``[x; 1]``).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ._glm import LOSSES, GLMHead, clipped_gradient_sum
from ._linalg import psd_floor, sym_eigh
from ._noise import NoiseSource
from ._row_clipping import check_clip_norm, clip_rows, row_scales

__all__ = ["DPFeatureCovariance"]


class DPFeatureCovariance(GLMHead):
    """DP-FC, Mehta et al. Algorithm 3 — ``(T+1)/(2σ²)``-zCDP (Theorem 2.3).

    Args:
        epsilon, delta, noise_multiplier, accounting, random_state, classes, normalize: see
            :class:`~private_engine.heads.base.DPHeadBase`.
        steps: T, full-batch iterations.
        lr: η.
        reg: λ added to the noisy covariance; ``"auto"`` uses
            ``reg_scale·sqrt(2d)·σC_G²/n + reg_min`` (the covariance noise's spectral scale).
        reg_scale, reg_min: constants of ``reg="auto"``.
        clip_norm_cov: C_G, feature clipping norm for the covariance.
        clip_norm_grad: C_g, per-example gradient clipping norm.
        loss: "sigmoid" (one-vs-rest, as in Mehta et al.) or "softmax".
        fit_intercept: learn a per-class bias.
        intercept_init: initial bias (−10 for "sigmoid" as in Mehta et al. App. D; 0 is used for
            softmax).
        eig_floor: eigenvalue floor of the noisy covariance before ``+λI`` (None: no projection).

    Fitted attributes: ``coef_`` (m, d), ``intercept_`` (m,) or None, ``reg_``, ``n_iter_``,
    ``noisy_covariance_`` (the released G̃ before the PSD floor and λI), and the base privacy
    attributes.
    """

    _has_proba = True

    def __init__(self, *, epsilon: Optional[float] = None, delta: Optional[float] = None,
                 noise_multiplier: Optional[float] = None, steps: int = 10, lr: float = 4.0,
                 reg: Any = "auto", reg_scale: float = 2.0, reg_min: float = 1e-3,
                 clip_norm_cov: float = 1.0, clip_norm_grad: float = 1.0, loss: str = "sigmoid",
                 fit_intercept: bool = True, intercept_init: float = -10.0,
                 eig_floor: Optional[float] = 0.0, normalize: bool = False,
                 accounting: str = "rdp", random_state: Any = None, classes: Any = None,
                 dtype: torch.dtype = torch.float64):
        super().__init__(epsilon=epsilon, delta=delta, noise_multiplier=noise_multiplier,
                         accounting=accounting, random_state=random_state, classes=classes,
                         normalize=normalize, dtype=dtype)
        self.steps = steps
        self.lr = lr
        self.reg = reg
        self.reg_scale = reg_scale
        self.reg_min = reg_min
        self.clip_norm_cov = clip_norm_cov
        self.clip_norm_grad = clip_norm_grad
        self.loss = loss
        self.fit_intercept = fit_intercept
        self.intercept_init = intercept_init
        self.eig_floor = eig_floor

    def _rho_sigma2(self) -> float:
        return (self.steps + 1) / 2.0

    def _fit(self, X: torch.Tensor, Y: torch.Tensor, sigma: float, noise: NoiseSource) -> None:
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"steps must be an integer ≥ 1, got {self.steps!r}.")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}.")
        d = X.shape[1]
        n = max(X.shape[0], 1)  # the records that contribute (public); 1 if none does
        CG = check_clip_norm("clip_norm_cov", self.clip_norm_cov, n, X.dtype)
        Cg = check_clip_norm("clip_norm_grad", self.clip_norm_grad, n, X.dtype)
        private = sigma > 0
        m = Y.shape[1]
        Xg = clip_rows(X, CG) if private else X
        G = noise.release("feature covariance", Xg.T @ Xg, CG * CG, sigma, symmetric=True) / n
        if self.reg == "auto":
            lam = self.reg_scale * math.sqrt(2 * d) * sigma * CG * CG / n + self.reg_min
        else:
            lam = float(self.reg)
            if lam < 0:
                raise ValueError(f"reg must be ≥ 0 or 'auto', got {self.reg!r}.")
        self.reg_ = lam
        if private and self.eig_floor is not None:
            evals, evecs = psd_floor(G, float(self.eig_floor))
        else:
            evals, evecs = sym_eigh(G)
        if float((evals + lam).min()) <= 0:
            raise ValueError("the preconditioner G + λI is not positive definite; increase reg.")
        G_inv = (evecs / (evals + lam)) @ evecs.T

        W = torch.zeros(m, d, dtype=X.dtype, device=X.device)
        b0 = (self.intercept_init if self.loss == "sigmoid" else 0.0)
        b = (torch.full((m,), float(b0), dtype=X.dtype, device=X.device)
             if self.fit_intercept else None)
        clip = Cg if private else None
        rows = row_scales(X)  # per-record scaling, shared by every step
        for t in range(self.steps):
            gW, gb, _ = clipped_gradient_sum(X, Y, W, b, self.loss, clip, rows)
            if b is not None:
                flat = torch.cat([gW.reshape(-1), gb])
                flat = noise.release(f"gradient[t={t}]", flat, Cg, sigma) / n
                gW, gb = flat[:-m].reshape(m, d), flat[-m:]
                b = b - self.lr * gb
            else:
                gW = noise.release(f"gradient[t={t}]", gW, Cg, sigma) / n
            W = W - self.lr * gW @ G_inv
        self.coef_ = W
        self.intercept_ = b
        self.noisy_covariance_ = G  # released (1/n)Σx̃x̃ᵀ + noise, before the PSD floor and λI
        self.n_iter_ = self.steps
