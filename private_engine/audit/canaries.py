"""The canaries of the ``linear`` path: who is included, in which gradient direction, and the
data set all canaries are trained in.

Canary i is a training row whose per-sample loss is ``L_i = s·⟨c_i, W v_i⟩`` on the model's
canary head ``W`` (:class:`private_engine.audit.model.AuditModel`, a Linear without bias), with
unit vectors ``c_i`` (output side) and ``v_i`` (its input). Its gradient, ``s·c_i v_iᵀ``, does
not depend on the parameters and has norm ``s`` far above the clipping norm R, so the engine
clips it to exactly ``R·u_i``, ``u_i = c_i v_iᵀ`` — the gradient canary of Steinke, Nasr &
Jagielski (2023), "Privacy Auditing with One (1) Training Run" (white-box, the strongest
setting). The rest of the data never reaches ``W`` (its canary input is 0), so ``u_i`` is seen
only through canaries and noise. The other clipping paths have canaries of the same kind on heads
of their own (:mod:`private_engine.audit.paths`).

* ``dirac`` directions: ``v_i``, ``c_i`` one-hot, every canary its own coordinate of ``W``
  (orthonormal ``u_i``).
* ``random`` directions: Gaussian unit ``c_i``, ``v_i`` of a head with at least 16·m
  coordinates (``|⟨u_i, u_j⟩| ≈ 1/√d``: a little cross-talk between canaries).

Each canary, of every path, is included independently with probability 1/2 (``S_i = ±1``). An
excluded canary stays in the data set as a row whose loss weight is 0: its gradient is 0 and it
adds nothing to any clipped sum, which is exactly its removal for Poisson-sampled DP-SGD
(add/remove neighbours), while the data set size n — hence the sampling rate q = B/n the
accountant is told — does not depend on S.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

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


def build_dataset(x: torch.Tensor, y: torch.Tensor, canary_set: Optional[CanarySet],
                  canary_weight: float, paths: Sequence = ()) -> RowsDataset:
    """The training set: the n_data examples, the m canary rows of the ``linear`` path
    (``canary_set``, None when that path is not audited), then the canaries of each other path
    (:class:`private_engine.audit.paths.PathCanaries`, in order).

    Columns: the model input ``[features | canary input v_i]`` (0 where absent), the canary's
    output vector ``c_i`` (0 for other rows), its loss weight (0 unless included: ``canary_weight``
    for a unit-gradient ``linear`` canary, ``canary_weight / ‖∇⟨c_i, h(x_i)⟩‖`` for the others,
    so every canary's gradient has norm ``canary_weight``), a canary flag, the class label (0 for
    canaries) and, when ``paths`` are given, each row's slot among the other paths' canaries
    (−1 for the examples and the ``linear`` canaries).
    """
    n_data = x.shape[0]
    m_lin = canary_set.m if canary_set is not None else 0
    m_rest = sum(p.m for p in paths)
    n = n_data + m_lin + m_rest
    dtype = x.dtype
    k, d = (canary_set.c.shape[1], canary_set.v.shape[1]) if canary_set is not None else (0, 0)
    inputs = torch.zeros(n, x.shape[1] + d, dtype=dtype)
    inputs[:n_data, :x.shape[1]] = x
    out = torch.zeros(n, k, dtype=dtype)
    weight = torch.zeros(n, dtype=dtype)
    if canary_set is not None:
        lin = slice(n_data, n_data + m_lin)
        inputs[lin, x.shape[1]:] = canary_set.v
        out[lin] = canary_set.c
        weight[lin] = canary_set.included.to(dtype) * canary_weight
    start = n_data + m_lin
    for p in paths:
        weight[start:start + p.m] = p.included.to(dtype) * canary_weight / p.norms.to(dtype)
        start += p.m
    is_canary = torch.zeros(n, dtype=torch.bool)
    is_canary[n_data:] = True
    labels = torch.zeros(n, dtype=torch.long)
    labels[:n_data] = y
    columns = [inputs, out, weight, is_canary, labels]
    if paths:
        slot = torch.full((n,), -1, dtype=torch.long)
        slot[n_data + m_lin:] = torch.arange(m_rest)
        columns.append(slot)
    return RowsDataset(*columns)
