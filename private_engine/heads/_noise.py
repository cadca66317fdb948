"""Gaussian noise of the DP heads: :class:`NoiseSource`, one secret generator plus the ledger of
every release it served, and the isometric noise of symmetric matrices.

Noisy symmetric matrices (Gram matrices, Hessians)
--------------------------------------------------
Let ``vec_s(A) = (A_11, …, A_dd, √2·A_ij for i<j)``. It is an isometry from symmetric matrices
with the Frobenius norm onto ``R^{d(d+1)/2}``, so the query ``vec_s(G(D))`` has the same L2
sensitivity ``Δ`` as ``G`` in Frobenius norm (e.g. ``‖x xᵀ‖_F = ‖x‖² ≤ C²``). We add
``N(0, (σΔ)²)`` to each coordinate of ``vec_s(G)`` and map back (post-processing), which gives
``G̃ = G + E`` with ``E`` symmetric, ``E_ii ~ N(0, (σΔ)²)`` and ``E_ij = E_ji ~ N(0, (σΔ)²/2)``
for i ≠ j — the same ρ = 1/(2σ²) as the paper's full i.i.d. d×d noise matrix (which has the same
Frobenius sensitivity), but symmetric by construction and with half the off-diagonal variance.
(Adding ``N(0, (σΔ)²)`` to the upper triangle and mirroring, without the √2, is also valid at the
same σ since it only drops coordinates' weights, but it is noisier.) Equivalently ``E = (N+Nᵀ)/2``
for the paper's i.i.d. matrix N, i.e. symmetrising the paper's release — pure post-processing.

Randomness
----------
Every head draws its noise from
:func:`private_engine.foundation.randomness.secret_generator` (the library's one randomness
policy): ``random_state=None`` (default) gives a generator whose whole state comes
from OS entropy (the 19,968-bit MT19937 state on the CPU); an int, a ``torch.Generator`` or a
numpy ``Generator`` makes the noise reproducible (an int keys the whole state through SHAKE-256,
all of its bits count) and warns with a ``ReproducibleRandomnessWarning``.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..accounting.zcdp import ZCDPLedger

__all__ = ["NoiseSource", "symmetric_noise"]


class NoiseSource:
    """Gaussian noise from one ``torch.Generator`` plus the ledger of releases it served.

    ``release(name, value, sensitivity, noise_multiplier)`` returns ``value + N(0, (σΔ)²)``
    (or the isometric symmetric noise of the module docstring with ``symmetric=True``) and records
    ``(Δ, σΔ)`` in the ledger. ``count`` records several same-size mechanisms at once (e.g. the m
    per-class gradients of DP-Newton). ``generator`` may be None only for releases without noise
    (σ = 0).
    """

    def __init__(self, generator: Optional[torch.Generator],
                 ledger: Optional[ZCDPLedger] = None):
        self.generator = generator
        self.ledger = ledger if ledger is not None else ZCDPLedger()

    def _source(self) -> torch.Generator:
        if self.generator is None:  # never fall back on torch's global (user-seeded) generator
            raise RuntimeError("this NoiseSource has no generator: it serves releases with σ = 0 "
                               "only.")
        return self.generator

    def gaussian(self, shape, std: float, like: torch.Tensor) -> torch.Tensor:
        """i.i.d. ``N(0, std²)`` of ``shape`` with ``like``'s dtype and device (not recorded)."""
        return torch.randn(shape, generator=self._source(), dtype=like.dtype,
                           device=like.device) * std

    def symmetric(self, d: int, std: float, like: torch.Tensor,
                  batch: Tuple[int, ...] = ()) -> torch.Tensor:
        """Symmetric d×d noise of :func:`symmetric_noise` (not recorded)."""
        return symmetric_noise(d, std, self._source(), like.dtype, like.device, batch)

    def release(self, name: str, value: torch.Tensor, sensitivity: float, noise_multiplier: float,
                symmetric: bool = False, count: int = 1, record: bool = True) -> torch.Tensor:
        """Gaussian mechanism: ``value + N(0, (σΔ)²)`` (isometric symmetric noise if ``symmetric``).

        ``record=False`` is for the later chunks of a release already entered in the ledger.
        """
        std = float(noise_multiplier) * float(sensitivity)
        if record:
            self.ledger.add(name, sensitivity, std, count=count, shape=tuple(value.shape))
        # the statistic is symmetric in exact arithmetic; make it so in floating point too
        if symmetric:
            value = 0.5 * (value + value.transpose(-1, -2))
        if std == 0:
            return value
        if symmetric:
            d = value.shape[-1]
            return value + self.symmetric(d, std, value, tuple(value.shape[:-2]))
        return value + self.gaussian(value.shape, std, value)


def symmetric_noise(d: int, std: float, generator: torch.Generator, dtype=torch.float64,
                    device=None, batch: Tuple[int, ...] = ()) -> torch.Tensor:
    """Symmetric noise E with ``E_ii ~ N(0, std²)``, ``E_ij = E_ji ~ N(0, std²/2)`` (i ≠ j).

    This is ``vec_s⁻¹(N(0, std² I))`` for the isometry ``vec_s`` of the module docstring, i.e. the
    Gaussian mechanism on the upper triangle of a symmetric query with Frobenius sensitivity Δ when
    ``std = σΔ`` (same ρ = 1/(2σ²) as the i.i.d. d×d noise of Mehta et al.), mirrored to the
    lower triangle.
    """
    Z = torch.randn(*batch, d, d, generator=generator, dtype=dtype, device=device) * std
    upper = torch.triu(Z, diagonal=1) / math.sqrt(2.0)
    return upper + upper.transpose(-1, -2) + torch.diag_embed(torch.diagonal(Z, dim1=-2, dim2=-1))
