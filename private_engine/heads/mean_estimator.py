"""DP class-mean classifier (Algorithm 1 of Zhu & Zhang, "Mean Estimation Strikes Back! An
Efficient Solution to Private Classification"), calibrated with the analytic Gaussian
mechanism (Balle & Wang 2018).

Training: features are mapped to the unit sphere, ``φ(x) = x/‖x‖`` (Zhu & Zhang require
``‖φ(x)‖ = 1``), and the per-class sums and counts are released with Gaussian noise::

    S̃_j = Σ_i 1[y_i = j] φ(x_i) + N(0, s² I_d),      ñ_j = Σ_i 1[y_i = j] + N(0, s²)

Class centres are ``q_j = S̃_j / max(ñ_j, min_count)``; inference is the nearest centre in cosine
similarity, ``argmax_j cos(φ(x), q_j)``.

φ is :func:`~private_engine.heads._row_clipping.normalize_rows`: ``u·(1 − m)/‖u‖`` with
``u = x/max_j|x_j|`` and a rounding margin m ≈ (d + 16)·eps, so ``‖φ(x)‖ ≤ 1`` holds for the
floating-point result and every finite record — also one whose squared entries underflow
(subnormal features, where ``x/sqrt(Σx²)`` can have norm up to √(d/2)) or overflow (features near
the largest float, where it would be 0) — and the sensitivity below holds for what is computed.

Sensitivity of the released pair (derived here; add/remove-one adjacency)
------------------------------------------------------------------------
All sums and counts form one vector ``R(D) = (S_1, …, S_K, n_1, …, n_K) ∈ R^{K(d+1)}`` and are
released by **one** Gaussian mechanism with the same s on every coordinate. Adding or removing
one example (x, y = j) changes only block j, by ``(φ(x), 1)``, so::

    Δ₂ = ‖R(D) − R(D')‖₂ = sqrt(‖φ(x)‖² + 1²) = √2            (tight: ‖φ(x)‖ = 1)

(Under replace-one adjacency it would be 2: ``(−φ(x), −1)`` in block j and ``(φ(x'), 1)`` in
block j' gives ``sqrt(2 + 2)``; with j = j', ``‖φ(x) − φ(x')‖ ≤ 2``.) The mechanism is then
(ε, δ)-DP iff (Balle & Wang 2018, Thm 8)::

    Φ( Δ/(2s) − εs/Δ ) − e^ε Φ( −Δ/(2s) − εs/Δ ) ≤ δ,    Δ = √2.

Zhu & Zhang's Theorem 2.1 states ``Φ(1/(2σ) − σε/2) − e^ε Φ(−1/(2σ) − σε/2) ≤ δ/2``: its first
term is the formula with Δ = 1, its second term the formula with Δ = 2, and δ/2 suggests a split
of δ between the two releases — these are mutually inconsistent, and none equals the
joint-release sensitivity √2. We use the derivation above (Δ = √2, full δ, exact analytic
calibration). The noise multiplier reported is ``σ = s/Δ`` (so ρ = 1/(2σ²) like every other
head) and ``noise_std_ = s``.

Inference is by cosine, which ignores the scale of q_j, so the counts only matter through their
sign and for ``class_means_``; ``release_counts=False`` spends the whole budget on the sums
(Δ = 1, i.e. s smaller by √2) and keeps only the centre directions.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..accounting.analytic_gaussian import analytic_gaussian_sigma, gaussian_epsilon
from ..accounting.zcdp import ZCDPLedger
from ._noise import NoiseSource
from ._row_clipping import normalize_rows
from .base import DPHeadBase

__all__ = ["DPMeanEstimator"]


class DPMeanEstimator(DPHeadBase):
    """Nearest DP class centre in cosine similarity (Zhu & Zhang, Algorithm 1).

    Args:
        epsilon, delta: calibrate the noise std ``s`` exactly with the analytic Gaussian mechanism
            (Balle & Wang 2018, Algorithm 1) for L2 sensitivity Δ = √2 (Δ = 1 without counts).
        noise_multiplier: σ directly (``s = σΔ``).
        release_counts: release noisy per-class counts (as Zhu & Zhang do) — needed for
            ``class_means_``, not for classification (cosine ignores the centre norms).
        min_count: floor applied to the noisy counts before dividing (post-processing; keeps the
            centres pointing the same way as the noisy sums).
        accounting: ``"gdp"`` (default: the analytic Gaussian, exact) or ``"rdp"``/``"classical"``
            (looser, for comparison with the other heads).
        random_state, classes: see :class:`~private_engine.heads.base.DPHeadBase`.

    Fitted attributes: ``centers_`` (m, d) the released centre directions ``S̃_j/‖S̃_j‖``,
    ``class_sums_``, ``class_counts_`` (noisy; None without counts), ``class_means_`` (None without
    counts), ``sensitivity_`` (Δ), ``noise_std_`` (s), and the base privacy attributes.
    """

    def __init__(self, *, epsilon: Optional[float] = None, delta: Optional[float] = None,
                 noise_multiplier: Optional[float] = None, release_counts: bool = True,
                 min_count: float = 1.0, accounting: str = "gdp", random_state: Any = None,
                 classes: Any = None, dtype: torch.dtype = torch.float64):
        super().__init__(epsilon=epsilon, delta=delta, noise_multiplier=noise_multiplier,
                         accounting=accounting, random_state=random_state, classes=classes,
                         normalize=True, dtype=dtype)
        self.release_counts = release_counts
        self.min_count = min_count

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the released vector: √2 with counts, 1 without (module docstring)."""
        return math.sqrt(2.0) if self.release_counts else 1.0

    def _rho_sigma2(self) -> float:
        return 0.5

    def _resolve_noise_multiplier(self) -> float:
        self._check_privacy_args()
        if (self.noise_multiplier is not None or self.accounting != "gdp"
                or math.isinf(float(self.epsilon))):
            return super()._resolve_noise_multiplier()
        s = analytic_gaussian_sigma(float(self.epsilon), float(self.delta), self.sensitivity)
        return s / self.sensitivity

    def _features(self, X: torch.Tensor) -> torch.Tensor:
        return normalize_rows(X)

    def _fit(self, X: torch.Tensor, Y: torch.Tensor, sigma: float, noise: NoiseSource) -> None:
        delta_2 = self.sensitivity
        sums = X.T @ Y  # (d, m)
        if self.release_counts:
            counts = Y.sum(dim=0)  # (m,)
            flat = torch.cat([sums.T.reshape(-1), counts])
            flat = noise.release("class sums and counts", flat, delta_2, sigma)
            m, d = Y.shape[1], X.shape[1]
            sums_t, counts = flat[:m * d].reshape(m, d), flat[m * d:]
            if sigma > 0:
                denom = torch.clamp(counts, min=float(self.min_count))
            else:
                denom = torch.where(counts > 0, counts, torch.ones_like(counts))
            self.class_counts_ = counts
            self.class_means_ = sums_t / denom[:, None]
        else:
            sums_t = noise.release("class sums", sums.T.contiguous(), delta_2, sigma)
            self.class_counts_ = None
            self.class_means_ = None
        self.class_sums_ = sums_t
        self.centers_ = normalize_rows(sums_t)
        self.sensitivity_ = delta_2
        self.noise_std_ = sigma * delta_2

    def _finalize_privacy(self, sigma: float, ledger: ZCDPLedger) -> None:
        super()._finalize_privacy(sigma, ledger)
        if sigma > 0 and self.delta_ is not None and self.accounting == "gdp":
            # one Gaussian mechanism: its exact ε (equal to rho_to_epsilon(ρ, δ, "gdp"))
            self.epsilon_ = gaussian_epsilon(self.delta_, self.noise_std_, self.sensitivity_)

    def _device(self) -> torch.device:
        return self.centers_.device

    def _decision(self, X: torch.Tensor) -> torch.Tensor:
        return X @ self.centers_.T  # X is unit-norm, centres are unit-norm: cosine similarities

    def cosine_similarities(self, X):
        """``h(x) = (cos(φ(x), q_1), …, cos(φ(x), q_m))`` — the prior of Zhu & Zhang,
        Algorithm 2."""
        return self.decision_function(X)
