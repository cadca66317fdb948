"""DP-LS: differentially private least squares on features (Algorithm 2 and Theorem 2.2 of
Mehta, Krichene, Thakurta, Kurakin & Cutkosky, "Differentially Private Image Classification
from Features").

Loss (Mehta et al., §2.3; Hu et al. 2008), for binary targets ``y_ij ∈ {0, 1}``::

    L(θ) = ½ Σ_j [ Σ_i y_ij (x_iᵀθ_j − 1)² + α Σ_i (x_iᵀθ_j)² + λ‖θ_j‖² ]
         = ½ Σ_j [ θ_jᵀ A_j θ_j − 2 θ_jᵀ b_j + α θ_jᵀ G θ_j + λ θ_jᵀ θ_j ] + const

with sufficient statistics (eq. 6), on clipped features ``x̃_i = x_i·min(1, C/‖x_i‖)``::

    G = Σ_i x̃_i x̃_iᵀ,   A_j = Σ_{i: y_ij=1} x̃_i x̃_iᵀ,   b_j = Σ_{i: y_ij=1} x̃_i

and exact solution ``θ_j = (A_j + αG + λI)⁻¹ b_j``.

Algorithm 2 releases ``G̃ = G + N(σC²)`` once (shared by every class), ``Ã_j = A_j + N(σ√k C²)``
and ``b̃_j = b_j + N(σ√k C)``, then solves ``θ_j = (Ã_j + αG̃ + λI)⁻¹ b̃_j``.

Privacy (Theorem 2.2): with at most k positive classes per example, the sensitivities are
``‖ΔG‖_F ≤ C²``, ``‖Δ[A_1|…|A_m]‖_F ≤ √k C²``, ``‖Δ[b_1|…|b_m]‖₂ ≤ √k C``; each release is
``1/(2σ²)``-zCDP, so the fit is ``3/(2σ²)``-zCDP.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ._linalg import psd_floor, solve
from ._noise import NoiseSource
from ._records import finite_records
from ._row_clipping import check_clip_norm, clip_rows
from .base import DPHeadBase

__all__ = ["DPLeastSquares"]


class DPLeastSquares(DPHeadBase):
    """DP least squares (DP-LS), Mehta et al. Algorithm 2 — ``3/(2σ²)``-zCDP (Theorem 2.2).

    ``θ_j = (Ã_j + α·G̃ + λI)⁻¹ b̃_j`` with noisy statistics ``G̃`` (shared by all classes),
    ``Ã_j``, ``b̃_j`` (see the module docstring). Noisy matrices are symmetric by construction and
    ``Ã_j + αG̃`` is projected onto the PSD cone (eigenvalues floored at ``eig_floor``) before
    ``λI`` is added — post-processing, so every solve is well posed.

    Args:
        epsilon, delta, noise_multiplier, accounting, random_state, classes, normalize: see
            :class:`~private_engine.heads.base.DPHeadBase`.
        alpha: weight α of the all-examples term ``α·G`` (pushes scores of negatives to 0).
        reg: ridge λ added after the PSD projection; ``"auto"`` uses
            ``λ = reg_scale·sqrt(2d)·s_M`` where ``s_M`` is the noise std on the diagonal of
            ``Ã_j + αG̃`` (≈ the spectral norm of that noise), plus ``reg_min``.
        reg_scale, reg_min: constants of ``reg="auto"``.
        clip_norm: C, the feature clipping norm (sensitivities C², √k C², √k C).
        k: maximum number of positive classes per example (1 for single-label y).
        budget_split: shares ``(w_G, w_A, w_b)`` (summing to 1) of the zCDP budget; release i gets
            noise multiplier ``σ_i = σ/sqrt(3 w_i)`` so that ρ stays ``3/(2σ²)``. Default (⅓, ⅓, ⅓)
            is the paper's (σ_i = σ).
        eig_floor: eigenvalue floor of ``Ã_j + αG̃`` (``None`` disables the projection).
        class_chunk_size: classes processed at once (memory ``chunk·d²``).

    Multi-label: ``fit(X, Y)`` also accepts an (n, m) 0/1 indicator matrix (``classes_`` is then
    ``0..m−1``, from the shape). A row that is not a 0/1 indicator with at most ``k`` ones is in
    no class: the record is dropped (``n_dropped_unknown_label_``), as a label outside
    ``classes`` is for 1-D labels — the sensitivities √k C², √k C hold for the rows that stay.

    Fitted attributes: ``coef_`` (m, d), ``reg_`` (λ used), the released ``noisy_gram_`` (G̃, d×d)
    and ``noisy_class_sums_`` (b̃, m×d), and the privacy attributes of the base.
    """

    def __init__(self, *, epsilon: Optional[float] = None, delta: Optional[float] = None,
                 noise_multiplier: Optional[float] = None, alpha: float = 1.0, reg: Any = "auto",
                 reg_scale: float = 4.0, reg_min: float = 1e-3, clip_norm: float = 1.0, k: int = 1,
                 budget_split: Sequence[float] = (1 / 3, 1 / 3, 1 / 3),
                 eig_floor: Optional[float] = 0.0, class_chunk_size: int = 64,
                 normalize: bool = False, accounting: str = "rdp", random_state: Any = None,
                 classes: Any = None, dtype: torch.dtype = torch.float64):
        super().__init__(epsilon=epsilon, delta=delta, noise_multiplier=noise_multiplier,
                         accounting=accounting, random_state=random_state, classes=classes,
                         normalize=normalize, dtype=dtype)
        self.alpha = alpha
        self.reg = reg
        self.reg_scale = reg_scale
        self.reg_min = reg_min
        self.clip_norm = clip_norm
        self.k = k
        self.budget_split = budget_split
        self.eig_floor = eig_floor
        self.class_chunk_size = class_chunk_size

    def _rho_sigma2(self) -> float:
        return 1.5

    def _check_k(self) -> None:
        if not (isinstance(self.k, (int, np.integer)) and self.k >= 1):
            raise ValueError(f"k must be an integer ≥ 1, got {self.k!r}.")

    def _prepare_fit(self, X, y, private: bool = True):
        y_arr = y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
        if y_arr.ndim != 2:
            return super()._prepare_fit(X, y, private)
        # multi-label indicator: the label set 0..m−1 comes from the shape (public)
        self._check_k()
        Xt, finite = finite_records(X, self.dtype)
        if y_arr.shape[0] != Xt.shape[0]:
            raise ValueError(f"X has {Xt.shape[0]} samples but Y has {y_arr.shape[0]}.")
        if y_arr.dtype == object or not (np.issubdtype(y_arr.dtype, np.number)
                                         or y_arr.dtype == bool):
            raise ValueError(f"a 2-D y must be a 0/1 indicator matrix, got dtype {y_arr.dtype}.")
        # a row that is not a 0/1 indicator with at most k ones is in no class: dropped
        with np.errstate(invalid="ignore"):
            indicator = np.all((y_arr == 0) | (y_arr == 1), axis=1)
            known = indicator & (np.where(indicator[:, None], y_arr, 0).sum(axis=1) <= self.k)
        self.classes_ = np.arange(y_arr.shape[1])
        self.n_features_in_ = Xt.shape[1]
        keep = self._records_kept(finite, torch.as_tensor(known, device=Xt.device))
        Y = torch.as_tensor(np.where(known[:, None], y_arr, 0), dtype=self.dtype,
                            device=Xt.device)
        return Xt[keep], Y[keep]

    def _split_sigmas(self, sigma: float):
        w = np.asarray(self.budget_split, dtype=np.float64)
        if w.shape != (3,) or np.any(w <= 0) or abs(w.sum() - 1) > 1e-9:
            raise ValueError("budget_split must be three positive shares summing to 1, "
                             f"got {self.budget_split!r}.")
        return [sigma / math.sqrt(3 * wi) for wi in w]

    def _fit(self, X: torch.Tensor, Y: torch.Tensor, sigma: float, noise: NoiseSource) -> None:
        if self.alpha < 0:
            raise ValueError(f"alpha must be ≥ 0, got {self.alpha}.")
        self._check_k()
        private = sigma > 0
        C = check_clip_norm("clip_norm", self.clip_norm, X.shape[0], X.dtype)
        sk = math.sqrt(self.k)
        s_G, s_A, s_b = self._split_sigmas(sigma)
        Xc = clip_rows(X, C) if private else X
        n, d = Xc.shape
        m = Y.shape[1]

        G = noise.release("G (shared Gram)", Xc.T @ Xc, C * C, s_G, symmetric=True)
        b = noise.release("b (class sums)", Xc.T @ Y, sk * C, s_b)  # (d, m)
        noise.ledger.add("A (class Grams)", sk * C * C, s_A * sk * C * C, shape=(m, d, d))

        diag_std = math.sqrt((s_A * sk * C * C) ** 2 + (self.alpha * s_G * C * C) ** 2)
        if self.reg == "auto":
            lam = self.reg_scale * math.sqrt(2 * d) * diag_std + self.reg_min
        else:
            lam = float(self.reg)
            if lam < 0:
                raise ValueError(f"reg must be ≥ 0 or 'auto', got {self.reg!r}.")
        self.reg_ = lam

        coef = torch.empty(m, d, dtype=X.dtype, device=X.device)
        chunk = max(1, int(self.class_chunk_size))
        for start in range(0, m, chunk):
            stop = min(m, start + chunk)
            # A_j = Σ_{i: y_ij = 1} x̃_i x̃_iᵀ: a Gram matrix of the class's rows (k·n·d² work in all)
            A = torch.stack([Xc[Y[:, j] > 0].T @ Xc[Y[:, j] > 0] for j in range(start, stop)])
            A = noise.release("A (class Grams)", A, sk * C * C, s_A, symmetric=True, record=False)
            M = A + self.alpha * G
            rhs = b[:, start:stop].T  # (c, d)
            if self.eig_floor is not None and private:
                evals, evecs = psd_floor(M, float(self.eig_floor))
                proj = torch.einsum("cji,cj->ci", evecs, rhs)
                coef[start:stop] = torch.einsum("cij,cj->ci", evecs, proj / (evals + lam))
            else:
                eye = torch.eye(d, dtype=X.dtype, device=X.device)
                coef[start:stop] = solve(M + lam * eye, rhs.unsqueeze(-1)).squeeze(-1)
        self.coef_ = coef
        self.noisy_gram_ = G  # the released statistics (post-processing of them is free)
        self.noisy_class_sums_ = b.T
        self.clip_ = C if private else None

    def _device(self) -> torch.device:
        return self.coef_.device

    def _decision(self, X: torch.Tensor) -> torch.Tensor:
        Xc = clip_rows(X, self.clip_) if self.clip_ is not None else X
        return Xc @ self.coef_.T
