"""The ε lower bound of one-run privacy auditing (Steinke, Nasr & Jagielski 2023).

Steinke, Nasr & Jagielski (2023), "Privacy Auditing with One (1) Training Run", Theorem 3.1:
m canaries are included independently with probability 1/2, ``S ∈ {−1, +1}^m``; from the
output of an (ε, δ)-DP mechanism an auditor makes r guesses ``T_i ∈ {−1, +1}`` (and abstains on
the other m − r canaries). The number of correct guesses ``W = Σ_i max(0, T_i·S_i)`` satisfies,
for every v,

    P[W ≥ v] ≤ f(v) + 2·m·δ·max_{1≤i≤v} (f(v − i) − f(v)) / i,
    f(u) = P[Binomial(r, p) ≥ u],      p = e^ε / (1 + e^ε),

i.e. each guess is right at most as often as ε-randomized response, up to δ. The right-hand
side is the p-value of the hypothesis "the mechanism is (ε, δ)-DP" after v correct guesses;
the hypothesis is rejected at confidence 1 − β when it is ≤ β. The reported lower bound is the
first ε at which it is no longer rejected,

    ε_lower = inf { ε ≥ 0 : pvalue(ε) > β },

so every ε below ε_lower is rejected (the p-value is not assumed monotone in ε: a grid scan
finds the first crossing, then bisection). With δ = 0 and every guess right (v = r) the bound
is closed form: ``p^r = β``, ``ε_lower = log(p / (1 − p))`` with ``p = β^{1/r}``.

Several guess counts tried on the same scores (top k₊ / bottom k₋ for a few pairs) are
combined by a union bound: each pair is tested at ``β / J`` for J pairs (:func:`best_bound`).
Rules may also guess on different subsets of the canaries — all of them, or one clipping path's
alone — each with the theorem for its own subset of m' canaries (the other canaries' inclusion
is independent randomness of the mechanism, which keeps it (ε, δ)-DP in each of the m'); the
levels of all rules add up to β (:func:`union_bounds`: β/2 for the rules on all canaries, β/2
shared by the per-path rules).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np
from scipy import optimize, special, stats

__all__ = ["p_value", "epsilon_lower_bound", "epsilon_ceiling", "best_bound", "union_bounds",
           "GuessBound"]

#: ε above which the search stops (p = e^ε/(1+e^ε) is 1 to double precision beyond ≈ 37)
EPSILON_MAX = 30.0
#: grid step of the scan for the first crossing of β
GRID_STEP = 0.05


def _check(m: int, r: int, v: int, delta: float) -> None:
    if not (0 <= v <= r <= m):
        raise ValueError(f"need 0 ≤ correct ≤ guesses ≤ canaries, got v={v}, r={r}, m={m}.")
    if not 0 <= delta <= 1:
        raise ValueError(f"delta must be in [0, 1], got {delta}.")


def p_value(m: int, r: int, v: int, epsilon: float, delta: float = 0.0) -> float:
    """The p-value of "(ε, δ)-DP" after v correct guesses out of r on m canaries (Theorem 3.1
    of Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run"):
    ``min(1, f(v) + 2mδ·max_{1≤i≤v} (f(v−i) − f(v))/i)`` with ``f(u) = P[Binomial(r, p) ≥ u]``,
    ``p = e^ε/(1+e^ε)``."""
    _check(m, r, v, delta)
    if epsilon < 0:
        raise ValueError(f"epsilon must be ≥ 0, got {epsilon}.")
    p = float(special.expit(epsilon))
    tail = float(stats.binom.sf(v - 1, r, p))  # f(v) = P[Bin(r, p) ≥ v]
    if delta == 0.0 or v == 0:
        return min(1.0, tail)
    # f(v − i) − f(v) = P[v − i ≤ Bin < v] = Σ_{j=1..i} pmf(v − j), i = 1..v
    window = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, p))
    alpha = float(np.max(window / np.arange(1, v + 1)))
    return min(1.0, tail + 2.0 * m * delta * alpha)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float = 0.0,
                        beta: float = 0.05) -> float:
    """ε_lower = inf{ε ≥ 0 : pvalue(ε) > β}: every (ε, δ) with ε < ε_lower is rejected at
    confidence 1 − β after v correct guesses out of r on m canaries (0 when even ε = 0 is not
    rejected). :func:`p_value` gives the test; a grid of step ``GRID_STEP`` finds the first ε
    where it exceeds β and bisection (``scipy.optimize.brentq``) the crossing inside it."""
    _check(m, r, v, delta)
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1), got {beta}.")
    if r == 0 or p_value(m, r, v, 0.0, delta) > beta:
        return 0.0
    lo = 0.0
    while lo < EPSILON_MAX:
        hi = min(lo + GRID_STEP, EPSILON_MAX)
        if p_value(m, r, v, hi, delta) > beta:
            return float(optimize.brentq(lambda e: p_value(m, r, v, e, delta) - beta, lo, hi,
                                         xtol=1e-10, rtol=1e-12))
        lo = hi
    return EPSILON_MAX


def epsilon_ceiling(r: int, beta: float = 0.05) -> float:
    """The largest bound r guesses can give (δ = 0, all r right): ``max(0, log(p/(1−p)))``,
    ``p = β^{1/r}`` — one run with m canaries cannot certify more than about
    ``log(r / log(1/β))``."""
    if r <= 0:
        return 0.0
    p = beta ** (1.0 / r)
    return max(0.0, math.log(p / (1.0 - p)))


@dataclass(frozen=True)
class GuessBound:
    """The bound of one guessing rule: ``k_plus`` "included" and ``k_minus`` "excluded" guesses,
    ``correct`` of them right, tested at ``beta``; ``canaries``: the m of its theorem (0: not
    recorded); ``label``: which canaries it guessed on."""

    k_plus: int
    k_minus: int
    correct: int
    beta: float
    epsilon_lower: float
    canaries: int = 0
    label: str = ""

    @property
    def guesses(self) -> int:
        return self.k_plus + self.k_minus


def best_bound(m: int, outcomes: Sequence[Tuple[int, int, int]], delta: float,
               beta: float) -> GuessBound:
    """The largest bound over guessing rules ``(k₊, k₋, correct)`` tried on the same run, each
    tested at ``β / J`` (union bound over the J rules: the maximum is valid at confidence
    1 − β)."""
    if not outcomes:
        raise ValueError("no guessing rule given.")
    bounds = union_bounds([[(m, kp, km, v, "") for kp, km, v in outcomes]], delta, beta)
    return max(bounds, key=lambda g: (g.epsilon_lower, g.correct))


def union_bounds(families: Sequence[Sequence[Tuple[int, int, int, int, str]]], delta: float,
                 beta: float) -> List[GuessBound]:
    """The bound of every rule ``(m, k₊, k₋, correct, label)`` — ``k₊ + k₋`` guesses on a set of
    m canaries, ``correct`` of them right — of F families of rules: each family gets ``β / F``,
    shared equally by its rules (Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1)
    Training Run", Theorem 3.1, for each rule's own m; the levels sum to β, so by the union bound
    every bound, hence their maximum, holds at confidence 1 − β). One family of J rules: each at
    ``β / J``."""
    families = [f for f in families if f]
    if not families:
        raise ValueError("no guessing rule given.")
    out = []
    for family in families:
        b = beta / len(families) / len(family)
        out += [GuessBound(kp, km, v, b, epsilon_lower_bound(m, kp + km, v, delta, b), m, label)
                for m, kp, km, v, label in family]
    return out
