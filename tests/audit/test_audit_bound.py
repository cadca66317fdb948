"""The ε lower bound of one-run auditing (Steinke, Nasr & Jagielski 2023, Theorem 3.1): closed
forms, the theorem's formula computed by brute force, monotonicity and validity."""
import math

import numpy as np
import pytest
from scipy import optimize, stats

from private_engine.audit.bound import best_bound, epsilon_ceiling, epsilon_lower_bound, p_value


def _logit(p):
    return math.log(p / (1 - p))


@pytest.mark.parametrize("r", [1, 5, 20, 100, 1000, 5000])
@pytest.mark.parametrize("beta", [0.05, 0.01])
def test_all_correct_pure_dp_is_closed_form(r, beta):
    # δ = 0, r guesses all right: (e^ε/(1+e^ε))^r = β (no bound when even ε = 0 passes: β^{1/r}
    # < 1/2, r = 1 or, at β = 0.01, r ≤ 6)
    expected = max(0.0, _logit(beta ** (1 / r)))
    got = epsilon_lower_bound(m=r, r=r, v=r, delta=0.0, beta=beta)
    assert got == pytest.approx(expected, abs=1e-8)
    assert epsilon_ceiling(r, beta) == pytest.approx(expected, rel=1e-12)
    if expected > 0:
        p = math.exp(got) / (1 + math.exp(got))
        assert stats.binom.sf(r - 1, r, p) == pytest.approx(beta, rel=1e-6)


@pytest.mark.parametrize("r", [10, 100, 1000])
def test_one_wrong_pure_dp_solves_the_binomial_tail(r):
    # δ = 0, r − 1 right: p^r + r·p^(r−1)·(1 − p) = β
    beta = 0.05
    p = optimize.brentq(lambda p: p ** r + r * p ** (r - 1) * (1 - p) - beta, 0.5, 1 - 1e-15,
                        xtol=1e-15)
    assert epsilon_lower_bound(r, r, r - 1, 0.0, beta) == pytest.approx(_logit(p), abs=1e-7)


def _theorem_brute_force(m, r, v, eps, delta):
    """Theorem 3.1 written out with exact integer binomials: f(v) + 2mδ·max_{1≤i≤m}
    (f(v−i) − f(v))/i, f(u) = P[Bin(r, p) ≥ u] (f(u) = 1 for u ≤ 0)."""
    p = math.exp(eps) / (1 + math.exp(eps))

    def f(u):
        if u <= 0:
            return 1.0
        return sum(math.comb(r, j) * p ** j * (1 - p) ** (r - j) for j in range(u, r + 1))

    alpha = max((f(v - i) - f(v)) / i for i in range(1, m + 1))
    return min(1.0, f(v) + 2 * m * delta * alpha)


@pytest.mark.parametrize("m,r,v,eps,delta", [
    (20, 10, 9, 1.0, 1e-3), (30, 20, 15, 0.5, 1e-2), (50, 40, 40, 3.0, 1e-4),
    (12, 12, 6, 0.0, 0.05), (40, 10, 2, 2.0, 1e-3), (25, 20, 0, 1.0, 1e-2),
])
def test_p_value_is_the_theorem(m, r, v, eps, delta):
    assert p_value(m, r, v, eps, delta) == pytest.approx(
        _theorem_brute_force(m, r, v, eps, delta), rel=1e-9, abs=1e-15)


def test_p_value_is_nondecreasing_in_epsilon():
    grid = np.linspace(0, 10, 401)
    for m, r, v, d in [(1000, 800, 800, 1e-5), (1000, 800, 700, 1e-5), (200, 100, 80, 1e-3),
                       (100, 50, 50, 1e-2), (2000, 1600, 1590, 1e-6)]:
        p = np.array([p_value(m, r, v, e, d) for e in grid])
        assert np.all(np.diff(p) >= -1e-15), (m, r, v, d)


def test_bound_is_monotone_in_correct_guesses_delta_and_confidence():
    m, r = 1000, 200
    by_v = [epsilon_lower_bound(m, r, v, 1e-5, 0.05) for v in range(100, r + 1, 10)]
    assert all(a <= b + 1e-12 for a, b in zip(by_v, by_v[1:]))
    assert by_v[0] == 0.0 and by_v[-1] > 3  # half right certifies nothing
    by_delta = [epsilon_lower_bound(m, r, 190, d, 0.05) for d in (0, 1e-7, 1e-5, 1e-4, 1e-3)]
    assert all(a >= b - 1e-12 for a, b in zip(by_delta, by_delta[1:]))
    assert by_delta[-1] < by_delta[0]
    by_beta = [epsilon_lower_bound(m, r, 190, 1e-5, b) for b in (0.001, 0.01, 0.05, 0.2)]
    assert all(a <= b + 1e-12 for a, b in zip(by_beta, by_beta[1:]))


def test_the_bound_rejects_a_true_claim_with_probability_at_most_beta():
    # ε₀-randomized response is (ε₀, δ)-DP for every δ: each of r guesses right with probability
    # e^ε₀/(1+e^ε₀). Exactly, P[ε_lower > ε₀] = Σ_v P[Bin = v]·1[bound(v) > ε₀] ≤ β.
    beta = 0.05
    for eps0, r, m, delta in [(1.0, 200, 1000, 0.0), (2.0, 500, 1000, 1e-5), (0.5, 100, 100, 0.0)]:
        q = math.exp(eps0) / (1 + math.exp(eps0))
        reject = [v for v in range(r + 1) if epsilon_lower_bound(m, r, v, delta, beta) > eps0]
        assert reject, "the test has no power at all"
        assert stats.binom.pmf(reject, r, q).sum() <= beta


def test_best_bound_pays_for_the_number_of_rules():
    one = best_bound(1000, [(400, 400, 800)], 1e-5, 0.05)
    many = best_bound(1000, [(k, k, 2 * k) for k in (10, 50, 100, 400)], 1e-5, 0.05)
    assert many.beta == pytest.approx(0.05 / 4) and one.beta == 0.05
    assert (many.k_plus, many.guesses, many.correct) == (400, 800, 800)
    assert many.epsilon_lower < one.epsilon_lower
    assert many.epsilon_lower == pytest.approx(epsilon_lower_bound(1000, 800, 800, 1e-5, 0.0125))


def test_degenerate_inputs():
    assert epsilon_lower_bound(10, 0, 0) == 0.0
    assert epsilon_lower_bound(100, 50, 25, 0.0, 0.05) == 0.0
    with pytest.raises(ValueError):
        p_value(10, 5, 6, 1.0)
    with pytest.raises(ValueError):
        epsilon_lower_bound(10, 5, 5, 0.0, beta=0)


def test_union_bounds_share_beta_between_families():
    from private_engine.audit.bound import union_bounds

    pooled = [(1000, k, k, 2 * k, "all") for k in (10, 100, 400)]
    per_path = [(100, k, k, 2 * k, name) for name in ("a", "b") for k in (20, 40)]
    bounds = union_bounds([pooled, per_path], 1e-5, 0.05)
    levels = {g.label: g.beta for g in bounds}
    assert levels["all"] == pytest.approx(0.05 / 2 / 3) and levels["a"] == pytest.approx(0.05 / 8)
    assert sum(g.beta for g in bounds) == pytest.approx(0.05)  # the union bound's levels
    assert all(g.epsilon_lower == pytest.approx(epsilon_lower_bound(g.canaries, g.guesses,
                                                                    g.correct, 1e-5, g.beta))
               for g in bounds)
    # one family (or an empty second one): every rule at β / J, as best_bound
    alone = union_bounds([pooled, []], 1e-5, 0.05)
    assert max(g.epsilon_lower for g in alone) == \
        best_bound(1000, [r[1:4] for r in pooled], 1e-5, 0.05).epsilon_lower
