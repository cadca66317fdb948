"""The analytic Gaussian mechanism (Balle & Wang, ICML 2018).

A Gaussian mechanism ``M(D) = f(D) + N(0, s² I)`` whose query ``f`` has L2 sensitivity ``Δ``
(``‖f(D) − f(D')‖₂ ≤ Δ`` for neighbouring ``D, D'``) is (ε, δ)-DP **if and only if**
(Balle & Wang 2018, Theorem 8)::

    δ ≥ Φ( Δ/(2s) − ε·s/Δ ) − e^ε · Φ( −Δ/(2s) − ε·s/Δ )                        (BW-8)

where Φ is the standard normal CDF. The right-hand side is the mechanism's exact privacy
profile δ(ε); it depends on ``s`` and ``Δ`` only through ``μ = Δ/s``. Composing Gaussian
mechanisms (even adaptively) with ratios μ_i gives exactly the profile of one Gaussian with
``μ = sqrt(Σ μ_i²)`` (Dong, Roth & Su 2022, Cor. 3.3), i.e. ``μ = sqrt(2ρ)`` for total zCDP ρ,
so this file is also the exact (ε, δ) conversion for any composition of Gaussian mechanisms
(``zcdp.rho_to_epsilon(..., method="gdp")``).

Functions
---------
``gaussian_delta(epsilon, noise_std, sensitivity)``  — δ(ε) of (BW-8).
``gaussian_epsilon(delta, noise_std, sensitivity)``  — the smallest ε with δ(ε) ≤ δ.
``analytic_gaussian_sigma(epsilon, delta, sensitivity)`` — the smallest noise std ``s`` with
    (ε, δ)-DP, by Balle & Wang's Algorithm 1 (the B⁺/B⁻ reparametrisation).
``classical_gaussian_sigma(epsilon, delta, sensitivity)`` — ``Δ·sqrt(2 ln(1.25/δ))/ε``
    (Dwork & Roth 2014, Thm A.1; valid only for ε < 1), for comparison.

All evaluations are done in log space (``scipy.special.log_ndtr``) so that tiny δ (1e-12) and
large ε (50) stay accurate.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.special import log_ndtr, ndtr

__all__ = ["gaussian_delta", "gaussian_epsilon", "analytic_gaussian_sigma",
           "classical_gaussian_sigma"]


def _check_eps_delta(epsilon: float, delta: float) -> None:
    if not (epsilon > 0):
        raise ValueError(f"epsilon must be > 0, got {epsilon!r}.")
    if not (0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}.")


def _profile(epsilon: float, mu: float) -> float:
    """δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ) for μ = Δ/s, computed in log space."""
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    a = mu / 2.0 - epsilon / mu
    b = -mu / 2.0 - epsilon / mu
    log_pa = float(log_ndtr(a))
    log_pb = epsilon + float(log_ndtr(b))
    if log_pb >= log_pa:  # only by round-off: the true value is ≥ 0
        return 0.0
    # exp(log_pa) − exp(log_pb) = exp(log_pa) · (1 − exp(log_pb − log_pa))
    return float(math.exp(log_pa) * -math.expm1(log_pb - log_pa))


def gaussian_delta(epsilon: float, noise_std: float, sensitivity: float = 1.0) -> float:
    """Exact δ(ε) of the Gaussian mechanism (Balle & Wang 2018, Theorem 8).

    ``δ(ε) = Φ(Δ/(2s) − εs/Δ) − e^ε Φ(−Δ/(2s) − εs/Δ)`` for noise std ``s`` and L2
    sensitivity ``Δ``. ``noise_std = 0`` gives δ = 1 (no privacy).
    """
    if epsilon < 0:
        raise ValueError(f"epsilon must be ≥ 0, got {epsilon!r}.")
    if noise_std < 0 or sensitivity < 0:
        raise ValueError("noise_std and sensitivity must be ≥ 0.")
    if sensitivity == 0:
        return 0.0
    if noise_std == 0:
        return 1.0
    return _profile(float(epsilon), float(sensitivity) / float(noise_std))


def gaussian_epsilon(delta: float, noise_std: float, sensitivity: float = 1.0,
                     rtol: float = 1e-12) -> float:
    """Smallest ε ≥ 0 such that the Gaussian mechanism is (ε, δ)-DP (inverse of BW-8 in ε).

    δ(ε) is strictly decreasing in ε, so the root is found by bracketing and bisection in ε to
    relative precision ``rtol``; the returned ε is on the safe side (δ(ε) ≤ δ).
    Returns ``inf`` for ``noise_std = 0`` and 0 when even ε = 0 meets δ.
    """
    if not (0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}.")
    if noise_std < 0 or sensitivity < 0:
        raise ValueError("noise_std and sensitivity must be ≥ 0.")
    if sensitivity == 0:
        return 0.0
    if noise_std == 0:
        return math.inf
    mu = float(sensitivity) / float(noise_std)
    if _profile(0.0, mu) <= delta:
        return 0.0
    lo, hi = 0.0, max(1.0, mu * mu)
    while _profile(hi, mu) > delta:
        lo, hi = hi, 2.0 * hi
        if hi > 1e12:
            raise OverflowError("epsilon above 1e12; the noise is effectively zero.")
    for _ in range(400):
        mid = 0.5 * (lo + hi)
        if _profile(mid, mu) > delta:
            lo = mid
        else:
            hi = mid
        if hi - lo <= rtol * hi:
            break
    return hi


def _bisect_increasing(fn, target: float, lo: float, hi: float, rtol: float) -> float:
    """Largest x in [lo, hi] (to rtol) with fn(x) ≤ target, for fn increasing."""
    for _ in range(2000):
        mid = 0.5 * (lo + hi)
        if fn(mid) <= target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= rtol * max(hi, 1e-300):
            break
    return lo


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0,
                            rtol: float = 1e-12) -> float:
    """Smallest noise std ``s`` for which ``f(D) + N(0, s²I)`` is (ε, δ)-DP — Balle & Wang 2018,
    Algorithm 1.

    With ``δ₀ = Φ(0) − e^ε Φ(−sqrt(2ε))`` (the profile at ``s = Δ/sqrt(2ε)``):

    * if δ ≥ δ₀: ``B⁻(v) = Φ(sqrt(εv)) − e^ε Φ(−sqrt(ε(v+2)))``, ``v* = sup{v ≥ 0: B⁻(v) ≤ δ}``,
      ``α = sqrt(1 + v*/2) − sqrt(v*/2)``;
    * else: ``B⁺(u) = Φ(−sqrt(εu)) − e^ε Φ(−sqrt(ε(u+2)))``, ``u* = inf{u ≥ 0: B⁺(u) ≤ δ}``,
      ``α = sqrt(1 + u*/2) + sqrt(u*/2)``;

    and ``s = α·Δ/sqrt(2ε)``. (B⁻ is increasing in v, B⁺ decreasing in u; both roots are found by
    doubling then bisection.) The result satisfies (BW-8) with equality up to ``rtol``.
    """
    _check_eps_delta(epsilon, delta)
    if sensitivity < 0:
        raise ValueError(f"sensitivity must be ≥ 0, got {sensitivity!r}.")
    if sensitivity == 0:
        return 0.0
    eps = float(epsilon)

    def diff(log_a: float, log_b: float) -> float:
        if log_b >= log_a:
            return 0.0
        return math.exp(log_a) * -math.expm1(log_b - log_a)

    def b_minus(v: float) -> float:
        return (float(ndtr(math.sqrt(eps * v)))
                - math.exp(eps + float(log_ndtr(-math.sqrt(eps * (v + 2.0))))))

    def b_plus(u: float) -> float:
        return diff(float(log_ndtr(-math.sqrt(eps * u))),
                    eps + float(log_ndtr(-math.sqrt(eps * (u + 2.0)))))

    delta0 = b_plus(0.0)  # = Φ(0) − e^ε Φ(−sqrt(2ε)) = B⁻(0)
    if delta >= delta0:
        hi = 1.0
        while b_minus(hi) <= delta:
            hi *= 2.0
            if hi > 1e300:
                break
        v = _bisect_increasing(b_minus, delta, 0.0, hi, rtol * 1e-3)
        alpha = math.sqrt(1.0 + v / 2.0) - math.sqrt(v / 2.0)
    else:
        hi = 1.0
        while b_plus(hi) > delta:
            hi *= 2.0
        # u* = inf{u: B⁺(u) ≤ δ}: B⁺ decreasing, so bisect on −B⁺ increasing.
        lo = 0.0
        for _ in range(2000):
            mid = 0.5 * (lo + hi)
            if b_plus(mid) > delta:
                lo = mid
            else:
                hi = mid
            if hi - lo <= rtol * 1e-3 * hi:
                break
        u = hi
        alpha = math.sqrt(1.0 + u / 2.0) + math.sqrt(u / 2.0)
    return alpha * float(sensitivity) / math.sqrt(2.0 * eps)


def classical_gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
    """Classical calibration ``s = Δ·sqrt(2 ln(1.25/δ))/ε`` (Dwork & Roth 2014, Theorem A.1).

    Only valid for ε < 1; provided to compare with :func:`analytic_gaussian_sigma`, which is
    always smaller (Balle & Wang 2018, Section 3).
    """
    _check_eps_delta(epsilon, delta)
    return float(sensitivity) * math.sqrt(2.0 * np.log(1.25 / delta)) / float(epsilon)
