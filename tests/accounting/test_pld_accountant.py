"""accountant="pld": dp-accounting's privacy-loss-distribution accountant behind the engine's
accountant interface — its ε equals dp-accounting's own for the same mechanism, lies between the
PRV and RDP accountants' (sanity bounds), and calibrates σ; and the RDP accountant's "Optimal order
is the largest alpha" warning no longer appears where it meant nothing."""
import math
import warnings

import dp_accounting
import pytest
import torch
import torch.nn.functional as F
from dp_accounting import dp_event
from opacus.accountants import PRVAccountant, RDPAccountant
from torch import nn

import private_engine as pe
from private_engine import accounting

pytestmark = pytest.mark.usefixtures("one_thread")

SIGMA, B, N, STEPS = 1.1, 10, 200, 7


def _reference(history, delta):
    """dp-accounting's own PLD accountant (its defaults) on the Poisson-subsampled Gaussian."""
    acc = dp_accounting.pld.PLDAccountant()
    for sigma, q, n in history:
        acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), n)
    return acc.get_epsilon(delta)


def _opacus(cls, history, delta):
    acc = cls()
    acc.history = list(history)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return acc.get_epsilon(delta=delta)


def test_engine_pld_epsilon_is_dp_accountings_and_between_prv_and_rdp():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=N, max_grad_norm=1.0,
                              noise_multiplier=SIGMA, accountant="pld")
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    gen = torch.Generator().manual_seed(0)
    for size in (9, 12, 10, 7, 11, 10, 8):  # sizes of Poisson batches
        x = torch.randn(size, 4, generator=gen)
        opt.step(loss=F.cross_entropy(model(x), (x[:, 0] > 0).long(), reduction="none"))
    history = [(SIGMA, B / N, STEPS)]
    assert engine.accountant.history == history and engine.steps_taken == STEPS
    delta = engine.target_delta
    eps = engine.get_epsilon()
    assert eps == pytest.approx(_reference(history, delta), rel=0.01)
    # sanity bounds: PLD and PRV both approximate the exact ε (within a few %), RDP is looser
    prv, rdp = _opacus(PRVAccountant, history, delta), _opacus(RDPAccountant, history, delta)
    assert abs(eps - prv) <= 0.03 * prv and eps < rdp
    assert engine.get_epsilon(1e-7) > eps
    report = engine.privacy_report()
    assert report.accountant == "pld" and report.epsilon == pytest.approx(eps, rel=1e-12)


def test_pld_epsilon_matches_dp_accounting_for_a_history_of_two_mechanisms():
    sigma, q, steps, delta = 2.0, 0.1, 50, 1e-6
    history = [(sigma, q, steps)]
    eps = accounting.epsilon_for(sigma, q, steps, delta, "pld")
    assert eps == pytest.approx(_reference(history, delta), rel=0.01)
    assert eps < _opacus(RDPAccountant, history, delta)
    # a history of two mechanisms (σ changed during training) composes both
    two = [(sigma, q, steps), (2 * sigma, q, steps)]
    acc = accounting.make_accountant("pld")
    acc.history = two
    assert acc.get_epsilon(delta) == pytest.approx(_reference(two, delta), rel=0.01)
    assert acc.get_epsilon(delta) > eps


def test_pld_calibration_spends_the_target_and_needs_less_noise_than_rdp():
    target, delta, q, steps = 2.0, 1e-5, 0.05, 40
    sigma = accounting.calibrate_noise_multiplier(target, delta, q, steps, "pld")
    eps = _reference([(sigma, q, steps)], delta)
    assert target * 0.98 <= eps <= target * 1.001
    assert sigma < accounting.calibrate_noise_multiplier(target, delta, q, steps, "rdp")
    engine = pe.PrivacyEngine(nn.Linear(4, 2), batch_size=10, sample_size=200, steps=steps,
                              max_grad_norm=1.0, target_epsilon=target, target_delta=delta,
                              accountant="pld")
    assert engine.noise_multiplier == pytest.approx(sigma, rel=1e-12)
    assert engine.budget.epsilon(steps) <= target


def test_no_optimal_order_warning_where_it_means_nothing():
    """Opacus' PRV accountant sizes its domain with a one-step RDP ε at a tiny δ, whose best
    order is past 63: "Optimal order is the largest alpha" in every run, for nothing; the
    calibration probes large σ; small losses have their optimum past 63, where the extended
    orders find it (a smaller, still valid ε)."""
    history = [(5.0, 0.004, 25)]  # a small privacy loss: Opacus' best order is 63
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prv = accounting.epsilon_for(1.0, 0.01, 100, 1e-5, "prv")
        rdp = accounting.epsilon_for(*history[0], 1e-5, "rdp")
        accounting.calibrate_noise_multiplier(3.0, 1e-5, 0.004, 2500, "rdp")
    assert not [w for w in caught if "Optimal order" in str(w.message)], caught
    assert prv == pytest.approx(_opacus(PRVAccountant, [(1.0, 0.01, 100)], 1e-5), rel=1e-12)
    extended = RDPAccountant.DEFAULT_ALPHAS + accounting.opacus_bridge.EXTENDED_ORDERS
    acc = RDPAccountant()
    acc.history = history
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, best = acc.get_privacy_spent(delta=1e-5, alphas=extended)
        default = acc.get_epsilon(1e-5)
    assert 63 < best < max(extended)
    assert rdp == pytest.approx(expected, rel=1e-12) and rdp < 0.25 * default
    # where the optimum is interior the ε is Opacus' to the last digit
    assert accounting.epsilon_for(1.1, 0.05, 7, 1e-5, "rdp") == _opacus(
        RDPAccountant, [(1.1, 0.05, 7)], 1e-5)
    assert math.isinf(accounting.epsilon_for(0.0, 0.05, 3, 1e-5, "pld"))


def test_engine_rdp_epsilon_is_opacus_own_where_its_grid_holds_the_optimum():
    # the engine's RDP accountant keeps one-step curves and widens the grid only when Opacus'
    # optimum is its largest order: elsewhere its ε is Opacus' own, for a mixed history
    from opacus.accountants import RDPAccountant as OpacusRDP

    from private_engine.accounting.opacus_bridge import RDPAccountant

    ours, theirs = RDPAccountant(), OpacusRDP()
    for sigma, q, n in [(1.1, 0.01, 30), (0.8, 0.02, 5), (1.1, 0.01, 12)]:
        for acc in (ours, theirs):
            for _ in range(n):
                acc.step(noise_multiplier=sigma, sample_rate=q)
        for delta in (1e-5, 1e-7):
            eps, best = theirs.get_privacy_spent(delta=delta)
            assert best < max(theirs.DEFAULT_ALPHAS)
            assert ours.get_privacy_spent(delta=delta) == pytest.approx((eps, best), rel=1e-12)
