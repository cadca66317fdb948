"""The canaries of an audit: who is included, in which gradient direction, and the data set they
are trained in.

Canary i is a training row whose per-sample loss is ``L_i = s·⟨c_i, W v_i⟩`` on the model's
canary head ``W`` (:class:`private_engine.audit.model.AuditModel`), with unit vectors
``c_i`` (output side) and ``v_i`` (its input). Its gradient, ``s·c_i v_iᵀ``, does not depend on
the parameters and has norm ``s`` far above the clipping norm R, so the engine clips it to
exactly ``R·u_i``, ``u_i = c_i v_iᵀ`` — the gradient canary of Steinke, Nasr & Jagielski (2023),
"Privacy Auditing with One (1) Training Run" (white-box, the strongest setting). The rest of the
data never reaches ``W`` (its canary input is 0), so ``u_i`` is seen only through canaries and
noise.

* ``dirac`` directions: ``v_i``, ``c_i`` one-hot, every canary its own coordinate of ``W``
  (orthonormal ``u_i``).
* ``random`` directions: Gaussian unit ``c_i``, ``v_i`` of a head with at least 16·m
  coordinates (``|⟨u_i, u_j⟩| ≈ 1/√d``: a little cross-talk between canaries).

Each canary is included independently with probability 1/2 (``S_i = ±1``). An excluded canary
stays in the data set as a row whose loss weight is 0: its gradient is 0 and it adds nothing to
any clipped sum, which is exactly its removal for Poisson-sampled DP-SGD (add/remove
neighbours), while the data set size n — hence the sampling rate q = B/n the accountant is
told — does not depend on S.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.data import TensorDataset

__all__ = ["CanarySet", "draw_canaries", "head_shape", "build_dataset", "synthetic_data",
           "RowsDataset", "collate_rows", "FEATURES", "CLASSES"]

#: features and classes of the synthetic non-canary data
FEATURES = 16
CLASSES = 4


def head_shape(canaries: int, directions: str) -> tuple:
    """``(K, D_c)`` of the canary head ``W ∈ R^{K×D_c}``: ``K·D_c ≥ m`` for dirac canaries,
    ``≥ 16·m`` for random ones."""
    if directions == "dirac":
        cols = math.ceil(math.sqrt(canaries))
        return math.ceil(canaries / cols), cols
    side = 4 * math.ceil(math.sqrt(canaries))
    return side, side


@dataclass
class CanarySet:
    """m canaries: ``included`` (bool, m), ``c`` (m × K) and ``v`` (m × D_c) unit rows; for dirac
    canaries ``rows``/``cols`` are the coordinates ``(b_i, a_i)`` of ``W`` they own."""

    included: torch.Tensor
    c: torch.Tensor
    v: torch.Tensor
    directions: str
    rows: torch.Tensor = None
    cols: torch.Tensor = None

    @property
    def m(self) -> int:
        return int(self.included.shape[0])

    def project(self, update: torch.Tensor) -> torch.Tensor:
        """``⟨update, u_i⟩ = c_iᵀ·update·v_i`` for every canary (update: K × D_c)."""
        if self.rows is not None:
            return update[self.rows, self.cols]
        return ((self.c @ update) * self.v).sum(1)


def draw_canaries(canaries: int, directions: str, generator: torch.Generator,
                  dtype=torch.float64) -> CanarySet:
    """Inclusion bits (each 1 with probability 1/2) and unit directions, from ``generator``."""
    included = torch.rand(canaries, generator=generator, dtype=torch.float64) < 0.5
    k, d = head_shape(canaries, directions)
    if directions == "dirac":
        idx = torch.randperm(k * d, generator=generator)[:canaries]
        rows, cols = idx // d, idx % d
        c = torch.zeros(canaries, k, dtype=dtype)
        v = torch.zeros(canaries, d, dtype=dtype)
        c[torch.arange(canaries), rows] = 1
        v[torch.arange(canaries), cols] = 1
        return CanarySet(included, c, v, directions, rows, cols)
    c = torch.randn(canaries, k, generator=generator, dtype=dtype)
    v = torch.randn(canaries, d, generator=generator, dtype=dtype)
    c /= c.norm(dim=1, keepdim=True)
    v /= v.norm(dim=1, keepdim=True)
    return CanarySet(included, c, v, directions)


def synthetic_data(n: int, generator: torch.Generator, dtype=torch.float64):
    """``(x, y)``: n points of a mixture of ``CLASSES`` Gaussians in ``FEATURES`` dimensions."""
    means = 1.5 * torch.randn(CLASSES, FEATURES, generator=generator, dtype=dtype)
    y = torch.randint(0, CLASSES, (n,), generator=generator)
    x = means[y] + torch.randn(n, FEATURES, generator=generator, dtype=dtype)
    return x, y


class RowsDataset(TensorDataset):
    """A ``TensorDataset`` that hands a sampled batch over in one indexing per tensor
    (``__getitems__``, which torch's loader calls with the batch's indices) instead of one row at a
    time: the audit's batches hold tens of thousands of rows. Use with :func:`collate_rows`."""

    def __getitems__(self, indices):
        idx = torch.as_tensor(indices, dtype=torch.long)
        return [t[idx] for t in self.tensors]


def collate_rows(batch):
    """The collate function for :class:`RowsDataset`: the batch is already a list of tensors."""
    return tuple(batch)


def build_dataset(x: torch.Tensor, y: torch.Tensor, canary_set: CanarySet,
                  canary_weight: float) -> RowsDataset:
    """The training set: the n_data examples, then the m canary rows.

    Columns: the model input ``[features | canary input v_i]`` (0 where absent), the canary's
    output vector ``c_i`` (0 for examples), its loss weight (``canary_weight`` if included, else
    0), a canary flag and the class label (0 for canaries).
    """
    n_data, m = x.shape[0], canary_set.m
    dtype = canary_set.c.dtype
    k, d = canary_set.c.shape[1], canary_set.v.shape[1]
    inputs = torch.zeros(n_data + m, x.shape[1] + d, dtype=dtype)
    inputs[:n_data, :x.shape[1]] = x
    inputs[n_data:, x.shape[1]:] = canary_set.v
    out = torch.zeros(n_data + m, k, dtype=dtype)
    out[n_data:] = canary_set.c
    weight = torch.zeros(n_data + m, dtype=dtype)
    weight[n_data:] = canary_set.included.to(dtype) * canary_weight
    is_canary = torch.zeros(n_data + m, dtype=torch.bool)
    is_canary[n_data:] = True
    labels = torch.zeros(n_data + m, dtype=torch.long)
    labels[:n_data] = y
    return RowsDataset(inputs, out, weight, is_canary, labels)
