"""Batching for DP training.

* ``poisson_loader``: Opacus' ``DPDataLoader`` (Poisson sampling at rate q = B/n, the sampling
  the accountants assume; empty batches possible), drawn from a generator seeded from OS entropy;
  under ``torch.distributed``, each rank samples its shard at rate q
  (:class:`LockstepPoissonSampler`), so the union of the ranks' batches is Poisson at rate q.
* ``physical_chunks``: split a logical batch into physical batches for gradient accumulation.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from opacus.utils.uniform_sampler import DistributedUniformWithReplacementSampler
from torch.utils.data import DataLoader

from .foundation.randomness import entropy_seeded_generator
from .process_group import wants_distributed


class LockstepPoissonSampler(DistributedUniformWithReplacementSampler):
    """Opacus' distributed Poisson sampler, yielding every batch, empty ones included.

    The data set's n indices are split into W shards (a permutation seeded by ``shuffle_seed`` and
    the epoch, public and independent of the data; shard r holds ``n // W`` or one more); at each
    step rank r keeps each index of its shard independently with probability q. Each index of the
    data set therefore joins the global batch ``∪_r S_r`` independently with probability q:
    Poisson sampling at rate q, ``|∪_r S_r| ~ Binomial(n, q)``, what the accountant assumes.

    Opacus' ``DistributedUniformWithReplacementSampler`` skips a rank's empty batch: that rank
    would then pair its later batches with other steps of the other ranks and run out of batches
    first (a rank left waiting in the step's collective), and a batch drawn again until non-empty
    is not Poisson. Here every rank yields exactly ``num_batches`` batches, so the ranks step
    together.
    """

    def __iter__(self) -> Iterator[List[int]]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.shuffle_seed + self.epoch)
            indices = torch.randperm(self.total_size, generator=g)
        else:
            indices = torch.arange(self.total_size)
        indices = indices[self.rank:self.total_size:self.num_replicas]
        for _ in range(self.num_batches):
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            yield indices[mask.nonzero(as_tuple=False).reshape(-1)].tolist()


def poisson_loader(dataset, batch_size: int, generator: Optional[torch.Generator] = None,
                   distributed: Optional[bool] = None, **loader_kwargs) -> DataLoader:
    """Opacus' Poisson-sampling loader: each example joins each batch independently with
    probability exactly ``q = batch_size / len(dataset)`` (the rate the engine accounts for);
    ``len(loader) = int(1/q)`` batches per epoch, empty batches possible. ``loader_kwargs``
    (e.g. ``num_workers``) go to the ``DataLoader``.

    Privacy amplification by subsampling assumes that the batch membership is secret, so by
    default (``generator=None``) the batches are drawn from
    :func:`private_engine.foundation.randomness.entropy_seeded_generator` (a CPU generator whose
    state comes from OS entropy), never from torch's global generator, which scripts seed publicly
    with ``torch.manual_seed``. A ``generator`` given is used as is: a seeded one makes the batches
    reproducible, hence known to anyone who knows the seed (tests, debugging).

    ``distributed`` (None: on under an initialised ``torch.distributed`` group of W > 1 ranks;
    True: requires one; False: off): ``batch_size`` stays the global expected batch B, and each
    rank draws from its own shard of the data set, each index with probability q = B/n
    (:class:`LockstepPoissonSampler`, every batch yielded, empty ones included, so the ranks step
    together): a rank's batch holds about B/W samples and the union of the ranks' batches is
    Poisson at rate q. The default generator is entropy-seeded on each rank, each its own.
    """
    from opacus.data_loader import DPDataLoader

    if generator is None:
        generator = entropy_seeded_generator()
    sample_rate = batch_size / len(dataset)
    if not wants_distributed(distributed, "poisson_loader"):
        return DPDataLoader(dataset, sample_rate=sample_rate, generator=generator,
                            **loader_kwargs)
    loader = DPDataLoader(dataset, sample_rate=sample_rate, generator=generator,
                          distributed=True, **loader_kwargs)
    sampler = LockstepPoissonSampler(total_size=len(dataset), sample_rate=sample_rate,
                                     generator=generator)
    # DataLoader forbids setting batch_sampler after __init__; DPDataLoader builds Opacus' sampler
    # itself, which skips empty batches (see LockstepPoissonSampler): replace it before any use
    object.__setattr__(loader, "batch_sampler", sampler)
    return loader


def physical_chunks(tensors: Sequence[torch.Tensor],
                    max_physical: int) -> Iterator[Tuple[torch.Tensor, ...]]:
    """Consecutive slices of at most ``max_physical`` samples of batch-first ``tensors``."""
    n = tensors[0].shape[0]
    for start in range(0, n, max_physical):
        yield tuple(t[start:start + max_physical] for t in tensors)
