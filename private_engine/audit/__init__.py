"""Empirical privacy audit: a lower bound on ε from one training run with gradient canaries.

The one-run method of Steinke, Nasr & Jagielski (2023), "Privacy Auditing with One (1) Training
Run", applied to the real engine (its clipping, noise and Poisson sampling), through either door
(:class:`private_engine.PrivacyEngine` or the Opacus drop-in), in any clipping mode, with canaries
on every clipping path: a canary head per layer rule (Linear with and without bias, Conv,
Embedding, LayerNorm, GroupNorm), the parameter tracer, the ``torch.func`` fallback and sequence
inputs. ``run_audit(AuditConfig(...))`` returns an :class:`AuditResult` with the empirical
``epsilon_lower``, the ``epsilon_claimed`` by the accountant, a verdict and, per path, the bound
of that path's canaries alone; docs/audit.md.

Modules: ``bound`` (the theorem's p-value and the ε lower bound), ``canaries`` (inclusion,
directions, data set), ``paths`` (a canary head and canaries per clipping path),
``model_paths`` (``paths_of``: the paths a model uses), ``model`` (the audited MLP and its
canary heads), ``training`` (the observed engine run),
``scores`` (scores and guesses), ``run`` (``run_audit``), ``report`` (tables and plots); the
``private-engine audit`` command is :mod:`private_engine.commands.audit`.
"""
from .bound import best_bound, epsilon_ceiling, epsilon_lower_bound, p_value, union_bounds
from .config import CONTROLS, DIRECTIONS, DOORS, PATHS, SCORES, AuditConfig, AuditResult, PathResult
from .model_paths import ModelPaths, paths_of
from .run import VERDICT_OK, VERDICT_VIOLATION, build_audit, run_audit

__all__ = ["AuditConfig", "AuditResult", "PathResult", "run_audit", "build_audit", "paths_of",
           "ModelPaths",
           "p_value", "epsilon_lower_bound", "epsilon_ceiling", "best_bound", "union_bounds",
           "CONTROLS", "SCORES", "DIRECTIONS", "DOORS", "PATHS", "VERDICT_OK",
           "VERDICT_VIOLATION"]
