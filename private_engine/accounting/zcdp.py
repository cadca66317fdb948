"""Zero-concentrated DP (zCDP) for the feature heads: ρ of Gaussian mechanisms, composition,
conversion to (ε, δ)-DP and calibration of σ from a target ε.

Definitions (Bun & Steinke 2016)
--------------------------------
* A mechanism is ρ-zCDP if its Rényi divergence of every order α > 1 between neighbouring
  datasets is at most ``ρ·α`` — i.e. it is (α, ρα)-RDP for all α (Mironov 2017).
* The Gaussian mechanism ``f(D) + N(0, s²I)`` with L2 sensitivity Δ is ``Δ²/(2s²)``-zCDP
  (Prop. 1.6). With ``s = σ·Δ`` (σ is the *noise multiplier*) this is ``1/(2σ²)``.
* zCDP composes additively, also adaptively (Lemma 2.3): ``ρ = Σ_i ρ_i`` for heterogeneous
  Gaussians ``Δ_i, s_i``.

Conversions to (ε, δ)  — ``rho_to_epsilon(rho, delta, method)``
---------------------------------------------------------------
``"rdp"`` (default)
    ρ-zCDP ⇒ (α, ρα)-RDP for every α, then the improved RDP→DP bound of Balle et al. 2020
    (Thm 21; Canonne, Kamath & Steinke 2020, Prop. 12 is the same bound)::

        ε = min_{α>1}  ρα + log((α−1)/α) − (log δ + log α)/(α−1)

    which is what ``opacus.accountants.analysis.rdp.get_privacy_spent`` evaluates on a grid of
    orders. We start from Opacus' grid answer and refine the order continuously (bounded Brent
    in log(α−1)), so ε(ρ) is a smooth, strictly increasing function of ρ — never above Opacus'
    grid value.
``"classical"``
    ``ε = ρ + 2·sqrt(ρ·log(1/δ))`` (Bun & Steinke 2016, Prop. 1.3): the RDP bound without the
    improvement; looser, closed form. Its inverse is ``ρ = (sqrt(log(1/δ)+ε) − sqrt(log(1/δ)))²``.
``"gdp"``
    Exact, **only for compositions of Gaussian mechanisms** (true for every head in
    ``private_engine.heads``): such a composition is μ-GDP with ``μ = sqrt(2ρ)`` (Dong, Roth & Su
    2022, Cor. 3.3) and its exact privacy profile is the analytic Gaussian one (Balle & Wang 2018,
    Thm 8). Tighter than "rdp"; not valid for a general ρ-zCDP mechanism.

Calibration
-----------
``epsilon_to_rho(epsilon, delta, method)`` finds the largest ρ with ε(ρ) ≤ ε by bisection in
log ρ (ε(ρ) is increasing); ``noise_multiplier_for_epsilon(epsilon, delta, rho_sigma2)`` turns
it into σ for a mechanism whose zCDP is ``ρ = rho_sigma2/σ²`` (e.g. 3/2 for DP-LS).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Iterable, List, Sequence, Tuple

import numpy as np
from scipy.optimize import minimize_scalar

from .analytic_gaussian import gaussian_epsilon

__all__ = [
    "CONVERSIONS", "gaussian_rho", "compose_rho", "rho_to_rdp", "rho_to_epsilon", "epsilon_to_rho",
    "noise_multiplier_for_epsilon", "epsilon_for_noise_multiplier", "GaussianRelease", "ZCDPLedger",
]

CONVERSIONS = ("rdp", "classical", "gdp")

# Orders α = 1 + a for a log-spaced over [1e-4, 1e8]: covers ε from ~1e-4 to ~1e3.
_GRID_A = np.logspace(-4, 8, 481)
_GRID_ORDERS = 1.0 + _GRID_A


def _check_method(method: str) -> str:
    if method not in CONVERSIONS:
        raise ValueError(f"conversion method must be one of {CONVERSIONS}, got {method!r}.")
    return method


def _check_delta(delta: float) -> float:
    if delta is None:
        raise ValueError("delta is required to convert zCDP to (ε, δ)-DP; pass e.g. delta=1e-5 "
                         "(below 1/n).")
    delta = float(delta)
    if not (0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}.")
    return delta


def gaussian_rho(sensitivity: float, noise_std: float, count: int = 1) -> float:
    """zCDP of ``count`` Gaussian mechanisms with L2 sensitivity Δ and noise std s:
    ``count·Δ²/(2s²)``.

    Bun & Steinke 2016, Prop. 1.6 (+ Lemma 2.3 for the count). ``noise_std = 0`` gives ``inf``.
    """
    if sensitivity < 0 or noise_std < 0:
        raise ValueError("sensitivity and noise_std must be ≥ 0.")
    if sensitivity == 0:
        return 0.0
    if noise_std == 0:
        return math.inf
    return count * float(sensitivity) ** 2 / (2.0 * float(noise_std) ** 2)


def compose_rho(rhos: Iterable[float]) -> float:
    """Adaptive composition of zCDP mechanisms: ``ρ = Σ ρ_i`` (Bun & Steinke 2016, Lemma 2.3)."""
    total = 0.0
    for r in rhos:
        if r < 0:
            raise ValueError(f"rho must be ≥ 0, got {r}.")
        total += float(r)
    return total


def rho_to_rdp(rho: float, orders: Sequence[float]) -> np.ndarray:
    """RDP curve of a ρ-zCDP mechanism: ``ε_RDP(α) = ρ·α`` (Bun & Steinke 2016, Def. 1.1)."""
    orders = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    if np.any(orders <= 1):
        raise ValueError("RDP orders must be > 1.")
    return float(rho) * orders


def _rdp_eps_at(a: float, rho: float, log_delta: float) -> float:
    """Balle et al. 2020 Thm 21 at α = 1 + a (the formula Opacus' get_privacy_spent uses)."""
    alpha = 1.0 + a
    return rho * alpha + math.log(a / alpha) - (log_delta + math.log(alpha)) / a


def _rdp_epsilon(rho: float, delta: float) -> Tuple[float, float]:
    from .opacus_bridge import rdp_analysis

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps_grid, best = rdp_analysis.get_privacy_spent(
            orders=_GRID_ORDERS, rdp=rho_to_rdp(rho, _GRID_ORDERS), delta=delta)
    i = int(np.searchsorted(_GRID_ORDERS, best))
    lo = math.log(_GRID_A[max(i - 1, 0)])
    hi = math.log(_GRID_A[min(i + 1, len(_GRID_A) - 1)])
    log_delta = math.log(delta)
    res = minimize_scalar(lambda t: _rdp_eps_at(math.exp(t), rho, log_delta), bounds=(lo, hi),
                          method="bounded", options={"xatol": 1e-10})
    eps = min(float(res.fun), float(eps_grid))
    order = 1.0 + math.exp(res.x) if res.fun <= eps_grid else float(best)
    return max(eps, 0.0), order


def rho_to_epsilon(rho: float, delta: float, method: str = "rdp") -> float:
    """ε such that a ρ-zCDP mechanism is (ε, δ)-DP (see module docstring for the three methods).

    ``"rdp"``: ``min_α ρα + log((α−1)/α) − (log δ + log α)/(α−1)`` (Balle et al. 2020, Thm 21);
    ``"classical"``: ``ρ + 2 sqrt(ρ log(1/δ))`` (Bun & Steinke 2016, Prop. 1.3);
    ``"gdp"``: exact profile of a composition of Gaussians, μ = sqrt(2ρ) (Balle & Wang 2018,
    Thm 8).
    ``rho = inf`` gives ``inf``; ``rho = 0`` gives 0.
    """
    _check_method(method)
    delta = _check_delta(delta)
    rho = float(rho)
    if rho < 0:
        raise ValueError(f"rho must be ≥ 0, got {rho}.")
    if math.isinf(rho):
        return math.inf
    if rho == 0:
        return 0.0
    if method == "classical":
        return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))
    if method == "gdp":
        return gaussian_epsilon(delta, noise_std=1.0, sensitivity=math.sqrt(2.0 * rho))
    return _rdp_epsilon(rho, delta)[0]


def epsilon_to_rho(epsilon: float, delta: float, method: str = "rdp", rtol: float = 1e-10) -> float:
    """Largest ρ whose ε(ρ, δ) (by ``method``) does not exceed ``epsilon`` — bisection in log ρ.

    ε(ρ) is strictly increasing in ρ for every method, so bisection converges; the returned ρ is
    the lower end of the final bracket (ε(ρ) ≤ epsilon) and |ε(ρ) − epsilon| ≤ 1e-6·epsilon is
    checked. ``epsilon = inf`` gives ``inf``.
    """
    _check_method(method)
    delta = _check_delta(delta)
    if epsilon is None or not (epsilon > 0):
        raise ValueError(f"epsilon must be > 0, got {epsilon!r}.")
    if math.isinf(epsilon):
        return math.inf
    f = lambda r: rho_to_epsilon(r, delta, method)  # noqa: E731
    lo, hi = 1e-3, 1e-3
    while f(lo) > epsilon:
        lo /= 16.0
        if lo < 1e-300:
            raise ValueError(f"no ρ > 0 reaches epsilon={epsilon} at delta={delta}.")
    while f(hi) <= epsilon:
        hi *= 16.0
        if hi > 1e300:
            raise ValueError(f"epsilon={epsilon} is too large to calibrate.")
    for _ in range(300):
        mid = math.sqrt(lo * hi)
        if f(mid) <= epsilon:
            lo = mid
        else:
            hi = mid
        if hi / lo - 1.0 <= rtol:
            break
    achieved = f(lo)
    if abs(achieved - epsilon) > 1e-6 * epsilon:  # pragma: no cover - a bug guard
        raise RuntimeError(f"calibration failed: target ε={epsilon}, reached {achieved}.")
    return lo


def noise_multiplier_for_epsilon(epsilon: float, delta: float, rho_sigma2: float,
                                 method: str = "rdp") -> float:
    """σ for a mechanism that is ``(rho_sigma2/σ²)``-zCDP to be (ε, δ)-DP:
    ``σ = sqrt(rho_sigma2/ρ*)``.

    ``ρ* = epsilon_to_rho(epsilon, delta, method)``; e.g. ``rho_sigma2 = 3/2`` for DP-LS
    (Mehta, Krichene, Thakurta, Kurakin & Cutkosky, "Differentially Private Image Classification
    from Features", Thm 2.2), ``T`` for DP-Newton (Thm 2.1), ``(T+1)/2`` for DP-FC (Thm 2.3).
    ``epsilon = inf`` gives σ = 0.
    """
    if rho_sigma2 <= 0:
        raise ValueError(f"rho_sigma2 must be > 0, got {rho_sigma2}.")
    rho = epsilon_to_rho(epsilon, delta, method)
    if math.isinf(rho):
        return 0.0
    return math.sqrt(rho_sigma2 / rho)


def epsilon_for_noise_multiplier(noise_multiplier: float, delta: float, rho_sigma2: float,
                                 method: str = "rdp") -> float:
    """ε spent by a ``(rho_sigma2/σ²)``-zCDP mechanism at noise multiplier σ (inverse of the
    above)."""
    if noise_multiplier < 0:
        raise ValueError(f"noise_multiplier must be ≥ 0, got {noise_multiplier}.")
    rho = math.inf if noise_multiplier == 0 else rho_sigma2 / noise_multiplier ** 2
    return rho_to_epsilon(rho, delta, method)


@dataclass(frozen=True)
class GaussianRelease:
    """One Gaussian release: ``count`` mechanisms, each with L2 sensitivity and noise std as given.

    ``rho = count·sensitivity²/(2·noise_std²)`` (Bun & Steinke 2016, Prop. 1.6).
    """

    name: str
    sensitivity: float
    noise_std: float
    count: int = 1
    shape: Tuple[int, ...] = ()

    @property
    def rho(self) -> float:
        return gaussian_rho(self.sensitivity, self.noise_std, self.count)

    @property
    def noise_multiplier(self) -> float:
        return self.noise_std / self.sensitivity if self.sensitivity else math.inf


@dataclass
class ZCDPLedger:
    """A record of every Gaussian release a fit made; ρ is their sum (adaptive composition).

    The heads derive their reported privacy from this ledger, i.e. from what was actually
    released, and check it against their theorem's closed form.
    """

    releases: List[GaussianRelease] = field(default_factory=list)

    def add(self, name: str, sensitivity: float, noise_std: float, count: int = 1,
            shape: Tuple[int, ...] = ()) -> GaussianRelease:
        """Record ``count`` Gaussian mechanisms of L2 sensitivity ``sensitivity`` and noise std
        ``noise_std``."""
        rel = GaussianRelease(name, float(sensitivity), float(noise_std), int(count), tuple(shape))
        self.releases.append(rel)
        return rel

    @property
    def rho(self) -> float:
        """Total zCDP: the sum of the releases' ρ (adaptive composition)."""
        return compose_rho(r.rho for r in self.releases)

    def epsilon(self, delta: float, method: str = "rdp") -> float:
        """ε of the composed releases at ``delta``: :func:`rho_to_epsilon` of the summed ρ."""
        return rho_to_epsilon(self.rho, delta, method)

    def summary(self) -> str:
        """A table of the releases (count, sensitivity, noise std, ρ) and the total ρ."""
        lines = [f"{'release':<24}{'count':>7}{'sensitivity':>14}{'noise std':>14}{'rho':>12}"]
        for r in self.releases:
            lines.append(f"{r.name:<24}{r.count:>7}{r.sensitivity:>14.4g}"
                         f"{r.noise_std:>14.4g}{r.rho:>12.4g}")
        lines.append(f"{'total':<24}{'':>7}{'':>14}{'':>14}{self.rho:>12.4g}")
        return "\n".join(lines)
