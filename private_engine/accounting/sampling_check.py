"""A check that the batches actually clipped are the ones the accountant assumes.

The accountant composes steps of the Poisson-subsampled Gaussian at rate ``q = B / n`` (declared
``batch_size`` B, ``sample_size`` n). Under Poisson sampling a logical batch holds
``N_t ~ Binomial(n, q)`` samples: mean ``B``, variance ``B·(1 − q)``; a fixed batch holds B. After
k released batches the total ``S_k = Σ_t N_t`` has mean ``k·B`` and standard deviation
``(k·B·(1 − q))^{1/2}``; a total off by more than ``z`` standard deviations (z = 7: a false
alarm about once in 10¹¹ checks) plus one sample contradicts the declared rate — e.g. batches of
256 stepped by an engine told 8 would report ε ≈ 0.6 where ≈ 2.8 was spent. The check is on the
counts only, before the step's noise is added, so a refused step releases nothing.
"""
from __future__ import annotations

import math


class SamplingRateError(ValueError):
    """The samples clipped per logical batch contradict the declared batch_size (nothing was
    updated)."""


class SamplingRateCheck:
    """Running count of the samples in released logical batches against ``batch_size``."""

    #: standard deviations of the total allowed before a step is refused
    Z = 7.0

    def __init__(self, batch_size: int, sample_size: int):
        self.batch_size = batch_size
        self.sample_rate = batch_size / sample_size
        self.steps = 0
        self.samples = 0

    def check(self, logical_size: int) -> None:
        """Raise :class:`SamplingRateError` if the totals with this logical batch of
        ``logical_size`` samples contradict the declared rate."""
        k = self.steps + 1
        total = self.samples + logical_size
        expected = k * self.batch_size
        allowed = self.Z * math.sqrt(k * self.batch_size * (1 - self.sample_rate)) + 1
        if abs(total - expected) > allowed:
            mean = total / k
            raise SamplingRateError(
                f"{total} samples were clipped in {k} logical batch(es), {mean:.1f} per batch, "
                f"where batch_size={self.batch_size} declares {self.batch_size} on average "
                f"(Poisson sampling explains ±{allowed / k:.1f} per batch): ε would be computed "
                f"for the wrong sampling rate q={self.sample_rate:.4g}. Nothing was updated. "
                "Declare the logical batch size you step (batch_size=, with sample_size= the "
                "number of training examples), or sample at that rate "
                "(private_engine.data.poisson_loader(dataset, batch_size)).")

    def commit(self, logical_size: int) -> None:
        """Count a released logical batch."""
        self.steps += 1
        self.samples += logical_size

    @property
    def mean_batch_size(self):
        """Mean samples per released logical batch (None before the first)."""
        return self.samples / self.steps if self.steps else None
