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

* ``w_r = Σ_j c_j·t_{r,j}``, one matrix–vector product in the operand's floating-point type with
  weights ``c_j ∈ [1, 2)`` drawn once per process, per row width, dtype and device, from the
  operating system's entropy and never released (``Σ_j c_j·t_{r,j}`` in int64 with weights below
  ``2⁶²`` for an integer operand): the two sums above are the same for every order of a row's
  elements, so a write that moves values between positions (a ``.data`` flip, roll or swap
  inside a row, which changes a sequence layer's ghost norm ``Σ_{t,s}⟨a_t,a_s⟩⟨g_t,g_s⟩``) keeps
  them; it changes ``w_r`` by ``Σ_j c_j·δ_j``, which secret weights make zero only by chance.

Changes of several elements below the rounding of ``s_r`` and ``w_r`` that keep ``b_r`` can still
leave all three as they were: the fingerprints see what non-deterministic kernels and careless
writes do, not every change a model could craft.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Sequence, Tuple

import torch

from ..foundation.randomness import entropy_seeded_generator

#: the integer type of an element width in bytes
_BITS: Dict[int, torch.dtype] = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


#: the position weights of each row width, dtype and device (:func:`position_weights`), the
#: most recently used kept
_WEIGHTS: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_WEIGHTS_KEPT = 64


def position_weights(cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(cols,)`` secret weights of :func:`row_fingerprints`' ``w_r``: uniform in ``[1, 2)``
    (rounded to ``dtype``) for a floating-point operand, uniform integers in ``[1, 2⁶²)`` for an
    integer one; drawn once per process and key from an entropy-seeded generator."""
    key = (cols, dtype, device)
    found = _WEIGHTS.get(key)
    if found is not None:
        _WEIGHTS.move_to_end(key)
        return found
    gen = entropy_seeded_generator("cpu")
    if dtype.is_floating_point:
        w = (torch.rand(cols, generator=gen, dtype=torch.float64) + 1).to(dtype)
    else:
        w = torch.randint(1, 2 ** 62, (cols,), generator=gen, dtype=torch.int64)
    w = w.to(device)
    _WEIGHTS[key] = w
    if len(_WEIGHTS) > _WEIGHTS_KEPT:
        _WEIGHTS.popitem(last=False)
    return w


def row_fingerprints(t: torch.Tensor) -> List[torch.Tensor]:
    """``[b, s, w]`` of ``t``'s rows (module docstring): ``b_r = Σ_j bits(t_{r,j}) mod 2^k`` as
    k-bit integers, ``s_r = Σ_j t_{r,j}`` and ``w_r = Σ_j c_j·t_{r,j}`` in ``t``'s dtype (a
    complex ``t``: of its real and imaginary parts); for an integer or boolean ``t``, ``[s, w]``
    exact in int64 (``w`` modulo ``2⁶⁴``)."""
    x = t.reshape(t.shape[0], -1)
    if x.is_complex():
        x = torch.view_as_real(x).reshape(x.shape[0], -1)
    if not x.is_floating_point():
        x64 = x.to(torch.int64)
        weights = position_weights(x.shape[1], torch.int64, x.device)
        return [x64.sum(1), (x64 * weights).sum(1)]
    bits = _BITS[x.element_size()]
    weights = position_weights(x.shape[1], x.dtype, x.device)
    return [x.view(bits).sum(1, dtype=bits), x.sum(1), x @ weights]


def fingerprint_pairs(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> List[torch.Tensor]:
    """Per call ``(a, g)``, the row fingerprints of ``a`` then of ``g`` (:func:`row_fingerprints`):
    what a second look at a layer's operands must find again for the norms formed from them to
    certify what is released (a kernel that is not deterministic can change the output gradient;
    model code writing an activation through ``.data`` during the backward, the activation)."""
    return [f for a, g in pairs for t in (a, g) for f in row_fingerprints(t)]
