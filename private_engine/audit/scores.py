"""Canary scores from the per-step observations, and the top-k₊ / bottom-k₋ guesses.

With ``y_{t,i} ~ N(b_{t,i}, σ²)``, ``b_{t,i} = 1`` with probability q if canary i is included
and 0 otherwise (:mod:`private_engine.audit.training`), the Neyman–Pearson statistic for
"included" against "excluded" is the log-likelihood ratio of the mixture, summed over steps:

    likelihood:  s_i = Σ_t log(1 − q + q·exp((y_{t,i} − 1/2)/σ²))

(σ the claimed noise multiplier: a fixed statistic, whatever the run did). ``sum``:
``s_i = Σ_t y_{t,i}``, the final model's ``⟨θ₀ − θ_T, u_i⟩`` — the same at q = 1. Any statistic
gives a valid bound; a better one gives a higher bound.

Guesses (Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run"): "included"
for the k₊ highest scores, "excluded" for the k₋ lowest, abstain on the rest; ties are broken by
a seeded random order.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import numpy as np
import torch

__all__ = ["canary_scores", "guess_outcomes"]


def canary_scores(y: torch.Tensor, score: str, sample_rate: float,
                  noise_multiplier: float) -> np.ndarray:
    """One score per canary from the observations ``y`` (steps × m)."""
    if score == "sum":
        return y.sum(0).numpy()
    if score != "likelihood":
        raise ValueError(f"unknown score {score!r}.")
    z = (y - 0.5) / noise_multiplier ** 2
    if sample_rate >= 1:
        return z.sum(0).numpy()
    per_step = torch.logaddexp(torch.full_like(z, math.log1p(-sample_rate)),
                               math.log(sample_rate) + z)
    return per_step.sum(0).numpy()


def guess_outcomes(scores: np.ndarray, included: np.ndarray, fractions: Sequence[float],
                   seed: int) -> List[Tuple[int, int, int]]:
    """``(k₊, k₋, correct)`` for ``k₊ = k₋ = max(1, round(f·m))``, each fraction f (duplicates
    removed)."""
    m = len(scores)
    tie = np.random.default_rng(seed).permutation(m)
    order = np.lexsort((tie, scores))  # ascending score, ties in random order
    inc = np.asarray(included, dtype=bool)[order]
    ks = sorted({min(max(1, round(f * m)), m // 2) for f in fractions} - {0})
    return [(k, k, int(inc[m - k:].sum() + (~inc[:k]).sum())) for k in ks]
