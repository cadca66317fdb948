"""Row fingerprints of the operands a layer was normed from: what a later look at the same
operands must find again for the norms to certify what is released from them.

Per row r of an operand ``t`` (first dimension: rows; the rest flattened), two exact integer
sums of the elements' bit patterns; neither rounds, so no element, however large, can hide a
change of others (a floating-point sum of the values would absorb any change below the rounding
of its largest term):

* ``b_r = Σ_j bits(t_{r,j}) mod 2^k``: the elements' bit patterns read as k-bit integers
  (``t.view(int_k)``, k the element width) summed with wrap-around. Independent of the order of
  the additions, so bitwise equal operands give equal ``b``, on every device and thread count;
  a row in which a single element changed — by any amount, at any magnitude, a sign of zero
  included — always gets another ``b_r`` (the change of one bit pattern lies strictly between
  ``-2^k`` and ``2^k``). One reduction, no copy.
* ``w_r = Σ_m c_m·u_{r,m} mod 2^64``: the row's bit patterns read as words ``u_{r,m}`` of at most
  32 bits (an element of 8 bytes is two words), times secret weights ``c_m``, uniform integers in
  ``[1, 2^31)`` drawn once per process, per row width in words and device, from the operating
  system's entropy and never released, summed exactly in int64. ``b_r`` is the same for every
  order of a row's elements, so a write that moves values between positions (a ``.data`` flip,
  roll or swap inside a row, which changes a sequence layer's ghost norm
  ``Σ_{t,s}⟨a_t,a_s⟩⟨g_t,g_s⟩``) keeps it; it changes ``w_r`` by ``Σ_m c_m·δ_m`` with word changes
  ``|δ_m| < 2^32``. For any change, fix every weight but one ``c_m`` with ``δ_m ≠ 0``: ``c_m·δ_m``
  takes one value modulo ``2^64`` for at most one ``c_m < 2^31`` (``δ_m``'s 2-adic valuation
  is at most 31), so the change goes unseen with probability at most ``2^-31`` over the secret
  weights, whatever the values (a Schwartz–Zippel-type argument for a linear form).

``w_r`` widens the words to int64 a piece of at most ``PIECE_WORDS`` words at a time (on the CPU a
matrix–vector product per piece; on other devices a product and a sum): no copy of the operand is
held, only one piece. Integer and boolean operands are fingerprinted by the same sums.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Sequence, Tuple

import torch

from ..foundation.randomness import entropy_seeded_generator

#: the integer type of an element width in bytes
_BITS: Dict[int, torch.dtype] = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: the word type of :func:`row_fingerprints`' ``w_r`` for an element width in bytes (at most 32
#: bits, so that a word's change has a 2-adic valuation of at most 31)
_WORDS: Dict[int, torch.dtype] = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}
#: words widened to int64 at a time, per device type: 8 MiB on the CPU (on a 2-core AMD EPYC,
#: 2.0–2.1 ms per 2.4 M float32 words from 2 to 8 MiB pieces, 2.3 ms at 16 MiB, 8 ms widened
#: at once); 32 MiB elsewhere (``PIECE_WORDS_OTHER``: fewer kernels for the same memory traffic)
PIECE_WORDS: Dict[str, int] = {"cpu": 1 << 20}
PIECE_WORDS_OTHER = 1 << 22
#: the weights are uniform in ``[1, 2^WEIGHT_BITS)``
WEIGHT_BITS = 31

#: the position weights of each row width and device (:func:`position_weights`), the most
#: recently used kept
_WEIGHTS: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_WEIGHTS_KEPT = 64


def position_weights(cols: int, device: torch.device) -> torch.Tensor:
    """``(cols,)`` secret int64 weights of :func:`row_fingerprints`' ``w_r``, uniform in
    ``[1, 2^31)``; drawn once per process, row width and device from an entropy-seeded
    generator."""
    key = (cols, torch.device(device))
    found = _WEIGHTS.get(key)
    if found is not None:
        _WEIGHTS.move_to_end(key)
        return found
    gen = entropy_seeded_generator("cpu")
    w = torch.randint(1, 2 ** WEIGHT_BITS, (cols,), generator=gen, dtype=torch.int64)
    w = w.to(device)
    _WEIGHTS[key] = w
    if len(_WEIGHTS) > _WEIGHTS_KEPT:
        _WEIGHTS.popitem(last=False)
    return w


def row_fingerprints(t: torch.Tensor) -> List[torch.Tensor]:
    """``[b, w]`` of ``t``'s rows (module docstring): ``b_r = Σ_j bits(t_{r,j}) mod 2^k`` as
    k-bit integers and ``w_r = Σ_m c_m·u_{r,m} mod 2^64`` in int64, for an operand of any dtype
    (a complex one as its real and imaginary parts, a boolean one as bytes)."""
    x = t.reshape(t.shape[0], -1)
    if x.is_complex():
        x = torch.view_as_real(x).reshape(x.shape[0], -1)
    if x.dtype == torch.bool:
        x = x.view(torch.int8)
    if x.shape[1] and x.stride(1) != 1:
        x = x.contiguous()
    size = x.element_size()
    bits = x.view(_BITS[size])
    return [bits.sum(1, dtype=bits.dtype), weighted_word_sums(x.view(_WORDS[size]))]


def weighted_word_sums(words: torch.Tensor) -> torch.Tensor:
    """``Σ_m c_m·u_{r,m} mod 2^64`` per row of the integer matrix ``words`` (``c`` the
    :func:`position_weights` of its width), exact in int64, widened a piece of at most
    ``PIECE_WORDS`` words at a time."""
    rows, cols = words.shape
    if rows == 0 or cols == 0:
        return torch.zeros(rows, dtype=torch.int64, device=words.device)
    weights = position_weights(cols, words.device)
    step = max(1, PIECE_WORDS.get(words.device.type, PIECE_WORDS_OTHER) // rows)
    if cols <= step:  # one piece: two kernels
        return _weighted(words.to(torch.int64), weights)
    out = torch.zeros(rows, dtype=torch.int64, device=words.device)
    scratch = torch.empty(rows * step, dtype=torch.int64, device=words.device)
    for start in range(0, cols, step):
        piece = words[:, start:start + step]
        wide = scratch[:piece.numel()].view(piece.shape).copy_(piece)
        out.add_(_weighted(wide, weights[start:start + piece.shape[1]]))
    return out


def _weighted(wide: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``wide @ weights`` in int64 (wrapping modulo ``2^64``): a matrix–vector product on the CPU,
    elsewhere a product in place and a sum."""
    if wide.device.type == "cpu":
        return torch.mv(wide, weights)
    return wide.mul_(weights).sum(1)


def fingerprint_pairs(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> List[torch.Tensor]:
    """Per call ``(a, g)``, the row fingerprints of ``a`` then of ``g`` (:func:`row_fingerprints`):
    what a second look at a layer's operands must find again for the norms formed from them to
    certify what is released (a kernel that is not deterministic can change the output gradient;
    model code writing an activation through ``.data`` during the backward, the activation)."""
    return [f for a, g in pairs for t in (a, g) for f in row_fingerprints(t)]
