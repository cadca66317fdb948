"""A privacy-loss-distribution (PLD) accountant for DP-SGD, on Google's ``dp-accounting``.

One private step is the Poisson-subsampled Gaussian mechanism: each example joins the batch
independently with probability q, and ``Σ_{i∈batch} C_i g_i + N(0, σ²R²I)`` is released, under
the add-or-remove-one neighbouring relation (the relation of Opacus' accountants). Its privacy
loss distribution, composed over the steps by convolution, gives the exact privacy profile
``δ(ε)`` up to a discretisation of the loss values (Koskela, Jälkö & Honkela 2020, "Computing
Tight Differential Privacy Guarantees Using FFT"; Doroshenko, Ghazi, Kamath, Kumar & Manurangsi
2022, "Connect the Dots: Tighter Discrete Approximations of Privacy Loss Distributions").
``dp_accounting.pld.PLDAccountant`` composes the ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``
of every step with pessimistic rounding, so the ε it reports is an upper bound of the exact ε
(no larger than the RDP accountant's, close to the PRV accountant's).

:class:`PLDAccountant` keeps Opacus' accountant interface (``history`` of ``(σ, q, steps)``,
``step``, ``get_epsilon``), so the engine, its budget, its ledger and its checkpoints use it as
they use Opacus' ``"rdp"``, ``"prv"`` and ``"gdp"``.
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple

from opacus.accountants import IAccountant

#: the width of the privacy-loss grid (dp-accounting's default): ε within about 0.1 % of the exact
#: value for the mechanisms of DP-SGD
VALUE_DISCRETIZATION = 1e-4
#: the coarser grid of the noise calibration (an upper bound too, a few times faster)
CALIBRATION_DISCRETIZATION = 1e-3


def dp_event(history: Sequence[Tuple[float, float, int]]):
    """The ``dp_accounting`` event of a history ``[(σ, q, steps), …]``: the composition of
    ``steps`` Poisson-subsampled Gaussian mechanisms ``(σ, q)`` per entry."""
    from dp_accounting import dp_event as events

    return events.ComposedDpEvent([
        events.SelfComposedDpEvent(
            events.PoissonSampledDpEvent(float(q), events.GaussianDpEvent(float(sigma))),
            int(n))
        for sigma, q, n in history if n])


def pld_epsilon(history: Sequence[Tuple[float, float, int]], delta: float,
                value_discretization: float = VALUE_DISCRETIZATION) -> float:
    """ε at ``delta`` of the steps in ``history`` by ``dp_accounting.pld.PLDAccountant``
    (add-or-remove-one relation; ``inf`` if a step has σ = 0)."""
    from dp_accounting.pld import PLDAccountant as _DpAccountingPLD

    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}.")
    if not any(n for _, _, n in history):
        return 0.0
    if any(n and sigma == 0 and q > 0 for sigma, q, n in history):
        return math.inf
    accountant = _DpAccountingPLD(value_discretization_interval=value_discretization)
    accountant.compose(dp_event(history))
    return float(accountant.get_epsilon(delta))


def pld_noise_multiplier(target_epsilon: float, target_delta: float, sample_rate: float,
                         steps: int, tol: float = 1e-4) -> float:
    """The smallest σ (to ``tol``) such that ``steps`` Poisson-subsampled Gaussian steps at rate q
    spend at most ``target_epsilon`` at ``target_delta`` by the PLD accountant:
    ``dp_accounting.mechanism_calibration.calibrate_dp_mechanism`` (Brent's method, the answer
    on the private side of the target), bracketed here."""
    from dp_accounting.mechanism_calibration import ExplicitBracketInterval, calibrate_dp_mechanism
    from dp_accounting.pld import PLDAccountant as _DpAccountingPLD

    def fresh():
        return _DpAccountingPLD(value_discretization_interval=CALIBRATION_DISCRETIZATION)

    def event(sigma: float):
        return dp_event([(sigma, sample_rate, steps)])

    def epsilon(sigma: float) -> float:
        return pld_epsilon([(sigma, sample_rate, steps)], target_delta,
                           CALIBRATION_DISCRETIZATION)

    low, high = 0.5, 1.0
    while epsilon(high) > target_epsilon:
        low, high = high, 2 * high
        if high > 1e6:
            raise ValueError(f"no σ ≤ 1e6 reaches ε={target_epsilon} at δ={target_delta} in "
                             f"{steps} steps at q={sample_rate}.")
    if low == 0.5:
        while epsilon(low) <= target_epsilon:
            low, high = low / 2, low
            if low < 1e-3:
                return high
    return float(calibrate_dp_mechanism(fresh, event, target_epsilon, target_delta,
                                        ExplicitBracketInterval(low, high), tol=tol))


class PLDAccountant(IAccountant):
    """Opacus' accountant interface over ``dp_accounting``'s PLD accountant (module docstring):
    ``history`` holds ``(σ, q, steps)`` as Opacus' accountants do; ``get_epsilon(δ)`` composes it
    afresh (about a second on a grid of 1e-4)."""

    def __init__(self, value_discretization: float = VALUE_DISCRETIZATION):
        super().__init__()
        self.value_discretization = float(value_discretization)

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Count one step of ``(σ, q)`` (consecutive equal steps merged into one entry)."""
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            sigma, q, n = self.history[-1]
            self.history[-1] = (sigma, q, n + 1)
        else:
            self.history.append((noise_multiplier, sample_rate, 1))

    def get_epsilon(self, delta: float, **kwargs) -> float:
        """ε spent at ``delta`` (:func:`pld_epsilon` of the history)."""
        return pld_epsilon(self.history, delta, self.value_discretization)

    def __len__(self) -> int:
        return sum(n for _, _, n in self.history)

    @classmethod
    def mechanism(cls) -> str:
        return "pld"
