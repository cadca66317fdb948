"""What a tensor of a step depends on: the tags of :mod:`private_engine.guards.batch_flow`.

* untagged (``None``): a function of no sample's data (parameters, constants, random draws,
  shapes);
* :class:`Rows` ``(dim, per, off, mod)``: separable along ``dim``; its row ``r`` holds values of
  the inputs' rows ``≡ r // per + off (mod mod)`` and of no other. A step's inputs have ``n`` rows
  and are tagged ``Rows(dim=0, mod=n)``; slicing, rolling and concatenating along the batch
  dimension move ``off``; combining rows ``r`` and ``r + s`` lowers ``mod`` to ``gcd(mod, s)``
  (two views of a batch of B in one tensor of 2B rows: ``mod = B``). The loss vector of ``L``
  entries is per-sample when it is ``Rows(0, per=1)`` with ``L | mod`` and ``off ≡ 0 (mod L)``:
  entry j then depends on the inputs' rows ``≡ j (mod L)`` only, sample j's under the convention
  that input row i is sample ``i mod L`` (``cat([x, aug(x)], 0)`` stacks views of one batch);
* :class:`Iota`: ``arange(n)`` along a dim (an index selecting every row of the batch dimension
  for itself, as in ``logits[arange(B), y]``);
* :class:`Summed`: a sum over the batch of per-sample values with coefficients of no sample (a
  mean or sum reduction, a matrix product contracting the batch dimension): the loss of the
  Opacus door's ``loss.backward()``, whose per-sample terms its hooks clip;
* :class:`Mixed`: depends on several samples otherwise; ``why`` names the op and the user's line.
"""
from __future__ import annotations

import math
import os
import sys
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

_new_tuple = tuple.__new__  # _new_tuple(Rows, fields): a Rows without a Python frame


class Rows(NamedTuple):
    """Separable along ``dim``: row r holds the inputs' rows ``≡ r // per + off (mod mod)``."""

    dim: int
    per: int
    off: int
    mod: int

    def at(self, dim: int) -> "Rows":
        """The same rows, the batch dimension now ``dim`` (``self`` when it is already)."""
        if dim == self[0]:
            return self
        return _new_tuple(Rows, (dim, self[1], self[2], self[3]))

    def shifted(self, rows: int) -> "Rows":
        """Rows starting ``rows`` rows further (a slice along the batch dimension); ``rows`` must
        be a multiple of ``per``."""
        return Rows(self.dim, self.per, (self.off + rows // self.per) % self.mod, self.mod)


class Iota(NamedTuple):
    """Values set by position along ``dim`` (an ``arange``, a ``linspace``, arithmetic on them),
    constant along the others; ``exact``: exactly ``0, 1, …, n−1`` (an index that selects each
    row for itself). Along the batch dimension, positions depend on how many samples come before:
    values set by them must not weigh samples."""

    dim: int
    exact: bool = True


class Summed(NamedTuple):
    """``Σ_j f_j(x_j)``: per-sample values summed over the batch with coefficients of no sample;
    ``how`` names the reduction; ``mod``: the modulus of the rows that were summed (each term
    holds the inputs' rows ``≡ r (mod mod)``: one sample per term only when ``mod`` is the
    number of input rows)."""

    how: str
    mod: int = 0


class Mixed(NamedTuple):
    """Depends on several samples; ``why``: the op that first mixed them, and where."""

    why: str


class Mix(Exception):
    """Raised by an op's rule: the op mixes samples (``what`` says how)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def user_line() -> str:
    """``file:line in function`` of the innermost frame outside torch and this package: where
    the user's code asked for the op."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(_PACKAGE) or path.startswith(_TORCH)):
            return f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "an unknown line"


def mixed(func, what: str) -> Mixed:
    """The tag of an op that mixes samples, with its name and the user's line."""
    return Mixed(f"{str(func).replace('.default', '')} {what} (at {user_line()})")


def join(a: Rows, b: Rows) -> Rows:
    """The rows of a value computed from rows ``a`` and ``b`` aligned row by row.

    Row r then holds the inputs' rows ``≡ r//per + a.off (mod a.mod)`` and ``≡ r//per + b.off
    (mod b.mod)``: one sample under a batch size L only if ``L`` divides both moduli and the
    offsets' difference, so the joint modulus is ``gcd(a.mod, b.mod, a.off − b.off)``. Raises
    :class:`Mix` when rows are laid out differently (``per``) or no batch of two or more samples
    remains (``mod`` 1).
    """
    if a == b:
        return a
    if a.dim != b.dim or a.per != b.per:
        raise Mix("combines rows of different samples (batch dimensions not aligned, as when "
                  "targets of shape (B,) meet outputs of shape (B, 1) and broadcast into B×B "
                  "pairs)")
    mod = math.gcd(math.gcd(a.mod, b.mod), abs(a.off - b.off))
    if mod < 2:
        raise Mix("combines rows of different samples")
    return Rows(a.dim, a.per, a.off % mod, mod)


def reshape_rows(in_shape: Sequence[int], rows: Rows, out_shape: Sequence[int]) -> Optional[Rows]:
    """Where the sample digit of ``rows`` lands after reshaping ``in_shape`` to ``out_shape``
    (row-major order), or None when no single dimension holds it.

    The digit is ``(flat // S + off) mod M`` with ``S = per·prod(in_shape[dim+1:])``. An output
    dim j of size ``m`` and suffix product ``P`` with ``S`` a multiple of ``P`` (``per' = S/P``)
    and ``m`` a multiple of ``per'`` holds it modulo ``M' = gcd(M, m/per')``:
    ``((flat // P) mod m) // per' ≡ flat // S (mod m/per')``. Stacked copies of a batch split into
    their own dimension (``(2B, d) → (2, B, d)``) keep ``M' = B``.
    """
    stride = rows.per * math.prod(in_shape[rows.dim + 1:])
    suffix = 1
    for j in range(len(out_shape) - 1, -1, -1):
        m = out_shape[j]
        if suffix > stride:
            break
        if stride % suffix == 0 and m > 1:
            per = stride // suffix
            if m % per == 0 and m // per > 1:
                mod = math.gcd(rows.mod, m // per)
                if mod > 1:
                    return Rows(j, per, rows.off % mod, mod)
        suffix *= m
    return None


def broadcast_shapes(shapes: Sequence[Sequence[int]]) -> Tuple[int, ...]:
    """``torch.broadcast_shapes`` in plain Python (no tensor op while the mode runs)."""
    n = max((len(s) for s in shapes), default=0)
    out = [1] * n
    for s in shapes:
        for i, v in enumerate(s):
            if v != 1:
                out[n - len(s) + i] = v
    return tuple(out)


def norm_dim(d: int, n: int) -> int:
    """``d`` as a non-negative dim of an ``n``-dimensional tensor."""
    return d % n if n else 0


def dims_arg(dim, n: int) -> Optional[List[int]]:
    """A reduction's ``dim`` argument as a list of dims (None: every dim)."""
    if dim is None:
        return None
    if isinstance(dim, int):
        return [norm_dim(dim, n)]
    dims = [norm_dim(d, n) for d in dim]
    return dims or None
