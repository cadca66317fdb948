"""The heads' privacy calibrations against Google's dp-accounting, to 1e-6: the analytic Gaussian
mechanism's δ(ε), ε(δ) and σ(ε, δ) (Balle & Wang 2018) against
``dp_accounting.gaussian_mechanism`` and the Gaussian privacy loss of ``dp_accounting.pld``; the
zCDP conversions (RDP bound of Balle et al. 2020, exact Gaussian profile) and the composition of
heterogeneous Gaussian releases against ``dp_accounting.rdp.RdpAccountant``."""
import math

import numpy as np
import pytest
from dp_accounting import dp_event, gaussian_mechanism
from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss
from dp_accounting.rdp import RdpAccountant

from private_engine.accounting import (
    ZCDPLedger,
    analytic_gaussian_sigma,
    gaussian_delta,
    gaussian_epsilon,
    noise_multiplier_for_epsilon,
    rho_to_epsilon,
)

#: a dense grid of Rényi orders: dp-accounting minimises over a grid, ours continuously; on this
#: grid the two minima agree to far better than 1e-6
ORDERS = np.concatenate([np.linspace(1.0005, 3.0, 4000), np.geomspace(3.0, 20_000.0, 40_000)])
REL = 1e-6


def _rdp_epsilon(events, delta):
    acc = RdpAccountant(orders=list(ORDERS))
    for event in events:
        acc.compose(event)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("noise_std, sensitivity, epsilon", [
    (1.0, 1.0, 0.5), (3.0, 2.0, 1.0), (0.4, 1.0, 8.0), (25.0, 0.5, 0.01)])
def test_gaussian_delta_of_epsilon(noise_std, sensitivity, epsilon):
    ours = gaussian_delta(epsilon, noise_std, sensitivity)
    theirs = GaussianPrivacyLoss(noise_std, sensitivity=sensitivity).get_delta_for_epsilon(
        epsilon)
    assert ours == pytest.approx(theirs, rel=REL)


@pytest.mark.parametrize("noise_std, sensitivity, delta", [
    (1.0, 1.0, 1e-5), (3.0, 2.0, 1e-8), (0.2, 1.0, 1e-12), (10.0, 1.0, 1e-3)])
def test_gaussian_epsilon_of_delta(noise_std, sensitivity, delta):
    ours = gaussian_epsilon(delta, noise_std=noise_std, sensitivity=sensitivity)
    theirs = gaussian_mechanism.get_epsilon_gaussian(noise_std / sensitivity, delta)
    assert ours == pytest.approx(theirs, rel=REL)


@pytest.mark.parametrize("epsilon, delta, sensitivity", [
    (0.5, 1e-5, 1.0), (1.0, 1e-5, 3.0), (3.0, 1e-8, 1.0), (8.0, 1e-3, 0.5), (0.05, 1e-6, 1.0)])
def test_analytic_gaussian_sigma(epsilon, delta, sensitivity):
    ours = analytic_gaussian_sigma(epsilon, delta, sensitivity)
    theirs = sensitivity * gaussian_mechanism.get_sigma_gaussian(epsilon, delta)
    assert ours == pytest.approx(theirs, rel=REL)


@pytest.mark.parametrize("rho, delta", [(0.01, 1e-5), (0.5, 1e-6), (2.0, 1e-8), (10.0, 1e-5)])
def test_zcdp_to_epsilon(rho, delta):
    """ρ-zCDP of one Gaussian (σ = 1/sqrt(2ρ)): the RDP conversion equals dp-accounting's RDP
    accountant's (same bound, Balle et al. 2020, Thm 21); the exact "gdp" conversion equals the
    analytic Gaussian ε."""
    sigma = 1 / math.sqrt(2 * rho)
    theirs = _rdp_epsilon([dp_event.GaussianDpEvent(sigma)], delta)
    assert rho_to_epsilon(rho, delta, "rdp") == pytest.approx(theirs, rel=REL)
    assert rho_to_epsilon(rho, delta, "gdp") == pytest.approx(
        gaussian_mechanism.get_epsilon_gaussian(sigma, delta), rel=REL)


@pytest.mark.parametrize("epsilon, delta", [(0.5, 1e-5), (2.0, 1e-6), (8.0, 1e-9)])
def test_noise_multiplier_for_epsilon_of_one_gaussian(epsilon, delta):
    """A mechanism that is (1/(2σ²))-zCDP is one Gaussian of multiplier σ: calibrated by the exact
    profile it is dp-accounting's optimal Gaussian σ."""
    ours = noise_multiplier_for_epsilon(epsilon, delta, rho_sigma2=0.5, method="gdp")
    assert ours == pytest.approx(gaussian_mechanism.get_sigma_gaussian(epsilon, delta), rel=REL)


def test_a_ledger_of_heterogeneous_gaussians_composes_as_dp_accounting():
    """A head's releases (several Gaussians of their own sensitivity and noise, some repeated)
    compose to the same ε as dp-accounting's RDP accountant composing the same events."""
    ledger = ZCDPLedger()
    releases = [("sums", 1.0, 4.0, 1), ("counts", 2.0, 10.0, 3), ("gram", 0.5, 1.5, 2)]
    for name, sensitivity, noise_std, count in releases:
        ledger.add(name, sensitivity, noise_std, count)
    events = [dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(s / d), c)
              for _, d, s, c in releases]
    for delta in (1e-5, 1e-8):
        assert ledger.epsilon(delta, "rdp") == pytest.approx(_rdp_epsilon(events, delta),
                                                             rel=REL)
        mu = math.sqrt(sum(c * (d / s) ** 2 for _, d, s, c in releases))
        assert ledger.epsilon(delta, "gdp") == pytest.approx(
            gaussian_mechanism.get_epsilon_gaussian(1 / mu, delta), rel=REL)
