"""DP-Newton: differentially private Newton's method for one-vs-rest logistic regression on
features (Algorithm 1 and Theorem 2.1 of Mehta, Krichene, Thakurta, Kurakin & Cutkosky,
"Differentially Private Image Classification from Features").

Objective per class j (sigmoid cross-entropy, ``ℓ(z, y) = −y log s(z) − (1−y) log(1−s(z))``)::

    F_j(θ_j) = (1/n) Σ_i ℓ(θ_jᵀ x̃_i, y_ij) + (λ/2)‖θ_j‖²

on clipped features ``x̃_i = x_i·min(1, C/‖x_i‖)``. Each of T iterations releases, per class,

    g̃_j = (1/n) Σ_i ℓ'(θ_jᵀx̃_i, y_ij) x̃_i + N(0, (σ C √m / n)²) I_d                 (line 7)
    H̃_j = (1/n) Σ_i ℓ''(θ_jᵀx̃_i, y_ij) x̃_i x̃_iᵀ + N(0, (σ β_H C² √m / n)²)          (line 8)

and updates ``θ_j ← θ_j − η (H̃_j⁺ + λI)⁻¹ (g̃_j + λθ_j)`` (line 9), where ``H̃_j⁺`` is the PSD
projection of the (symmetric) noisy Hessian. ``|ℓ'| ≤ 1`` and ``|ℓ''| ≤ β_H = 1/4`` for the
sigmoid loss, so the per-class sensitivities of the sums are C and β_H C² (eqs. 4–5); with the
√m noise scaling every one of the 2mT releases is ``1/(2mσ²)``-zCDP, and the fit is
``T/σ²``-zCDP (Theorem 2.1). The ridge terms λθ_j and λI do not depend on the data and cost
nothing; they make ε = ∞ converge to the L2-regularised logistic-regression optimum.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ._linalg import psd_floor, solve
from ._noise import NoiseSource
from ._row_clipping import check_clip_norm, clip_rows
from .base import DPHeadBase

__all__ = ["DPNewton"]


class DPNewton(DPHeadBase):
    """DP-Newton for one-vs-rest logistic regression, Mehta et al. Algorithm 1 — ``T/σ²``-zCDP
    (Thm 2.1).

    Args:
        epsilon, delta, noise_multiplier, accounting, random_state, classes, normalize: see
            :class:`~private_engine.heads.base.DPHeadBase`.
        steps: T, the number of Newton iterations (full batch).
        lr: η, the Newton step size (1 = undamped Newton).
        reg: λ, ridge in the objective (and hence added to the Hessian); ``"auto"`` uses
            ``reg_scale·sqrt(2d)·s_H + reg_min`` with ``s_H = σβ_H C²√m/n`` the std of the
            Hessian noise (≈ its spectral norm), so that noise cannot dominate the inverse.
        reg_scale, reg_min: constants of ``reg="auto"``.
        clip_norm: C, the feature clipping norm.
        beta_h: β_H, the bound on ℓ'' (1/4 for the sigmoid cross-entropy).
        eig_floor: eigenvalue floor of the noisy Hessian before ``+λI`` (None: no projection).
        class_chunk_size: classes whose Hessians are formed at once (memory ``chunk·d²``).

    Fitted attributes: ``coef_`` (m, d), ``reg_``, ``n_iter_``, and the base privacy attributes.
    """

    _has_proba = True

    def __init__(self, *, epsilon: Optional[float] = None, delta: Optional[float] = None,
                 noise_multiplier: Optional[float] = None, steps: int = 1, lr: float = 1.0,
                 reg: Any = "auto", reg_scale: float = 4.0, reg_min: float = 1e-4,
                 clip_norm: float = 1.0, beta_h: float = 0.25, eig_floor: Optional[float] = 0.0,
                 class_chunk_size: int = 64, normalize: bool = False, accounting: str = "rdp",
                 random_state: Any = None, classes: Any = None,
                 dtype: torch.dtype = torch.float64):
        super().__init__(epsilon=epsilon, delta=delta, noise_multiplier=noise_multiplier,
                         accounting=accounting, random_state=random_state, classes=classes,
                         normalize=normalize, dtype=dtype)
        self.steps = steps
        self.lr = lr
        self.reg = reg
        self.reg_scale = reg_scale
        self.reg_min = reg_min
        self.clip_norm = clip_norm
        self.beta_h = beta_h
        self.eig_floor = eig_floor
        self.class_chunk_size = class_chunk_size

    def _rho_sigma2(self) -> float:
        return float(self.steps)

    def _fit(self, X: torch.Tensor, Y: torch.Tensor, sigma: float, noise: NoiseSource) -> None:
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"steps must be an integer ≥ 1, got {self.steps!r}.")
        if not (self.beta_h > 0):
            raise ValueError(f"beta_h must be > 0, got {self.beta_h!r}.")
        private = sigma > 0
        C = check_clip_norm("clip_norm", self.clip_norm, X.shape[0], X.dtype)
        Xc = clip_rows(X, C) if private else X
        d, m = Xc.shape[1], Y.shape[1]
        n = max(Xc.shape[0], 1)  # the records that contribute (public); 1 if none does
        sqrt_m = math.sqrt(m)
        s_H = sigma * self.beta_h * C * C * sqrt_m / n
        if self.reg == "auto":
            lam = self.reg_scale * math.sqrt(2 * d) * s_H + self.reg_min
        else:
            lam = float(self.reg)
            if lam < 0:
                raise ValueError(f"reg must be ≥ 0 or 'auto', got {self.reg!r}.")
        if lam == 0:
            raise ValueError("reg=0 leaves the Newton system singular on separable data; "
                             "use reg > 0.")
        self.reg_ = lam
        theta = torch.zeros(m, d, dtype=X.dtype, device=X.device)
        eye = torch.eye(d, dtype=X.dtype, device=X.device)
        chunk = max(1, int(self.class_chunk_size))
        for t in range(self.steps):
            Z = Xc @ theta.T  # (n, m)
            P = torch.sigmoid(Z)
            # gradient of the sum, released for all classes at once (m mechanisms, sensitivity C
            # each)
            g = (P - Y).T @ Xc  # (m, d)
            g = noise.release(f"gradient[t={t}]", g, C, sigma * sqrt_m, count=m) / n + lam * theta
            W = P * (1 - P)  # ℓ'' (n, m)
            noise.ledger.add(f"Hessian[t={t}]", self.beta_h * C * C,
                             sigma * sqrt_m * self.beta_h * C * C, count=m, shape=(m, d, d))
            step = torch.empty_like(theta)
            for start in range(0, m, chunk):
                stop = min(m, start + chunk)
                H = torch.einsum("nc,ni,nj->cij", W[:, start:stop], Xc, Xc)
                H = noise.release(f"Hessian[t={t}]", H, self.beta_h * C * C, sigma * sqrt_m,
                                  symmetric=True, record=False) / n
                rhs = g[start:stop]
                if private and self.eig_floor is not None:
                    evals, evecs = psd_floor(H, float(self.eig_floor))
                    proj = torch.einsum("cji,cj->ci", evecs, rhs)
                    step[start:stop] = torch.einsum("cij,cj->ci", evecs, proj / (evals + lam))
                else:
                    step[start:stop] = solve(H + lam * eye, rhs.unsqueeze(-1)).squeeze(-1)
            theta = theta - self.lr * step
        self.coef_ = theta
        self.n_iter_ = self.steps
        self.clip_ = C if private else None

    def _device(self) -> torch.device:
        return self.coef_.device

    def _decision(self, X: torch.Tensor) -> torch.Tensor:
        Xc = clip_rows(X, self.clip_) if self.clip_ is not None else X
        return Xc @ self.coef_.T

    def predict_proba(self, X):
        """One-vs-rest probabilities ``s(θ_jᵀx)`` normalised to sum to 1 over classes."""
        Xt, is_torch, dev = self._prepare_predict(X)
        P = torch.sigmoid(self._decision(Xt))
        return self._out(P / P.sum(dim=1, keepdim=True), is_torch, dev)
