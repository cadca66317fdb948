"""DP-Adam on features: the first-order baseline of Mehta, Krichene, Thakurta, Kurakin &
Cutkosky, "Differentially Private Image Classification from Features" (Algorithm 4 with Adam,
§2.1).

Full batch, T steps. Each step releases the clipped, noised mean gradient (eq. 3)::

    g̃_t = (1/n) ( Σ_i clip_C(∇ℓ(θ_t; x_i, y_i)) + N(0, (σC)² I) )

(``‖Δ Σ clip(∇ℓ)‖ ≤ C`` under add/remove ⇒ ``1/(2σ²)``-zCDP per step) and feeds ``g̃_t + λθ_t``
(data-independent L2 term) to Adam (Kingma & Ba 2015, bias-corrected moments). Without
subsampling the T releases compose to ``T/(2σ²)``-zCDP — the same zCDP/RDP framework and
conversion as the second-order heads, so the methods are compared at equal (ε, δ).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from ._glm import LOSSES, GLMHead, clipped_gradient_sum
from ._noise import NoiseSource
from ._row_clipping import check_clip_norm, row_scales

__all__ = ["DPAdamHead"]


class DPAdamHead(GLMHead):
    """Full-batch DP-Adam on a linear head — ``T/(2σ²)``-zCDP.

    Args:
        epsilon, delta, noise_multiplier, accounting, random_state, classes, normalize: see
            :class:`~private_engine.heads.base.DPHeadBase`.
        steps: T, full-batch steps.
        lr: Adam learning rate.
        betas, adam_eps: Adam's (β₁, β₂) and ε.
        weight_decay: λ of the L2 term ``(λ/2)‖W‖²`` (added to the noisy gradient).
        clip_norm: C, per-example gradient clipping norm.
        loss: "sigmoid" (one-vs-rest, as in Mehta et al.) or "softmax".
        fit_intercept, intercept_init: per-class bias and its initial value (−10 for sigmoid as in
            Mehta et al. App. D.4; 0 for softmax).

    Fitted attributes: ``coef_`` (m, d), ``intercept_`` (m,) or None, ``n_iter_``, and the base
    privacy attributes.
    """

    _has_proba = True

    def __init__(self, *, epsilon: Optional[float] = None, delta: Optional[float] = None,
                 noise_multiplier: Optional[float] = None, steps: int = 100, lr: float = 0.1,
                 betas: Tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8,
                 weight_decay: float = 0.0, clip_norm: float = 1.0, loss: str = "sigmoid",
                 fit_intercept: bool = True, intercept_init: float = -10.0,
                 normalize: bool = False, accounting: str = "rdp", random_state: Any = None,
                 classes: Any = None, dtype: torch.dtype = torch.float64):
        super().__init__(epsilon=epsilon, delta=delta, noise_multiplier=noise_multiplier,
                         accounting=accounting, random_state=random_state, classes=classes,
                         normalize=normalize, dtype=dtype)
        self.steps = steps
        self.lr = lr
        self.betas = betas
        self.adam_eps = adam_eps
        self.weight_decay = weight_decay
        self.clip_norm = clip_norm
        self.loss = loss
        self.fit_intercept = fit_intercept
        self.intercept_init = intercept_init

    def _rho_sigma2(self) -> float:
        return self.steps / 2.0

    def _fit(self, X: torch.Tensor, Y: torch.Tensor, sigma: float, noise: NoiseSource) -> None:
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"steps must be an integer ≥ 1, got {self.steps!r}.")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}.")
        d = X.shape[1]
        n = max(X.shape[0], 1)  # the records that contribute (public); 1 if none does
        C = check_clip_norm("clip_norm", self.clip_norm, n, X.dtype)
        private = sigma > 0
        rows = row_scales(X)  # per-record scaling, shared by every step
        m = Y.shape[1]
        b0 = self.intercept_init if self.loss == "sigmoid" else 0.0
        params = [torch.zeros(m, d, dtype=X.dtype, device=X.device)]
        if self.fit_intercept:
            params.append(torch.full((m,), float(b0), dtype=X.dtype, device=X.device))
        m1 = [torch.zeros_like(p) for p in params]
        m2 = [torch.zeros_like(p) for p in params]
        beta1, beta2 = self.betas
        for t in range(1, self.steps + 1):
            W = params[0]
            b = params[1] if self.fit_intercept else None
            gW, gb, _ = clipped_gradient_sum(X, Y, W, b, self.loss, C if private else None,
                                             rows)
            flat = torch.cat([gW.reshape(-1)] + ([gb] if gb is not None else []))
            flat = noise.release(f"gradient[t={t - 1}]", flat, C, sigma) / n
            grads = [flat[:m * d].reshape(m, d)] + ([flat[m * d:]] if gb is not None else [])
            grads[0] = grads[0] + self.weight_decay * W
            for p, g, a, v in zip(params, grads, m1, m2):
                a.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                a_hat = a / (1 - beta1 ** t)
                v_hat = v / (1 - beta2 ** t)
                p.sub_(self.lr * a_hat / (torch.sqrt(v_hat) + self.adam_eps))
        self.coef_ = params[0]
        self.intercept_ = params[1] if self.fit_intercept else None
        self.n_iter_ = self.steps
