"""The accountants of DP-SGD: Opacus' RDP, PRV and GDP accountants and dp-accounting's PLD
accountant (:mod:`private_engine.accounting.pld`), by name.

The mechanism is the Poisson-subsampled Gaussian: each step releases ``Σ_i C_i g_i +
N(0, σ²R²I)`` over a batch in which each example is included independently with probability
``q = batch_size / sample_size``; the accountant composes ``steps`` of it (add-or-remove-one
neighbouring relation).

Opacus' RDP accountant evaluates ``ε = min_α ε_RDP(α) + log((α−1)/α) − (log δ + log α)/(α−1)``
(Balle et al. 2020, "Hypothesis Testing Interpretations and Renyi Differential Privacy", Thm 21)
on the orders ``α ∈ {1.1, …, 10.9, 12, …, 63}``, and warns "Optimal order is the largest alpha"
when the minimum falls on α = 63: then the true minimum lies at a larger order and the ε found is
a valid but loose upper bound. It appears

* in every run of Opacus' PRV accountant: to size the domain it discretises, it asks the RDP
  accountant for the ε of one step at ``δ_error / (8·steps)`` (Gopi, Lee & Wutschitz 2021,
  "Numerical Composition of Differential Privacy", Remark 5.6), whose best order is almost always
  past 63; a loose bound there only widens the (safe) domain, and the PRV ε stays a valid upper
  bound. :class:`PRVAccountant` silences it there;
* in every calibration, whose search probes large σ (their ε is far below the target); the
  calibration silences it;
* when the privacy loss is small (large σ, small q, few steps): :class:`RDPAccountant` then
  evaluates the larger orders of :data:`EXTENDED_ORDERS` too (the minimum is then interior: the
  conversion term alone is smallest near α ≈ 1000 for δ from 10⁻⁵ to 10⁻²⁰), and warns in one
  line only if the minimum is still at the largest.
"""
from __future__ import annotations

import math
import numbers
import warnings
from typing import Optional

from opacus.accountants import IAccountant, create_accountant
from opacus.accountants import PRVAccountant as _OpacusPRVAccountant
from opacus.accountants import RDPAccountant as _OpacusRDPAccountant
from opacus.accountants.analysis import rdp as rdp_analysis
from opacus.accountants.utils import get_noise_multiplier

from .pld import PLDAccountant, pld_noise_multiplier

ACCOUNTANTS = ("rdp", "prv", "gdp", "pld")

#: Opacus' message when the best RDP order is the largest of the grid
_EDGE_MESSAGE = "Optimal order is the (largest|smallest) alpha"
#: the orders evaluated when Opacus' default grid puts the optimum at its largest, 63
EXTENDED_ORDERS = (list(range(64, 128, 4)) + list(range(128, 512, 16))
                   + list(range(512, 4097, 128)))


class RDPAccountant(_OpacusRDPAccountant):
    """Opacus' RDP accountant (Mironov 2017, "Rényi Differential Privacy"; Mironov, Talwar &
    Zhang 2019, "Rényi Differential Privacy of the Sampled Gaussian Mechanism"), whose ε is
    recomputed over :data:`EXTENDED_ORDERS` too when the best order of Opacus' default grid is
    its largest (module docstring); elsewhere the same ε as Opacus'.

    The RDP of ``n`` steps at ``(σ, q)`` is ``n·ρ_{σ,q}(α)``; the one-step curve ``ρ_{σ,q}`` is
    computed once per ``(σ, q, orders)`` and kept, so ε costs a fraction of a millisecond at every
    step instead of Opacus' ≈ 40 ms (the same numbers: Opacus' ``compute_rdp(steps=n)`` is that
    product)."""

    def get_privacy_spent(self, *, delta: float, alphas=None):
        """``(ε, best order)`` at ``delta``: Opacus' over its default orders (or ``alphas``), and
        over the extended orders as well when the best order is the largest."""
        orders = list(self.DEFAULT_ALPHAS if alphas is None else alphas)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_EDGE_MESSAGE)
            eps, best = self._spent(delta, orders)
            if best != max(orders) or alphas is not None:
                return eps, best
            orders = orders + [a for a in EXTENDED_ORDERS if a > best]
            eps, best = self._spent(delta, orders)
        if best == max(orders) and math.isfinite(eps):
            warnings.warn(
                f"RDP accountant: the best Rényi order is the largest evaluated (α={best}); "
                f"ε={eps:.3g} is a valid upper bound but may be loose (accountant='prv' or "
                "'pld' is tighter for so little privacy loss).", UserWarning, stacklevel=3)
        return eps, best


    def _spent(self, delta: float, orders):
        """``(ε, best order)`` over ``orders``: ``Σ_history n·ρ_{σ,q}`` converted by Opacus'
        ``get_privacy_spent``."""
        if not self.history:
            return 0.0, 0.0
        rdp = sum(self._one_step(sigma, q, orders) * n for sigma, q, n in self.history)
        eps, best = rdp_analysis.get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
        return float(eps), float(best)

    def _one_step(self, sigma: float, q: float, orders):
        """``ρ_{σ,q}(α)`` at every order: one step's RDP, computed once per ``(σ, q, orders)``."""
        cache = self.__dict__.setdefault("_one_step_rdp", {})
        key = (float(sigma), float(q), tuple(orders))
        if key not in cache:
            cache[key] = rdp_analysis.compute_rdp(q=q, noise_multiplier=sigma, steps=1,
                                                  orders=orders)
        return cache[key]


class PRVAccountant(_OpacusPRVAccountant):
    """Opacus' PRV accountant (Gopi, Lee & Wutschitz 2021), the same ε, without the RDP
    warning of its domain sizing (module docstring)."""

    def get_epsilon(self, delta: float, **kwargs) -> float:
        """ε spent at ``delta`` (Opacus' ``PRVAccountant.get_epsilon``)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_EDGE_MESSAGE)
            return super().get_epsilon(delta, **kwargs)


def make_accountant(name: str) -> IAccountant:
    """An accountant by name: "rdp" (:class:`RDPAccountant`, Opacus' with the extended orders),
    "prv" (:class:`PRVAccountant`; Gopi, Lee & Wutschitz 2021, "Numerical Composition of
    Differential Privacy"), "gdp" (Dong, Roth & Su 2022, "Gaussian Differential Privacy";
    Opacus' accountants) or "pld" (dp-accounting's privacy loss distributions,
    :class:`private_engine.accounting.pld.PLDAccountant`)."""
    if name not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {name!r}.")
    if name == "rdp":
        return RDPAccountant()
    if name == "pld":
        return PLDAccountant()
    if name == "prv":
        return PRVAccountant()
    return create_accountant(mechanism=name)


def steps_for(epochs: Optional[float], steps: Optional[int], sample_rate: float) -> int:
    """Number of steps: given, or ``int(epochs / q)`` as Opacus counts them (at least one, and
    finite: a ValueError says which number to change)."""
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps <= 0:
            raise ValueError(f"steps must be a positive integer, got {steps!r}.")
        return int(steps)
    if epochs is None or not epochs > 0:
        raise ValueError("give epochs (> 0) or steps so that the noise can be calibrated to "
                         "target_epsilon.")
    if not math.isfinite(epochs):
        raise ValueError(f"epochs must be finite, got {epochs!r}: no finite noise gives a finite "
                         "ε for an unbounded number of steps.")
    count = int(epochs / sample_rate)
    if count < 1:
        raise ValueError(
            f"epochs={epochs!r} at sampling rate q={sample_rate:.4g} is {epochs / sample_rate:.3g} "
            "steps, fewer than one: give more epochs, or steps=, or a larger batch_size.")
    return count


def calibrate_noise_multiplier(target_epsilon: float, target_delta: float, sample_rate: float,
                               steps: int, accountant: str = "rdp",
                               epsilon_tolerance: float = 0.01) -> float:
    """The smallest σ (within tolerance) such that ``steps`` subsampled-Gaussian steps at rate q
    spend at most ``target_epsilon`` at ``target_delta``: Opacus' ``get_noise_multiplier`` (its
    probes' "Optimal order is the largest alpha" warnings silenced), or for "pld"
    :func:`private_engine.accounting.pld.pld_noise_multiplier` (dp-accounting's calibration)."""
    if not target_epsilon > 0 or math.isinf(target_epsilon):
        raise ValueError(
            f"target_epsilon must be a positive finite number, got {target_epsilon}.")
    if not 0 < target_delta < 1:
        raise ValueError(f"target_delta must be in (0, 1), got {target_delta}.")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}.")
    if accountant == "pld":
        return pld_noise_multiplier(target_epsilon, target_delta, sample_rate, steps)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_EDGE_MESSAGE)
        return get_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta,
                                    sample_rate=sample_rate, steps=steps, accountant=accountant,
                                    epsilon_tolerance=epsilon_tolerance)


def epsilon_for(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
                accountant: str = "rdp") -> float:
    """ε spent by ``steps`` subsampled-Gaussian steps (σ, q) at δ, by the named accountant
    (:func:`make_accountant`)."""
    acc = make_accountant(accountant)
    acc.history = [(noise_multiplier, sample_rate, steps)]
    return float(acc.get_epsilon(delta=delta))
