"""A check that the batches actually clipped are the ones the accountant assumes.

The accountant composes steps of the Poisson-subsampled Gaussian at rate ``q = B / n`` (declared
``batch_size`` B, ``sample_size`` n). Under Poisson sampling a logical batch holds
``N_t ~ Binomial(n, q)`` samples, independently from step to step. Two departures are refused,
on the counts only, before the step's noise is added (a refused step releases nothing):

* **the wrong rate.** ``N_t`` has mean ``B`` and variance ``B·(1 − q)``; after k released batches
  the total ``S_k = Σ_t N_t`` has mean ``k·B`` and standard deviation ``(k·B·(1 − q))^{1/2}``. A
  total off by more than ``z`` standard deviations (z = 7: a false alarm about once in 10¹¹
  checks) plus one sample contradicts the declared rate — e.g. batches of 256 stepped by an
  engine told 8 would report ε ≈ 0.6 where ≈ 2.8 was spent.
* **fixed-size batches.** A ``DataLoader(batch_size=B)`` (shuffled or not) gives batches of
  exactly B samples, and the Poisson accountant's ε does not hold for them: a shuffled epoch is
  neither Poisson sampling nor sampling without replacement at every step, and its privacy can be
  much worse than the Poisson ε at the same q (Chua et al. 2024, "How Private are DP-SGD
  Implementations?"; Chua et al. 2024, "Scalable DP-SGD: Shuffling vs. Poisson Subsampling").
  Under Poisson sampling a batch holds exactly B samples with probability
  ``p₀ = C(n, B)·q^B·(1 − q)^{n−B}``, independently at each step, so the number E_k of such
  batches among k is ``Binomial(k, p₀)``; ``P(Binomial(k, p₀) ≥ E_k) < 10⁻¹¹`` refuses the step
  (batches all of size B are refused after ``⌈log 10⁻¹¹ / log p₀⌉`` steps: 7 at B = 256,
  n = 50 000; 13 at B = 10, n = 200). With ``q = 1`` every batch is the whole data set under
  either sampling, and nothing is refused.
* **sizes without Poisson spread.** The same count for the batches within ``±d`` of B:
  ``P(|N_t − B| ≤ d) = p_d`` under Poisson sampling, and ``P(Binomial(k, p_d) ≥ E_k(d))`` below
  ``10⁻¹¹`` divided by the number of bands refuses the step, for ``d`` in a few bands up to the
  standard deviation ``(B·(1 − q))^{1/2}`` (those with ``p_d ≤ 0.95``). A loader whose sizes vary
  less than Poisson sampling's (batches of 5 and 3 in turn for B = 4, a token-budget batcher) is
  refused after a few dozen steps (48 at B = 4, n = 40).
"""
from __future__ import annotations

import math

from scipy.special import bdtrc
from scipy.stats import binom


class SamplingRateError(ValueError):
    """The samples clipped per logical batch contradict Poisson sampling at the declared
    batch_size (nothing was updated)."""


class SamplingRateCheck:
    """Running counts of the samples in released logical batches against ``batch_size``.

    ``enabled=False`` (the engine's ``check_sampling=False``) keeps the counts for the report and
    refuses nothing: ε then assumes Poisson sampling at ``q`` whatever the batches were."""

    #: standard deviations of the total allowed before a step is refused
    Z = 7.0
    #: the tail probability of the count of batches of exactly B below which a step is refused
    FIXED_SIZE_TAIL = 1e-11

    def __init__(self, batch_size: int, sample_size: int, enabled: bool = True):
        self.batch_size = batch_size
        self.sample_size = sample_size
        self.sample_rate = batch_size / sample_size
        self.enabled = bool(enabled)
        #: half-widths d of the bands |N_t − B| ≤ d checked, with P(|N_t − B| ≤ d) under Poisson
        #: sampling at q: d = 0 (batches of exactly B), then :func:`_bands`
        self.bands = ([(0, float(binom.pmf(batch_size, sample_size, self.sample_rate)))]
                      + _bands(batch_size, sample_size, self.sample_rate))
        self.steps = 0
        self.samples = 0
        #: released logical batches within each band
        self.within = [0] * len(self.bands)

    def check(self, logical_size: int) -> None:
        """Raise :class:`SamplingRateError` if the counts with this logical batch of
        ``logical_size`` samples contradict Poisson sampling at the declared rate."""
        if not self.enabled:
            return
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
        for (d, p), count in zip(self.bands, self.within):
            count += abs(logical_size - self.batch_size) <= d
            # P(Binomial(k, p_d) ≥ count) = bdtrc(count − 1, k, p_d), against FIXED_SIZE_TAIL
            # for d = 0 and FIXED_SIZE_TAIL over the number of bands for each d ≥ 1
            tail = self.FIXED_SIZE_TAIL / (1 if d == 0 else len(self.bands))
            if p < 1 and count and bdtrc(count - 1, k, p) < tail:
                raise SamplingRateError(self._not_poisson(d, p, count, k))

    def _not_poisson(self, d: int, p: float, count: int, k: int) -> str:
        """The refusal's message: ``count`` of ``k`` batches within ±``d`` of B, a band of
        probability ``p`` under Poisson sampling."""
        if d == 0:
            return (
                f"{count} of {k} logical batches held exactly batch_size={self.batch_size} "
                "samples, where Poisson sampling at "
                f"q={self.sample_rate:.4g} gives exactly {self.batch_size} with probability "
                f"{p:.3g}: these are fixed-size batches (a DataLoader "
                "with batch_size=, shuffled or not). The accountant's ε holds for Poisson "
                "sampling only; for a shuffled or fixed-size batching it can be far too small. "
                "Nothing was updated. Sample each batch with "
                "private_engine.data.poisson_loader(dataset, batch_size) (your loader's "
                "collate_fn and num_workers can be passed to it), or, to step batches that "
                "are not Poisson knowingly, build the engine with check_sampling=False: the "
                "ε it reports then assumes Poisson sampling and is not a guarantee for your "
                "batches.")
        return (
            f"{count} of {k} logical batches held between {self.batch_size - d} and "
            f"{self.batch_size + d} samples, where Poisson sampling at "
            f"q={self.sample_rate:.4g} puts a batch there with probability {p:.3g}: the "
            "batch sizes vary less than Poisson sampling's (batches of a size set by "
            "the loader, such as a token budget). The accountant's ε holds for Poisson "
            "sampling only. Nothing was updated. Sample each batch with "
            "private_engine.data.poisson_loader(dataset, batch_size), or build the "
            "engine with check_sampling=False to step these batches knowingly (the ε "
            "it reports is then not a guarantee for them).")

    def commit(self, logical_size: int) -> None:
        """Count a released logical batch."""
        self.steps += 1
        self.samples += logical_size
        for i, (d, _) in enumerate(self.bands):
            self.within[i] += abs(logical_size - self.batch_size) <= d

    @property
    def exact_probability(self) -> float:
        """P(N_t = B) under Poisson sampling at q."""
        return self.bands[0][1]

    @property
    def mean_batch_size(self):
        """Mean samples per released logical batch (None before the first)."""
        return self.samples / self.steps if self.steps else None


def loader_sampling(loader):
    """``(fixed batch size, Poisson rate)`` of a data loader as far as it says: the
    ``batch_size`` of the loader or of its batch sampler (``BatchSampler(sampler, B, ...)``), and
    the ``sample_rate`` of a Poisson batch sampler (Opacus' ``DPDataLoader``,
    :func:`private_engine.data.poisson_loader`); None where it says nothing."""
    sampler = getattr(loader, "batch_sampler", None)
    fixed = getattr(loader, "batch_size", None)
    if fixed is None:
        fixed = getattr(sampler, "batch_size", None)
    return fixed, getattr(sampler, "sample_rate", None)


def check_loader(loader, batch_size: int, sample_size: int, poisson: bool = True) -> None:
    """Refuse, with a ``ValueError`` saying what to change, a data loader that contradicts the
    declared ``batch_size`` B and ``sample_size`` n: a data set whose length is not n (ε is
    computed for ``q = B/n``; another n gives another q and a wrong ε), and, with ``poisson``, a
    loader of fixed-size batches (``loader.batch_size`` set: shuffled or sequential batches of B,
    :class:`SamplingRateError`) or a Poisson sampler (Opacus' ``DPDataLoader``,
    :func:`private_engine.data.poisson_loader`) at a rate other than ``q``; a batch sampler with
    a ``batch_size``, and any loader without a Poisson sampler's ``sample_rate`` (an
    ``IterableDataset``, a custom batch sampler), are refused as well: their sampling cannot be
    told from the loader."""
    dataset = getattr(loader, "dataset", None)
    try:
        length = len(dataset)
    except TypeError:  # an IterableDataset without a length
        length = None
    if length is not None and length != sample_size:
        raise ValueError(
            f"sample_size={sample_size} but the data loader's data set holds {length} examples: "
            f"ε is computed for q = batch_size / sample_size = {batch_size / sample_size:.4g}, "
            f"and these batches are drawn from {length}. Pass sample_size=len(dataset) "
            f"({length}).")
    if not poisson:
        return
    fixed, rate = loader_sampling(loader)
    if fixed is not None:
        raise SamplingRateError(
            f"the data loader gives fixed-size batches (batch_size={fixed}, "
            "shuffled or not), for which the accountant's ε, computed for Poisson sampling, "
            "does not hold: a shuffled epoch can spend much more. Use "
            f"private_engine.data.poisson_loader(dataset, {batch_size}) (each example joins "
            "each batch independently with probability q; collate_fn and num_workers can be "
            "passed to it), or build the engine with check_sampling=False to step these "
            "batches knowingly (the ε reported is then not a guarantee for them).")
    if rate is None:
        raise SamplingRateError(
            "the engine cannot tell how this data loader samples its batches (an IterableDataset "
            "or a batch sampler without a Poisson sample_rate), and the accountant's ε holds "
            "for Poisson sampling only. Use "
            f"private_engine.data.poisson_loader(dataset, {batch_size}) or Opacus' "
            "DPDataLoader, leave data_loader= out (the batch sizes are then checked as they are "
            "stepped), or build the engine with check_sampling=False to step these batches "
            "knowingly (the ε reported is then not a guarantee for them).")
    if not math.isclose(float(rate), batch_size / sample_size, rel_tol=1e-9):
        raise ValueError(
            f"the data loader samples at rate {float(rate):.6g}, the engine accounts for "
            f"q = batch_size / sample_size = {batch_size / sample_size:.6g}: pass the loader's "
            f"expected batch size as batch_size ({float(rate) * sample_size:.6g}).")


def _bands(batch_size: int, sample_size: int, rate: float):
    """``[(d, P(|N − B| ≤ d))]`` for ``N ~ Binomial(n, q)``: half-widths ``d ≥ 1`` at a quarter,
    a half and one standard deviation ``(B·(1 − q))^{1/2}``, those with probability ≤ 0.95."""
    if rate >= 1:
        return []
    sd = math.sqrt(batch_size * (1 - rate))
    out = []
    for d in sorted({max(1, round(f * sd)) for f in (0.25, 0.5, 1.0)}):
        p = float(binom.cdf(batch_size + d, sample_size, rate)
                  - binom.cdf(batch_size - d - 1, sample_size, rate))
        if p <= 0.95:
            out.append((d, p))
    return out
