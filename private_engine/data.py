"""Data the project can use without any download, and batching helpers for DP training.

* ``load_digits_images``: the UCI handwritten digits (1,797 8×8 images, 10 classes) shipped
  inside scikit-learn, resized to any image size and channel count.
* ``poisson_loader``: Opacus' ``DPDataLoader`` (Poisson sampling at rate q = B/n, the sampling
  the accountants assume; empty batches possible), drawn from a generator seeded from OS entropy.
* ``physical_chunks``: split a logical batch into physical batches for gradient accumulation.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from .noise import entropy_seeded_generator


def load_digits_images(image_size: int = 32, channels: int = 3, test_fraction: float = 0.2, seed: int = 0,
                       normalize: bool = True) -> Tuple[TensorDataset, TensorDataset]:
    """Train/test ``TensorDataset`` s of scikit-learn's digits, as ``(N, channels, size, size)`` floats.

    Pixels (0..16) are scaled to [0, 1], resized bilinearly, repeated over channels and (with
    ``normalize``) mapped to [-1, 1] by the fixed ``(x − 0.5)/0.5`` — a data-independent scaling,
    so no statistic of the private training set leaks outside the privacy accounting. The split
    is a seeded permutation.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    if image_size != 8:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    x = x.repeat(1, channels, 1, 1)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(y), generator=g)
    n_test = int(round(test_fraction * len(y)))
    test_idx, train_idx = perm[:n_test], perm[n_test:]
    if normalize:
        x = (x - 0.5) / 0.5
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx])


def poisson_loader(dataset, batch_size: int, generator: Optional[torch.Generator] = None,
                   **loader_kwargs) -> DataLoader:
    """Opacus' Poisson-sampling loader: each example joins each batch independently with
    probability exactly ``q = batch_size / len(dataset)`` (the rate the engine accounts for);
    ``len(loader) = int(1/q)`` batches per epoch, empty batches possible. ``loader_kwargs``
    (e.g. ``num_workers``) go to the ``DataLoader``.

    Privacy amplification by subsampling assumes that the batch membership is secret, so by
    default (``generator=None``) the batches are drawn from
    :func:`private_engine.noise.entropy_seeded_generator` (a CPU generator whose state comes from
    OS entropy), never from torch's global generator, which scripts seed publicly with
    ``torch.manual_seed``. A ``generator`` given is used as is: a seeded one makes the batches
    reproducible, hence known to anyone who knows the seed (tests, debugging).
    """
    from opacus.data_loader import DPDataLoader

    if generator is None:
        generator = entropy_seeded_generator()
    return DPDataLoader(dataset, sample_rate=batch_size / len(dataset), generator=generator,
                        **loader_kwargs)


def physical_chunks(tensors: Sequence[torch.Tensor], max_physical: int) -> Iterator[Tuple[torch.Tensor, ...]]:
    """Consecutive slices of at most ``max_physical`` samples of batch-first ``tensors``."""
    n = tensors[0].shape[0]
    for start in range(0, n, max_physical):
        yield tuple(t[start:start + max_physical] for t in tensors)
