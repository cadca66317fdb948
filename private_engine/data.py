"""Batching for DP training.

* ``poisson_loader``: Opacus' ``DPDataLoader`` (Poisson sampling at rate q = B/n, the sampling
  the accountants assume; empty batches possible), drawn from a generator seeded from OS entropy.
* ``physical_chunks``: split a logical batch into physical batches for gradient accumulation.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader

from .optim.noise import entropy_seeded_generator


def poisson_loader(dataset, batch_size: int, generator: Optional[torch.Generator] = None,
                   **loader_kwargs) -> DataLoader:
    """Opacus' Poisson-sampling loader: each example joins each batch independently with
    probability exactly ``q = batch_size / len(dataset)`` (the rate the engine accounts for);
    ``len(loader) = int(1/q)`` batches per epoch, empty batches possible. ``loader_kwargs``
    (e.g. ``num_workers``) go to the ``DataLoader``.

    Privacy amplification by subsampling assumes that the batch membership is secret, so by
    default (``generator=None``) the batches are drawn from
    :func:`private_engine.optim.noise.entropy_seeded_generator` (a CPU generator whose state comes
    from OS entropy), never from torch's global generator, which scripts seed publicly with
    ``torch.manual_seed``. A ``generator`` given is used as is: a seeded one makes the batches
    reproducible, hence known to anyone who knows the seed (tests, debugging).
    """
    from opacus.data_loader import DPDataLoader

    if generator is None:
        generator = entropy_seeded_generator()
    return DPDataLoader(dataset, sample_rate=batch_size / len(dataset), generator=generator,
                        **loader_kwargs)


def physical_chunks(tensors: Sequence[torch.Tensor],
                    max_physical: int) -> Iterator[Tuple[torch.Tensor, ...]]:
    """Consecutive slices of at most ``max_physical`` samples of batch-first ``tensors``."""
    n = tensors[0].shape[0]
    for start in range(0, n, max_physical):
        yield tuple(t[start:start + max_physical] for t in tensors)
