"""The privacy budget of a training run: its target (ε, δ), the guard that refuses a step which
would exceed it, and the report of what was spent and what remains.

With a fixed noise multiplier σ and sampling rate q, the ε spent after k subsampled-Gaussian
steps, ``ε(k)``, is non-decreasing in k (composition, Abadi et al. 2016, "Deep Learning with
Differential Privacy"; Mironov 2017, "Rényi Differential Privacy"), so the budget is a largest
step count ``K = max{k : ε(k) ≤ ε_target}``: the guard compares counts, and the accountant is
asked for ``K`` once, by exponential and binary search, only when training reaches the length it
was planned for (steps within a calibrated plan are within budget by construction).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .opacus_bridge import epsilon_for


class BudgetExceededError(RuntimeError):
    """A private step would spend more than the run's privacy budget (nothing was updated)."""


@dataclass(frozen=True)
class PrivacyReport:
    """What a run has spent and what remains (:meth:`PrivacyBudget.report`)."""

    #: ε spent so far at ``delta`` (0 before the first step)
    epsilon: float
    delta: float
    #: private steps taken (logical batches released)
    steps: int
    #: the training length declared (steps or epochs / q), None if none was
    planned_steps: Optional[int]
    noise_multiplier: float
    sample_rate: float
    accountant: str
    #: the budget: target ε given, or ε of the declared length; None without either
    epsilon_budget: Optional[float]
    #: ``epsilon_budget − epsilon`` (None without a budget)
    epsilon_remaining: Optional[float]
    #: steps that still fit in the budget (None without a budget)
    steps_remaining: Optional[int]
    #: mean number of samples per released logical batch, and the declared expected batch size
    mean_batch_size: Optional[float]
    declared_batch_size: int
    #: whether the batches were checked against Poisson sampling (False: ``check_sampling=False``,
    #: the ε assumes Poisson sampling whatever the batches were)
    sampling_checked: bool = True

    def __str__(self) -> str:
        if self.epsilon_budget is None:
            budget = "no budget (give target_epsilon, or epochs/steps)"
        else:
            budget = (f"budget ε={self.epsilon_budget:.4g}, remaining "
                      f"ε={self.epsilon_remaining:.4g} ({self.steps_remaining} steps)")
        batch = ("" if self.mean_batch_size is None else
                 f", mean batch {self.mean_batch_size:.1f} (declared {self.declared_batch_size})")
        planned = "" if self.planned_steps is None else f" of {self.planned_steps} planned"
        if not self.sampling_checked:
            batch += "; sampling not checked (ε assumes Poisson sampling)"
        return (f"ε={self.epsilon:.4g} at δ={self.delta:.3g} after {self.steps} steps{planned} "
                f"(σ={self.noise_multiplier:.4g}, q={self.sample_rate:.4g}, {self.accountant}); "
                f"{budget}{batch}")


class PrivacyBudget:
    """The target (ε, δ) of a run and the guard on its step count.

    Args:
        noise_multiplier / sample_rate / delta / accountant: the run's mechanism and accountant.
        planned_steps: the declared training length (None: not declared).
        target_epsilon: the budget; None: ε of ``planned_steps`` (no budget without either).
        allow_overrun: let steps beyond the budget run (the report then shows a negative
            remainder); off by default.
    """

    def __init__(self, *, noise_multiplier: float, sample_rate: float, delta: float,
                 accountant: str, planned_steps: Optional[int] = None,
                 target_epsilon: Optional[float] = None, allow_overrun: bool = False):
        self.noise_multiplier = float(noise_multiplier)
        self.sample_rate = float(sample_rate)
        self.delta = float(delta)
        self.accountant = accountant
        self.planned_steps = planned_steps
        self.target_epsilon = target_epsilon
        self.allow_overrun = bool(allow_overrun)
        self._budget: Optional[float] = None
        self._max_steps: Optional[int] = None

    def epsilon(self, steps: int) -> float:
        """ε after ``steps`` steps of the run's mechanism, at δ."""
        if steps <= 0:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        return epsilon_for(self.noise_multiplier, self.sample_rate, steps, self.delta,
                           self.accountant)

    @property
    def epsilon_budget(self) -> Optional[float]:
        """The target ε, or ε of the declared length (computed once); None without either."""
        if self._budget is None:
            if self.target_epsilon is not None:
                self._budget = float(self.target_epsilon)
            elif self.planned_steps is not None:
                self._budget = self.epsilon(self.planned_steps)
        return self._budget

    def max_steps(self) -> Optional[int]:
        """``K = max{k : ε(k) ≤ budget}`` (None without a budget)."""
        budget = self.epsilon_budget
        if budget is None:
            return None
        if self._max_steps is None:
            def fits(k: int) -> bool:
                return self.epsilon(k) <= budget

            low = self.planned_steps if self.planned_steps and fits(self.planned_steps) else 0
            if low == 0 and not fits(1):
                self._max_steps = 0
                return 0
            low = max(low, 1)
            high = 2 * low
            while fits(high):
                low, high = high, 2 * high
                if high > 1 << 40:  # σ so large that ε never reaches the budget in practice
                    self._max_steps = high
                    return high
            while high - low > 1:
                mid = (low + high) // 2
                if fits(mid):
                    low = mid
                else:
                    high = mid
            self._max_steps = low
        return self._max_steps

    def check_step(self, steps_taken: int) -> None:
        """Raise :class:`BudgetExceededError` if step ``steps_taken + 1`` would exceed the budget
        (and overrun is not allowed). Steps within a declared plan whose ε fits are not
        recomputed."""
        if self.allow_overrun or self.epsilon_budget is None:
            return
        if self.planned_steps is not None and steps_taken < self.planned_steps:
            # within the declared length: its ε is the budget, or σ was calibrated to fit it
            return
        limit = self.max_steps()
        if steps_taken + 1 > limit:
            raise BudgetExceededError(
                "this step would spend more than the privacy budget: "
                f"ε={self.epsilon(steps_taken):.4g} after {steps_taken} steps, "
                f"ε={self.epsilon(steps_taken + 1):.4g} after one more, "
                f"budget ε={self.epsilon_budget:.4g} at δ={self.delta:.3g} ({limit} steps). "
                "Nothing was updated. Stop training here, or build the engine with a larger "
                "target_epsilon or more epochs/steps (more noise per step), or pass "
                "allow_overrun=True to spend beyond the budget knowingly.")

    def report(self, epsilon: float, steps: int, mean_batch_size: Optional[float],
               declared_batch_size: int, sampling_checked: bool = True) -> PrivacyReport:
        """The :class:`PrivacyReport` of a run that spent ``epsilon`` in ``steps`` steps."""
        budget = self.epsilon_budget
        limit = self.max_steps() if budget is not None else None
        return PrivacyReport(
            epsilon=epsilon, delta=self.delta, steps=steps, planned_steps=self.planned_steps,
            noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate,
            accountant=self.accountant, epsilon_budget=budget,
            epsilon_remaining=None if budget is None else budget - epsilon,
            steps_remaining=None if limit is None else limit - steps,
            mean_batch_size=mean_batch_size, declared_batch_size=declared_batch_size,
            sampling_checked=bool(sampling_checked))
