"""The UCI handwritten digits (1,797 8×8 images, 10 classes) shipped inside scikit-learn: image
data the demo, the examples and the tests use without any download."""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset


def load_digits_images(image_size: int = 32, channels: int = 3, test_fraction: float = 0.2,
                       seed: int = 0,
                       normalize: bool = True) -> Tuple[TensorDataset, TensorDataset]:
    """Train/test ``TensorDataset`` s of scikit-learn's digits, as ``(N, channels, size, size)``
    floats.

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
