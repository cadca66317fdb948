"""``run_audit``: one-run empirical privacy audit of the engine (Steinke, Nasr & Jagielski 2023).

Steinke, Nasr & Jagielski (2023), "Privacy Auditing with One (1) Training Run":

1. draw m gradient canaries, each included with probability 1/2
   (:mod:`private_engine.audit.canaries`);
2. train once with the real engine, observing every step (:mod:`private_engine.audit.training`);
3. score each canary and guess "included" for the k₊ highest scores, "excluded" for the k₋
   lowest (:mod:`private_engine.audit.scores`);
4. turn the number of correct guesses into an ε lower bound at confidence 1 − β
   (:mod:`private_engine.audit.bound`, their Theorem 3.1) and compare it with the ε the
   accountant claims.

A correct implementation gives ``ε_lower ≤ ε_claimed`` except with probability β; the positive
controls (``control="noise_scaled"`` or ``"clip_scaled"``) run the same engine 100× less private
than claimed and must be flagged.
"""
from __future__ import annotations

import time
from functools import lru_cache

import numpy as np
import torch

from .config import AuditConfig, AuditResult

__all__ = ["run_audit", "claimed_noise", "VERDICT_OK", "VERDICT_VIOLATION"]

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


def run_audit(config: AuditConfig = None, **overrides) -> AuditResult:
    """Audit the engine once (see the module docstring); ``overrides`` replace fields of
    ``config`` (default :class:`AuditConfig`)."""
    from dataclasses import replace

    from .bound import best_bound, epsilon_ceiling
    from .canaries import CLASSES, FEATURES, build_dataset, draw_canaries, synthetic_data
    from .model import AuditModel
    from .scores import canary_scores, guess_outcomes
    from .training import observe_training

    config = replace(config or AuditConfig(), **overrides).validate()
    start = time.perf_counter()
    sigma, eps_claimed, q = claimed_noise(config)
    run_sigma, run_r = _run_settings(config, sigma)

    gen = torch.Generator().manual_seed(config.seed)
    canary_set = draw_canaries(config.canaries, config.directions, gen)
    x, y = synthetic_data(config.data_size, gen)
    dataset = build_dataset(x, y, canary_set, canary_weight=config.canary_scale * run_r)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = AuditModel(FEATURES, CLASSES, canary_set.c.shape[1],
                           canary_set.v.shape[1]).double()

    obs = observe_training(model, dataset, canary_set,
                           batch_size=config.logical_batch_size,
                           steps=config.steps, noise_multiplier=run_sigma, max_grad_norm=run_r,
                           unit=config.max_grad_norm, delta=config.delta,
                           accountant=config.accountant, lr=config.lr,
                           progress=config.progress)

    scores = canary_scores(obs.y, config.score, q, sigma)
    included = canary_set.included.numpy()
    outcomes = guess_outcomes(scores, included, config.guess_fractions, config.seed)
    beta = 1.0 - config.confidence
    best = best_bound(config.canaries, outcomes, config.delta, beta)
    ceiling = epsilon_ceiling(2 * max(k for k, _, _ in outcomes), beta / len(outcomes))
    verdict = VERDICT_VIOLATION if best.epsilon_lower > eps_claimed else VERDICT_OK
    return AuditResult(
        epsilon_lower=best.epsilon_lower, epsilon_claimed=eps_claimed, delta=config.delta,
        confidence=config.confidence, canaries=config.canaries, included=int(included.sum()),
        guesses=best.guesses, correct=best.correct, k_plus=best.k_plus, k_minus=best.k_minus,
        verdict=verdict, epsilon_ceiling=ceiling, control=config.control,
        control_factor=config.control_factor, noise_multiplier=sigma,
        max_grad_norm=config.max_grad_norm, run_noise_multiplier=run_sigma,
        run_max_grad_norm=run_r, sample_rate=q, steps=config.steps, score=config.score,
        directions=config.directions, first_loss=obs.first_loss, last_loss=obs.last_loss,
        seconds=time.perf_counter() - start, scores=np.asarray(scores).tolist(),
        inclusion=included.astype(bool).tolist())
