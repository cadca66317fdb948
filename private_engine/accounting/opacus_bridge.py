"""Thin layer over Opacus' accountants (RDP, PRV, GDP) for DP-SGD style training.

The mechanism is the subsampled Gaussian: each step releases ``Σ_i C_i g_i + N(0, σ²R²I)`` over a
batch sampled at rate ``q = batch_size / sample_size``; the accountant composes ``steps`` of it.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

from opacus.accountants import IAccountant, create_accountant
from opacus.accountants.utils import get_noise_multiplier

ACCOUNTANTS = ("rdp", "prv", "gdp")


def make_accountant(name: str) -> IAccountant:
    """An Opacus accountant by name: "rdp" (Mironov 2017), "prv" (Gopi et al. 2021), "gdp" (Dong et
    al. 2019)."""
    if name not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {name!r}.")
    return create_accountant(mechanism=name)


def steps_for(epochs: Optional[float], steps: Optional[int], sample_rate: float) -> int:
    """Number of steps: given, or ``int(epochs / q)`` as Opacus counts them (at least one, and
    finite: a ValueError says which number to change)."""
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps <= 0:
            raise ValueError(f"steps must be a positive integer, got {steps!r}.")
        return int(steps)
    if epochs is None or not epochs > 0:
        raise ValueError("give epochs (> 0) or steps so that the noise can be calibrated to "
                         "target_epsilon.")
    if not math.isfinite(epochs):
        raise ValueError(f"epochs must be finite, got {epochs!r}: no finite noise gives a finite "
                         "ε for an unbounded number of steps.")
    count = int(epochs / sample_rate)
    if count < 1:
        raise ValueError(
            f"epochs={epochs!r} at sampling rate q={sample_rate:.4g} is {epochs / sample_rate:.3g} "
            "steps, fewer than one: give more epochs, or steps=, or a larger batch_size.")
    return count


def calibrate_noise_multiplier(target_epsilon: float, target_delta: float, sample_rate: float,
                               steps: int, accountant: str = "rdp",
                               epsilon_tolerance: float = 0.01) -> float:
    """The smallest σ (within tolerance) such that ``steps`` subsampled-Gaussian steps at rate q
    spend at most ``target_epsilon`` at ``target_delta`` — Opacus' ``get_noise_multiplier``."""
    if not target_epsilon > 0 or math.isinf(target_epsilon):
        raise ValueError(
            f"target_epsilon must be a positive finite number, got {target_epsilon}.")
    if not 0 < target_delta < 1:
        raise ValueError(f"target_delta must be in (0, 1), got {target_delta}.")
    return get_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta,
                                sample_rate=sample_rate, steps=steps, accountant=accountant,
                                epsilon_tolerance=epsilon_tolerance)


def epsilon_for(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
                accountant: str = "rdp") -> float:
    """ε spent by ``steps`` subsampled-Gaussian steps (σ, q) at δ, by the named Opacus
    accountant."""
    acc = make_accountant(accountant)
    acc.history = [(noise_multiplier, sample_rate, steps)]
    return float(acc.get_epsilon(delta=delta))
