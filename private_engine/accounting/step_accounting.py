"""The accounting of a training run's private steps, as one object: the accountant, the budget
guard, the sampling-rate check, the step ledger and the step metrics, asked by the private step
before and after each release (:class:`private_engine.optim.private_step.StepAccounting`).

Each logical step is one Poisson-subsampled Gaussian release at noise multiplier σ and sampling
rate q = B/n (Abadi et al. 2016, "Deep Learning with Differential Privacy"; Mironov, Talwar &
Zhang 2019, "Rényi Differential Privacy of the Sampled Gaussian Mechanism"); the accountant
composes them, ``ε(δ)`` after k steps. A step beyond the budget is refused before its release;
a logical batch whose size contradicts Poisson sampling at rate q is refused before its noise;
the ledger line of a step is on disk before its update.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .budget import PrivacyBudget, PrivacyReport
from .opacus_bridge import make_accountant
from .sampling_check import SamplingRateCheck


class StepAccountant:
    """The accounting side of the private steps of one engine.

    Args:
        accountant: the accountant (``step(noise_multiplier=, sample_rate=)``, ``history``,
            ``get_epsilon(delta=)``); ``name`` its registered name.
        noise_multiplier, sample_rate, delta: σ, q = B/n and δ of every step.
        budget: the guard that refuses a step beyond the target ε.
        sampling_check: the check of each logical batch's size against Poisson sampling.
        step_metrics: the step loggers' recorder (:class:`private_engine.step_metrics.
            StepMetricsRecorder`), or None.
    """

    def __init__(self, accountant, name: str, *, noise_multiplier: float, sample_rate: float,
                 delta: float, budget: PrivacyBudget, sampling_check: SamplingRateCheck,
                 step_metrics=None):
        self.accountant = accountant
        self.name = name
        self.noise_multiplier = noise_multiplier
        self.sample_rate = sample_rate
        self.delta = delta
        self.budget = budget
        self.sampling_check = sampling_check
        self.step_metrics = step_metrics
        #: the step ledger every step is recorded in before its release
        #: (:mod:`private_engine.accounting.ledger`), or None
        self.ledger = None

    @classmethod
    def build(cls, accountant: str, *, noise_multiplier: float, batch_size: int,
              sample_size: int, delta: float, planned_steps: Optional[int] = None,
              target_epsilon: Optional[float] = None, allow_overrun: bool = False,
              check_sampling: bool = True) -> "StepAccountant":
        """The accounting of steps at σ = ``noise_multiplier`` and q = ``batch_size /
        sample_size``: the accountant named ``accountant`` (:func:`make_accountant`), the budget
        of ``target_epsilon`` at δ over ``planned_steps``
        (:class:`private_engine.accounting.PrivacyBudget`) and the sampling-rate check
        (:class:`private_engine.accounting.SamplingRateCheck`, on when ``check_sampling``)."""
        q = batch_size / sample_size
        return cls(make_accountant(accountant), accountant, noise_multiplier=noise_multiplier,
                   sample_rate=q, delta=delta,
                   budget=PrivacyBudget(noise_multiplier=noise_multiplier, sample_rate=q,
                                        delta=delta, accountant=accountant,
                                        planned_steps=planned_steps,
                                        target_epsilon=target_epsilon,
                                        allow_overrun=allow_overrun),
                   sampling_check=SamplingRateCheck(batch_size, sample_size,
                                                    enabled=bool(check_sampling)))

    @property
    def steps_taken(self) -> int:
        """k: the steps released so far (the accountant's history)."""
        return sum(n for _, _, n in self.accountant.history)

    # -- around a release ------------------------------------------------------------------------
    def check_step(self) -> None:
        """Before every private step: refuse it if it would exceed the budget
        (:class:`private_engine.accounting.BudgetExceededError`)."""
        self.budget.check_step(self.steps_taken)

    def check_release(self, samples: int) -> None:
        """Before a logical batch's noise: the sampling-rate check, then the step's line in the
        ledger, on disk before the update is applied (a step the run may release is counted)."""
        self.sampling_check.check(samples)
        if self.ledger is not None:
            self.ledger.record(self.noise_multiplier, self.sample_rate)

    def commit(self, samples: int) -> None:
        """After the update: one Poisson-subsampled Gaussian release of a logical batch of
        ``samples`` samples."""
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
        self.sampling_check.commit(samples)

    def report(self, records: List, max_grad_norm: float) -> None:
        """After every successful step: its metrics to the step loggers."""
        if self.step_metrics is not None:
            self.step_metrics.record(self.steps_taken, records, max_grad_norm)

    # -- reading ---------------------------------------------------------------------------------
    def get_epsilon(self, delta: Optional[float] = None) -> float:
        """ε spent so far at ``delta`` (default δ): with the RDP accountant from one-step RDP
        curves cached per (σ, q) (:class:`private_engine.step_metrics.EpsilonTracker`), else the
        accountant's own."""
        if not self.accountant.history:
            return 0.0
        delta = self.delta if delta is None else delta
        eps = None if self.step_metrics is None else self.step_metrics.epsilon.exact(delta)
        return eps if eps is not None else float(self.accountant.get_epsilon(delta=delta))

    def privacy_report(self, batch_size: int) -> PrivacyReport:
        """ε spent, steps, σ, q, δ, the budget and what remains of it, and the mean logical batch
        actually clipped against the expected ``batch_size``."""
        return self.budget.report(self.get_epsilon(), self.steps_taken,
                                  self.sampling_check.mean_batch_size, batch_size,
                                  sampling_checked=self.sampling_check.enabled)

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """``{"accountant": {"name", "history": [(σ, q, steps)]}, "ledger": None or {"run",
        "path"}}``: public values (the number of steps and the declared σ, q). The sampling
        check's totals are functions of the data and are not included."""
        ledger = self.ledger
        return {
            "accountant": {
                "name": str(self.name),
                "history": [(float(s), float(q), int(n)) for s, q, n in self.accountant.history],
            },
            "ledger": None if ledger is None else {"run": ledger.run, "path": ledger.path},
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """The accountant's history from :meth:`state_dict` (the ledger is chosen by the loader,
        :func:`private_engine.checkpoint.load_engine_state_dict`)."""
        self.accountant.history = [(float(s), float(q), int(n))
                                   for s, q, n in state["accountant"]["history"]]

    def use_ledger(self, ledger) -> None:
        """Record every later step in ``ledger`` (the one in use before is closed)."""
        if self.ledger is not None and self.ledger is not ledger:
            self.ledger.close()
        self.ledger = ledger


__all__ = ["StepAccountant"]
