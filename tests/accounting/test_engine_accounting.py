"""ε of the engine vs Opacus' accountants fed the same history; σ calibrated from target_epsilon."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from opacus.accountants import GaussianAccountant, PRVAccountant, RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from torch import nn

import private_engine as pe

OPACUS = {"rdp": RDPAccountant, "prv": PRVAccountant, "gdp": GaussianAccountant}

# Opacus' GDP accountant warns on few steps
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


def _run(engine, steps, B, virtual_per_step=0, seed=0):
    """Real private steps of Poisson logical batches (``Binomial(n, B/n)`` samples) on a tiny
    model, each in ``virtual_per_step + 1`` physical batches (virtual steps that must not
    count)."""
    model = engine.model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine.attach(opt)
    gen = torch.Generator().manual_seed(seed)
    n = engine.sample_size
    sizes = torch.distributions.Binomial(n, torch.tensor(B / n)).sample((steps,)).long()
    for size in sizes.tolist():
        chunk = size // (virtual_per_step + 1)
        for _ in range(virtual_per_step):
            x = torch.randn(chunk, 4, generator=gen)
            opt.virtual_step(loss=F.cross_entropy(model(x), (x[:, 0] > 0).long(),
                                                  reduction="none"))
        x = torch.randn(size - virtual_per_step * chunk, 4, generator=gen)
        opt.step(loss=F.cross_entropy(model(x), (x[:, 0] > 0).long(), reduction="none"))
    return opt


def _engine(accountant, B=10, n=200, **kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return pe.PrivacyEngine(model, batch_size=B, sample_size=n, max_grad_norm=1.0,
                            accountant=accountant, **kwargs)


@pytest.mark.parametrize("accountant", ["rdp", "prv", "gdp"])
def test_epsilon_equals_opacus(accountant):
    sigma, B, n, steps = 1.1, 10, 200, 7
    engine = _engine(accountant, B, n, noise_multiplier=sigma)
    assert engine.get_epsilon() == 0.0
    _run(engine, steps, B, virtual_per_step=1 if accountant == "rdp" else 0)
    assert engine.steps_taken == steps
    ref = OPACUS[accountant]()
    for _ in range(steps):
        ref.step(noise_multiplier=sigma, sample_rate=B / n)
    assert engine.accountant.history == ref.history == [(sigma, B / n, steps)]
    delta = 1 / (2 * n)
    assert engine.target_delta == delta  # documented default δ = 1/(2n)
    assert engine.get_epsilon() == pytest.approx(ref.get_epsilon(delta=delta), rel=1e-12)
    assert engine.get_epsilon(1e-6) == pytest.approx(ref.get_epsilon(delta=1e-6), rel=1e-12)
    assert engine.get_epsilon(1e-6) > engine.get_epsilon()
    # same number by the helper that needs no engine
    assert pe.accounting.epsilon_for(sigma, B / n, steps, delta, accountant) == pytest.approx(
        engine.get_epsilon(), rel=1e-12)


def test_epsilon_grows_with_steps_and_target_delta_is_used():
    engine = _engine("rdp", noise_multiplier=1.0, target_delta=1e-4)
    eps = []
    opt = _run(engine, 1, 10)
    eps.append(engine.get_epsilon())
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(10, 4, generator=gen)
        opt.step(loss=F.cross_entropy(engine.model(x), (x[:, 0] > 0).long(), reduction="none"))
        eps.append(engine.get_epsilon())
    assert eps == sorted(eps) and eps[0] < eps[-1]
    ref = RDPAccountant()
    ref.history = [(1.0, 10 / 200, 4)]
    assert engine.get_epsilon() == pytest.approx(ref.get_epsilon(delta=1e-4), rel=1e-12)


@pytest.mark.parametrize("accountant", ["rdp", "prv", "gdp"])
def test_sigma_from_target_epsilon(accountant):
    """σ is Opacus' calibration, and the planned steps spend ≈ target_epsilon (≤ target, close)."""
    target, B, n, epochs = 2.0, 10, 200, 1
    engine = _engine(accountant, B, n, target_epsilon=target, epochs=epochs)
    steps = int(epochs * n / B)
    assert engine.steps == steps
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = get_noise_multiplier(target_epsilon=target, target_delta=1 / (2 * n),
                                        sample_rate=B / n, steps=steps, accountant=accountant,
                                        epsilon_tolerance=0.01)
    assert engine.noise_multiplier == pytest.approx(expected, rel=1e-12)
    _run(engine, steps, B)
    eps = engine.get_epsilon()
    assert target - 0.05 <= eps <= target * (1 + 1e-9), eps


def test_sigma_from_target_epsilon_with_steps():
    engine = _engine("rdp", target_epsilon=4.0, steps=5, target_delta=1e-5)
    assert engine.steps == 5
    _run(engine, 5, 10)
    assert 4.0 - 0.05 <= engine.get_epsilon() <= 4.0 * (1 + 1e-9)


def test_noise_multiplier_zero_means_infinite_epsilon():
    engine = _engine("rdp", noise_multiplier=0.0)
    _run(engine, 1, 10)
    assert math.isinf(engine.get_epsilon()) or engine.get_epsilon() > 1e6
