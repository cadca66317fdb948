"""zCDP accounting for the heads: ρ of Gaussians, composition, (ε, δ) conversions and σ calibration,
checked against closed forms, Opacus and the exact Gaussian privacy profile."""
import math
import warnings

import numpy as np
import pytest
from scipy.stats import norm

from private_engine.accounting.analytic_gaussian import gaussian_epsilon
from private_engine.accounting.zcdp import (
    CONVERSIONS,
    ZCDPLedger,
    compose_rho,
    epsilon_for_noise_multiplier,
    epsilon_to_rho,
    gaussian_rho,
    noise_multiplier_for_epsilon,
    rho_to_epsilon,
    rho_to_rdp,
)


def classical_eps(rho, delta):  # Bun & Steinke 2016, Prop. 1.3
    return rho + 2 * math.sqrt(rho * math.log(1 / delta))


def classical_rho(eps, delta):  # its inverse, solved in closed form
    L = math.log(1 / delta)
    return (math.sqrt(L + eps) - math.sqrt(L)) ** 2


def test_gaussian_rho_closed_form():
    assert gaussian_rho(2.0, 4.0) == pytest.approx(4.0 / 32.0)
    assert gaussian_rho(1.0, 3.0, count=5) == pytest.approx(5 / 18)
    assert gaussian_rho(1.0, 0.0) == math.inf
    assert gaussian_rho(0.0, 1.0) == 0.0
    assert rho_to_rdp(0.3, [2, 10]).tolist() == pytest.approx([0.6, 3.0])


def test_heterogeneous_gaussians_compose_to_the_sum_of_rhos():
    rng = np.random.default_rng(0)
    sens = rng.uniform(0.1, 3, size=7)
    stds = rng.uniform(0.5, 10, size=7)
    ledger = ZCDPLedger()
    for i, (d, s) in enumerate(zip(sens, stds)):
        ledger.add(f"r{i}", d, s)
    expected = float(np.sum(sens ** 2 / (2 * stds ** 2)))
    assert ledger.rho == pytest.approx(expected, rel=1e-12)
    assert compose_rho([r.rho for r in ledger.releases]) == pytest.approx(expected, rel=1e-12)
    # exactness: a composition of Gaussians is one Gaussian with μ² = Σ Δ_i²/s_i² = 2ρ, so the
    # "gdp" conversion equals the analytic Gaussian ε of that single mechanism
    mu = math.sqrt(float(np.sum(sens ** 2 / stds ** 2)))
    assert ledger.epsilon(1e-6, "gdp") == pytest.approx(gaussian_epsilon(1e-6, 1.0, mu), rel=1e-9)
    assert "total" in ledger.summary()


@pytest.mark.parametrize("rho", [1e-5, 1e-3, 0.05, 1.0, 20.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-9])
def test_classical_conversion_is_the_closed_form(rho, delta):
    assert rho_to_epsilon(rho, delta, "classical") == pytest.approx(classical_eps(rho, delta),
                                                                    rel=1e-12)


@pytest.mark.parametrize("rho", [1e-5, 1e-3, 0.05, 1.0, 20.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-9])
def test_rdp_conversion_matches_opacus_and_brute_force(rho, delta):
    from opacus.accountants.analysis.rdp import get_privacy_spent

    eps = rho_to_epsilon(rho, delta, "rdp")
    # brute force over a very dense set of orders with Opacus' own formula
    a = np.logspace(-5, 9, 400_000)
    orders = 1 + a
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps_dense, _ = get_privacy_spent(orders=orders, rdp=rho * orders, delta=delta)
        eps_default, _ = get_privacy_spent(
            orders=[1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)),
            rdp=[rho * o for o in [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))],
            delta=delta)
    assert eps == pytest.approx(eps_dense, rel=1e-7)
    assert eps <= eps_dense * (1 + 1e-12)
    assert eps <= eps_default + 1e-12  # never worse than Opacus' default order grid
    # ordering of the bounds: exact ≤ improved RDP ≤ classical
    assert rho_to_epsilon(rho, delta, "gdp") < eps < classical_eps(rho, delta)


def test_gdp_conversion_known_value():
    # μ = 1 (ρ = 1/2): δ(ε=1) = Φ(−1/2) − e Φ(−3/2) (Dong, Roth & Su 2022, Cor. 2.13)
    delta = norm.cdf(-0.5) - math.e * norm.cdf(-1.5)
    assert delta == pytest.approx(0.126936, abs=1e-6)
    assert rho_to_epsilon(0.5, delta, "gdp") == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("method", CONVERSIONS)
@pytest.mark.parametrize("eps", [0.01, 0.1, 1.0, 8.0, 50.0])
def test_bisection_reaches_target_to_1e6_and_never_exceeds_it(method, eps):
    rho = epsilon_to_rho(eps, 1e-5, method)
    achieved = rho_to_epsilon(rho, 1e-5, method)
    assert achieved <= eps
    assert abs(achieved - eps) <= 1e-6 * eps


@pytest.mark.parametrize("eps", [0.01, 0.3, 2.0, 30.0])
def test_bisection_inverts_the_classical_closed_form(eps):
    assert epsilon_to_rho(eps, 1e-6, "classical") == pytest.approx(classical_rho(eps, 1e-6),
                                                                   rel=1e-8)
    # σ for a 3/(2σ²)-zCDP mechanism (DP-LS)
    sigma = noise_multiplier_for_epsilon(eps, 1e-6, 1.5, "classical")
    assert sigma == pytest.approx(math.sqrt(1.5 / classical_rho(eps, 1e-6)), rel=1e-8)
    assert epsilon_for_noise_multiplier(sigma, 1e-6, 1.5, "classical") == pytest.approx(
        eps, rel=1e-6)


@pytest.mark.parametrize("method", CONVERSIONS)
def test_calibrated_sigma_is_monotone_in_epsilon(method):
    eps = [0.05, 0.1, 0.5, 1, 2, 4, 8, 16]
    sigmas = [noise_multiplier_for_epsilon(e, 1e-5, 10.0, method) for e in eps]
    assert all(a > b for a, b in zip(sigmas, sigmas[1:]))
    # and ε(ρ) itself is increasing
    rhos = np.logspace(-6, 2, 40)
    values = [rho_to_epsilon(r, 1e-5, method) for r in rhos]
    assert all(a < b for a, b in zip(values, values[1:]))


def test_edge_cases_and_errors():
    assert rho_to_epsilon(0.0, 1e-5) == 0.0
    assert rho_to_epsilon(math.inf, 1e-5) == math.inf
    assert epsilon_to_rho(math.inf, 1e-5) == math.inf
    assert noise_multiplier_for_epsilon(math.inf, 1e-5, 1.5) == 0.0
    with pytest.raises(ValueError, match="delta"):
        rho_to_epsilon(0.1, None)
    with pytest.raises(ValueError, match="delta"):
        rho_to_epsilon(0.1, 1.5)
    with pytest.raises(ValueError, match="conversion method"):
        rho_to_epsilon(0.1, 1e-5, "pld")
    with pytest.raises(ValueError, match="epsilon"):
        epsilon_to_rho(0.0, 1e-5)
