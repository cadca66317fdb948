"""``run_audit``: one-run empirical privacy audit of the engine (Steinke, Nasr & Jagielski 2023).

Steinke, Nasr & Jagielski (2023), "Privacy Auditing with One (1) Training Run":

1. draw m gradient canaries, split over the clipping paths audited, each included with
   probability 1/2 (:mod:`private_engine.audit.canaries`, :mod:`private_engine.audit.paths`);
2. train once with the real engine, observing every step (:mod:`private_engine.audit.training`);
3. score each canary and guess "included" for the k₊ highest scores, "excluded" for the k₋
   lowest, among all canaries and among each path's (:mod:`private_engine.audit.scores`);
4. turn the number of correct guesses into an ε lower bound at confidence 1 − β
   (:mod:`private_engine.audit.bound`, their Theorem 3.1, with a union bound over the rules) and
   compare it with the ε the accountant claims.

A correct implementation gives ``ε_lower ≤ ε_claimed`` except with probability β; the positive
controls (``control="noise_scaled"`` or ``"clip_scaled"``) run the same engine 100× less private
than claimed and must be flagged, and so must an engine that leaves any one path unclipped
(tests/audit/test_audit_paths.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from .config import AuditConfig, AuditResult

__all__ = ["run_audit", "build_audit", "AuditSetup", "claimed_noise", "VERDICT_OK",
           "VERDICT_VIOLATION"]

VERDICT_OK = "consistent"
VERDICT_VIOLATION = "VIOLATION: empirical ε_lower > claimed ε"


@lru_cache(maxsize=64)
def _calibrated(epsilon: float, delta: float, q: float, steps: int, accountant: str) -> float:
    import warnings

    from ..accounting import calibrate_noise_multiplier

    with warnings.catch_warnings():
        # the search tries σ far from the answer, where the optimal RDP order is at the edge of
        # Opacus' grid; the ε of the σ found is computed (and warns, if need be) by _epsilon
        warnings.filterwarnings("ignore", message="Optimal order is the", category=UserWarning)
        return float(calibrate_noise_multiplier(epsilon, delta, q, steps, accountant))


@lru_cache(maxsize=64)
def _epsilon(sigma: float, q: float, steps: int, delta: float, accountant: str) -> float:
    from ..accounting import epsilon_for

    return float(epsilon_for(sigma, q, steps, delta, accountant))


def claimed_noise(config: AuditConfig):
    """``(σ, ε, q)`` claimed: σ calibrated to ``config.epsilon`` by the accountant (or the σ
    given), its ε at ``config.delta`` after ``config.steps`` steps, and ``q = B / n`` (both
    accountant calls cached: a sweep repeats them)."""
    q = config.logical_batch_size / config.sample_size
    sigma = config.noise_multiplier
    if sigma is None:
        sigma = _calibrated(float(config.target_epsilon), config.delta, q, config.steps,
                            config.accountant)
    eps = _epsilon(float(sigma), q, config.steps, config.delta, config.accountant)
    return float(sigma), eps, q


def _run_settings(config: AuditConfig, sigma: float):
    """``(σ, R)`` the engine runs with: the claim, or the control's broken version."""
    f, r = config.control_factor, config.max_grad_norm
    if config.control == "noise_scaled":
        return sigma / f, r
    if config.control == "clip_scaled":
        return sigma / f, r * f
    return sigma, r


@dataclass
class AuditSetup:
    """What one audit trains: the model with its canary heads, the data set, the ``linear``
    canaries (None when that path is not audited), the other paths' canaries and the number of
    canaries per path."""

    model: object
    dataset: object
    linear: object
    others: list
    split: dict


def build_audit(config: AuditConfig, run_max_grad_norm: float = None) -> AuditSetup:
    """The model, data set and canaries of ``config`` (all from ``config.seed``; the canaries'
    gradients scaled to ``canary_scale · run_max_grad_norm``, default ``max_grad_norm``)."""
    from .canaries import CLASSES, FEATURES, build_dataset, draw_canaries, synthetic_data
    from .model import AuditModel
    from .paths import build_path, split_canaries

    config = config.validate()
    run_r = config.max_grad_norm if run_max_grad_norm is None else run_max_grad_norm
    names = config.path_names
    split = split_canaries(config.canaries, names)
    gen = torch.Generator().manual_seed(config.seed)
    canary_set = (draw_canaries(split["linear"], config.directions, gen)
                  if "linear" in names else None)
    x, y = synthetic_data(config.data_size, gen)
    others = [build_path(p, split[p], gen, door=config.door) for p in names if p != "linear"]
    dataset = build_dataset(x, y, canary_set, canary_weight=config.canary_scale * run_r,
                            paths=others)
    k, d = (canary_set.c.shape[1], canary_set.v.shape[1]) if canary_set is not None else (0, 0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = AuditModel(FEATURES, CLASSES, k, d,
                           heads={p.name: p.head for p in others}).double()
    return AuditSetup(model, dataset, canary_set, others, split)


def run_audit(config: AuditConfig = None, **overrides) -> AuditResult:
    """Audit the engine once (see the module docstring); ``overrides`` replace fields of
    ``config`` (default :class:`AuditConfig`).

    The canaries are split over the audited paths (:mod:`private_engine.audit.paths`). The
    guessing rules (Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training
    Run", Theorem 3.1) are tried on all canaries together (``guess_fractions``) and, with more
    than one path, on each path's canaries alone (``path_guess_fractions``): a path whose clipping
    is broken separates its own canaries even when they are a small part of all of them. The
    rules on all canaries share β/2 and the per-path rules the other β/2 (all of β with one
    path), so the best bound holds at confidence 1 − β."""
    from dataclasses import replace

    from .bound import epsilon_ceiling, epsilon_lower_bound, union_bounds
    from .config import PathResult
    from .scores import canary_scores, guess_outcomes
    from .training import observe_training

    config = replace(config or AuditConfig(), **overrides).validate()
    start = time.perf_counter()
    names = config.path_names
    sigma, eps_claimed, q = claimed_noise(config)
    run_sigma, run_r = _run_settings(config, sigma)

    setup = build_audit(config, run_r)
    canary_set, others, split = setup.linear, setup.others, setup.split
    obs = observe_training(setup.model, setup.dataset, canary_set,
                           batch_size=config.logical_batch_size,
                           steps=config.steps, noise_multiplier=run_sigma, max_grad_norm=run_r,
                           unit=config.max_grad_norm, delta=config.delta,
                           accountant=config.accountant, lr=config.lr,
                           progress=config.progress, paths=others, door=config.door,
                           clipping_mode=config.clipping_mode)

    scores = canary_scores(obs.y, config.score, q, sigma)
    included = np.concatenate(([canary_set.included.numpy()] if canary_set is not None else [])
                              + [p.included.numpy() for p in others])
    pooled = [(config.canaries, kp, km, v, "all")
              for kp, km, v in guess_outcomes(scores, included, config.guess_fractions,
                                              config.seed)]
    spans, at = [], 0
    for name in names:
        spans.append((name, slice(at, at + split[name])))
        at += split[name]
    per_path = []
    if len(names) > 1:
        for name, span in spans:
            per_path += [(split[name], kp, km, v, name)
                         for kp, km, v in guess_outcomes(scores[span], included[span],
                                                         config.path_guess_fractions,
                                                         config.seed)]
    beta = 1.0 - config.confidence
    bounds = union_bounds([pooled, per_path], config.delta, beta)
    best = max(bounds, key=lambda g: (g.epsilon_lower, g.label == "all", g.correct))

    def ceiling(label):
        mine = [g for g in bounds if g.label == label]
        return epsilon_ceiling(max(g.guesses for g in mine), mine[0].beta)

    def reach(label):
        return max(epsilon_lower_bound(g.canaries, g.guesses, g.guesses, config.delta, g.beta)
                   for g in bounds if g.label == label)

    path_results = []
    if len(names) > 1:
        for name, span in spans:
            mine = max((g for g in bounds if g.label == name),
                       key=lambda g: (g.epsilon_lower, g.correct))
            path_results.append(PathResult(
                path=name, canaries=split[name], included=int(included[span].sum()),
                epsilon_lower=mine.epsilon_lower, guesses=mine.guesses, correct=mine.correct,
                k_plus=mine.k_plus, k_minus=mine.k_minus, epsilon_reach=reach(name)))
    verdict = VERDICT_VIOLATION if best.epsilon_lower > eps_claimed else VERDICT_OK
    return AuditResult(
        epsilon_lower=best.epsilon_lower, epsilon_claimed=eps_claimed, delta=config.delta,
        confidence=config.confidence, canaries=config.canaries, included=int(included.sum()),
        guesses=best.guesses, correct=best.correct, k_plus=best.k_plus, k_minus=best.k_minus,
        verdict=verdict, epsilon_ceiling=ceiling("all"), control=config.control,
        control_factor=config.control_factor, noise_multiplier=sigma,
        max_grad_norm=config.max_grad_norm, run_noise_multiplier=run_sigma,
        run_max_grad_norm=run_r, sample_rate=q, steps=config.steps, score=config.score,
        directions=config.directions, first_loss=obs.first_loss, last_loss=obs.last_loss,
        seconds=time.perf_counter() - start, scores=np.asarray(scores).tolist(),
        inclusion=included.astype(bool).tolist(), paths=names, door=config.door,
        clipping_mode=config.clipping_mode, rule=best.label, rules=len(bounds),
        path_results=path_results)
