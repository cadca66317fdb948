"""Empirical privacy audit: a lower bound on ε from one training run with gradient canaries.

The one-run method of Steinke, Nasr & Jagielski (2023), "Privacy Auditing with One (1) Training
Run", applied to the real :class:`private_engine.PrivacyEngine` (its clipping, noise and Poisson
sampling). ``run_audit(AuditConfig(...))`` returns an :class:`AuditResult` with the empirical
``epsilon_lower``, the ``epsilon_claimed`` by the accountant and a verdict; docs/audit.md.

Modules: ``bound`` (the theorem's p-value and the ε lower bound), ``canaries`` (inclusion,
directions, data set), ``model`` (the audited MLP and its canary head), ``training`` (the
observed engine run), ``scores`` (scores and guesses), ``run`` (``run_audit``), ``report``
(tables and plots), ``command`` (the ``private-engine audit`` options).
"""
from .bound import best_bound, epsilon_ceiling, epsilon_lower_bound, p_value
from .config import CONTROLS, DIRECTIONS, SCORES, AuditConfig, AuditResult
from .run import VERDICT_OK, VERDICT_VIOLATION, run_audit

__all__ = ["AuditConfig", "AuditResult", "run_audit", "p_value", "epsilon_lower_bound",
           "epsilon_ceiling", "best_bound", "CONTROLS", "SCORES", "DIRECTIONS", "VERDICT_OK",
           "VERDICT_VIOLATION"]
