"""The data side of :class:`~private_engine.integrations.transformers.DPTrainer`: the loader of
its logical batches (Poisson samples at rate ``q = B/n``, or shuffled batches of exactly B), an
empty Poisson batch kept as an empty batch, and a logical batch's split into physical batches.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from ..data import poisson_loader
from ..foundation.randomness import entropy_seeded_generator

__all__ = ["logical_batch_loader", "batch_rows", "physical_batches"]


def logical_batch_loader(dataset: Dataset, batch_size: int, collate_fn: Optional[Callable],
                         *, poisson: bool, distributed: bool, num_workers: int) -> DataLoader:
    """Logical batches of expected size ``B = batch_size``.

    ``poisson=True``: each example joins each batch independently with probability
    ``q = B/n``, drawn from an entropy-seeded generator
    (:func:`private_engine.data.poisson_loader`; ``len = int(1/q)`` per epoch, empty batches
    possible); an empty batch is a batch of 0 rows, or an empty list before the first non-empty
    one (:func:`empty_first_batch_as_list`). With ``distributed`` each rank draws each index of
    its shard with probability q, the union of the ranks' batches being the Poisson logical
    batch. ``poisson=False``: shuffled batches of exactly B (the last incomplete one dropped),
    shuffled by an entropy-seeded generator."""
    if poisson:
        loader = poisson_loader(dataset, batch_size, collate_fn=collate_fn,
                                distributed=distributed, num_workers=num_workers)
        empty_first_batch_as_list(loader)
        return loader
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                      collate_fn=collate_fn, generator=entropy_seeded_generator(),
                      num_workers=num_workers)


def empty_first_batch_as_list(loader: DataLoader) -> None:
    """Opacus' loader collates an empty batch as the first non-empty one with 0 rows, or — when
    the first batch drawn is empty — as zero tensors shaped like the data set's first sample,
    which fails for samples that are not tensors (a dict of token lists). An empty list stands
    for that batch instead; :meth:`DPTrainer.training_step` takes it as an empty batch."""
    collate = loader.collate_fn
    if hasattr(collate, "sample_empty_shapes") and hasattr(collate, "dtypes"):
        collate.sample_empty_shapes = None
        collate.dtypes = None


def batch_rows(inputs: Mapping) -> int:
    """The batch's size: the leading size of its first tensor (0 if it holds none)."""
    for v in inputs.values():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.shape[0]
    return 0


def physical_batches(inputs: Mapping, size: int) -> List[Dict[str, Any]]:
    """The logical batch ``inputs`` split into physical batches of ``size`` rows (every tensor of
    the batch's leading size, :func:`batch_rows`, is split; other values are shared)."""
    n = batch_rows(inputs)
    return [{k: (v[s:s + size] if isinstance(v, torch.Tensor) and v.dim() > 0
                 and v.shape[0] == n else v) for k, v in inputs.items()}
            for s in range(0, n, size)]
