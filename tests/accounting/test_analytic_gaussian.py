"""Analytic Gaussian mechanism (Balle & Wang 2018): exact privacy profile and calibration."""
import math

import numpy as np
import pytest
from scipy import integrate

from private_engine.accounting.analytic_gaussian import (
    analytic_gaussian_sigma,
    classical_gaussian_sigma,
    gaussian_delta,
    gaussian_epsilon,
)

mpmath = pytest.importorskip("mpmath")
mpmath.mp.dps = 50


def mp_delta(eps, s, sens=1.0):
    """Balle & Wang Thm 8 in 50-digit arithmetic: Φ(Δ/2s − εs/Δ) − e^ε Φ(−Δ/2s − εs/Δ)."""
    eps, s, sens = mpmath.mpf(eps), mpmath.mpf(s), mpmath.mpf(sens)
    return (mpmath.ncdf(sens / (2 * s) - eps * s / sens)
            - mpmath.e ** eps * mpmath.ncdf(-sens / (2 * s) - eps * s / sens))


def mp_sigma(eps, delta, sens=1.0):
    """Reference calibration: bisection on the exact condition in 50-digit arithmetic."""
    lo, hi = mpmath.mpf("1e-6"), mpmath.mpf("1e6")
    for _ in range(200):
        mid = mpmath.sqrt(lo * hi)
        if mp_delta(eps, mid, sens) > delta:
            lo = mid
        else:
            hi = mid
    return float(hi)


# (ε, δ, Δ): both branches of Balle & Wang's Algorithm 1 (δ ≥ δ₀ uses B⁻, δ < δ₀ uses B⁺),
# the high- and low-privacy regimes and a non-unit sensitivity.
CASES = [(1.0, 1e-5, 1.0), (0.1, 1e-5, 1.0), (0.01, 0.4, 1.0), (0.5, 0.2, 1.0), (4.0, 1e-6, 1.0),
         (10.0, 1e-10, 1.0), (50.0, 1e-5, 1.0), (0.3, 1e-8, math.sqrt(2.0)), (2.0, 1e-3, 3.0)]


@pytest.mark.parametrize("eps,delta,sens", CASES)
def test_calibration_matches_high_precision_reference(eps, delta, sens):
    s = analytic_gaussian_sigma(eps, delta, sens)
    assert s == pytest.approx(mp_sigma(eps, delta, sens), rel=1e-9)
    # the returned σ meets the exact condition with equality
    assert gaussian_delta(eps, s, sens) == pytest.approx(delta, rel=1e-7)
    assert (float(mp_delta(eps, s * (1 + 1e-6), sens)) < delta
            < float(mp_delta(eps, s * (1 - 1e-6), sens)))


def test_reference_value_eps1_delta1e5():
    # the widely quoted analytic value for (ε, δ) = (1, 1e-5), Δ = 1, vs the classical 4.845
    assert analytic_gaussian_sigma(1.0, 1e-5) == pytest.approx(3.7306, abs=5e-4)
    assert classical_gaussian_sigma(1.0, 1e-5) == pytest.approx(4.8448, abs=5e-4)


@pytest.mark.parametrize("eps,s", [(0.5, 2.0), (1.0, 3.0), (3.0, 0.7), (0.1, 10.0)])
def test_profile_matches_privacy_loss_integral(eps, s):
    # δ(ε) = E_P[(1 − e^{ε − L})_+] with privacy loss L ~ N(μ²/2, μ²), μ = Δ/s
    # (independent derivation)
    mu = 1.0 / s
    dens = lambda l: (math.exp(-(l - mu * mu / 2) ** 2 / (2 * mu * mu))  # noqa: E731
                      / (mu * math.sqrt(2 * math.pi)))
    ref, _ = integrate.quad(lambda l: (1 - math.exp(eps - l)) * dens(l), eps, eps + 40 * mu + 40,
                            limit=200, epsabs=1e-14, epsrel=1e-10)
    assert gaussian_delta(eps, s) == pytest.approx(ref, rel=1e-6)


def test_balle_wang_claims():
    # the classical calibration (valid for ε < 1) is never tight: the analytic σ is smaller
    for eps in [0.01, 0.1, 0.5, 0.9]:
        for delta in [1e-3, 1e-5, 1e-8]:
            assert analytic_gaussian_sigma(eps, delta) < 0.85 * classical_gaussian_sigma(eps, delta)
    # the classical formula does not extend to large ε: it violates (ε, δ)-DP there
    s_classical = classical_gaussian_sigma(50.0, 1e-5)
    assert gaussian_delta(50.0, s_classical) > 1e-5


def test_epsilon_inverts_delta_and_sigma():
    for eps, delta, sens in CASES:
        s = analytic_gaussian_sigma(eps, delta, sens)
        assert gaussian_epsilon(delta, s, sens) == pytest.approx(eps, rel=1e-8)
    assert gaussian_epsilon(1e-5, 0.0) == math.inf
    assert gaussian_epsilon(0.9, 100.0) == 0.0  # δ(0) ≤ δ already


def test_sigma_scales_linearly_and_is_monotone():
    base = analytic_gaussian_sigma(0.7, 1e-6)
    assert analytic_gaussian_sigma(0.7, 1e-6, sensitivity=2.5) == pytest.approx(
        2.5 * base, rel=1e-10)
    sig = [analytic_gaussian_sigma(e, 1e-6) for e in np.logspace(-2, 1.5, 15)]
    assert all(a > b for a, b in zip(sig, sig[1:]))


def test_errors():
    with pytest.raises(ValueError, match="epsilon"):
        analytic_gaussian_sigma(0.0, 1e-5)
    with pytest.raises(ValueError, match="delta"):
        analytic_gaussian_sigma(1.0, 0.0)
