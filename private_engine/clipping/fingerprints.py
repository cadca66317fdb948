"""Row fingerprints of the operands a layer was normed from: what a later look at the same
operands must find again for the norms to certify what is released from them.

Per row r of an operand ``t`` (first dimension: rows; the rest flattened), two sums, neither of
which casts or copies ``t`` (a float64 sum of a float32 operand casts all of it first, on the CPU
a copy twice its size at every call):

* ``b_r = Σ_j bits(t_{r,j}) mod 2^k``: the elements' bit patterns read as k-bit integers
  (``t.view(int_k)``, k the element width) summed with wrap-around. Exact and independent of
  the order of the additions, so bitwise equal operands give equal ``b``, on every device and
  thread count; a row in which a single element changed — by any amount, at any magnitude, a
  sign of zero included — always gets another ``b_r`` (the change of one bit pattern lies
  strictly between ``-2^k`` and ``2^k``).
* ``s_r = Σ_j t_{r,j}`` in the operand's floating-point type (torch's reduction, deterministic
  for a given shape): a second look at changes of several elements whose bit-pattern changes
  cancel modulo ``2^k`` but whose values do not.

Changes of several elements can still leave both sums as they were (e.g. a ``.data`` write built
to keep them): the fingerprints see what non-deterministic kernels and careless writes do, not
every change a model could craft.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

#: the integer type of an element width in bytes
_BITS: Dict[int, torch.dtype] = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def row_fingerprints(t: torch.Tensor) -> List[torch.Tensor]:
    """``[b, s]`` of ``t``'s rows (module docstring): ``b_r = Σ_j bits(t_{r,j}) mod 2^k`` as
    k-bit integers, ``s_r = Σ_j t_{r,j}`` in ``t``'s dtype (a complex ``t``: of its real and
    imaginary parts); for an integer or boolean ``t``, ``[s]`` alone (exact in int64)."""
    x = t.reshape(t.shape[0], -1)
    if x.is_complex():
        x = torch.view_as_real(x).reshape(x.shape[0], -1)
    if not x.is_floating_point():
        return [x.sum(1, dtype=torch.int64)]
    bits = _BITS[x.element_size()]
    return [x.view(bits).sum(1, dtype=bits), x.sum(1)]


def fingerprint_pairs(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> List[torch.Tensor]:
    """Per call ``(a, g)``, the row fingerprints of ``a`` then of ``g``
    (:func:`row_fingerprints`)."""
    return [f for a, g in pairs for t in (a, g) for f in row_fingerprints(t)]
