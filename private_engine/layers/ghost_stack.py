"""Certified ghost-norm bounds of many Linear layers, formed together at the end of a norm pass.

Layer by layer, the fast certified ghost norm of a Linear (:func:`.gram.fast_ghost_bound`, then
:func:`.rounding.certified_ghost`) is about forty element-wise operations on ``(N,)``-, ``(N, T)``-
and ``(N, T, T)``-sized tensors besides its two Grams: on a GPU, forty kernel launches that cost
more host time than their arithmetic. :class:`GhostBoundStack` keeps each layer's operands (views
of the activations and output gradients that book-keeping keeps for the clipped sum anyway) and
forms every layer's bound at the end of the norm pass:

* the Grams ``ã ãᵀ``, ``g gᵀ`` and the row norms ``‖a_t‖``, ``‖g_t‖`` of layers whose operands
  have one shape by one batched matmul and one reduction per shape (their operands stacked,
  in groups of at most ``STACK_ELEMENTS`` elements);
* the passes over the Grams once per ``(L, N, T, T)`` stack of the layers with ``T``
  positions (in chunks of at most ``BOUND_ELEMENTS`` elements): those of
  :func:`.gram.ghost_terms` (row dot products, absolute values in place, matrix–vector
  products), each giving float32 ``(L, N, T)`` rows, and the float64 row-norm bounds and
  weights they need;
* the rest — the float64 sums of those rows over ``t``, the slack, the mass, the test for a
  loose bound, the released bound — once for all the chunks of a block of layers (at most
  ``ROW_ELEMENTS`` row elements), so that the count of operations grows with the number of
  chunks (the batch size) by the passes over the Grams only. Each layer's constants (``γ_a``,
  ``γ_g``, widths, release coefficient) are a ``(L, 1[, 1])`` float64 tensor (formed once per
  set of layers and kept).

The formulas are those of the per-layer path term for term — the same float32 Grams with the same
error model (Higham 2002, §3.1; Fasi, Higham, Mikaitis & Pranesh 2021 for tensor cores), the same
functions for ``ν̃`` and the slack, the same second try for a loose or non-finite sample
(:func:`.gram.second_try`, on every device, after one host synchronisation per step instead of
one per layer; the loose samples of layers of one shape together, each sample's bound its
own: :mod:`.ghost_retry`) — so each layer's bound is an upper bound of its released per-sample
norm², rounding included, as before.
"""
from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .base import aligned_count, pad_positions
from .ghost_retry import Retry, released_bound, second_tries
from .gram import (
    _gram32,
    _nonnegative_or_nan,
    fast_gram_model,
    form_constants,
    ghost_slack,
    gram_gamma,
    ieee_matmul,
    loose_floor,
    row_dots32,
    tight,
    weight_scale,
    weighted_rows32,
)
from .precision import without_autocast
from .rounding import ETA32, ETA64, gamma, unit_roundoff

#: the most elements the operands stacked for one batched Gram may have (a copy of them is made)
STACK_ELEMENTS = 1 << 24
#: the most elements of one ``(L, N, T, T)`` stack of float32 Grams: the layers of one group are
#: bounded in chunks of at most this size. What lives at once is the two Grams (64 MiB), and where
#: float32 matmuls may round their operands a float32 product of them (:func:`.gram.row_dots`),
#: for which the chunks hold two thirds of this (60 MiB in all)
BOUND_ELEMENTS = 1 << 23
#: the most output-gradient elements a two-pass norm pass holds for deferred bounds (64 MiB of
#: float32): beyond it, each layer's bound is formed at once and its gradient freed
HELD_GRADIENTS = 1 << 24
#: the most ``(L, N, T)`` row elements of one block of layers: the rows of every chunk of a block
#: (row-norm bounds, weights, the Grams' row results: about 48 bytes per element) live until the
#: block's bounds are formed, at once for all its layers
ROW_ELEMENTS = 1 << 21


class _Pending(NamedTuple):
    """One layer whose bound is formed later: ``a: (N, T, D)``, ``g: (N, T, p)`` (views of the
    kept operands), a trained bias, the fast-Gram model ``(tensor_core, η)`` and the release
    coefficient ``c_r`` (:func:`.rounding.release_coefficient`)."""

    a: torch.Tensor
    g: torch.Tensor
    bias: bool
    model: Tuple[bool, float]
    c_rel: float

    def key(self) -> tuple:
        """What the layer's constants depend on."""
        return (self.a.shape[2], self.g.shape[2], self.a.shape[1], self.bias, self.model,
                self.c_rel)


class GhostBoundStack:
    """Deferred certified ghost bounds ``(√ν⁺ + c_r M)²`` of Linear layers (weight trained, fast
    float32 Grams): :meth:`add` per layer during the norm pass, :meth:`take` at its end.

    ``held_limit``: None when the operands are kept for the clipped sums anyway (book-keeping);
    else the most output-gradient elements held only for the bounds (two-pass modes, which would
    free each output gradient at once): a layer beyond it gets its bound at once."""

    def __init__(self, held_limit: Optional[int] = None) -> None:
        self.held_limit = held_limit
        self._held = 0
        self._pending: List[_Pending] = []
        #: after :meth:`take`: each layer's ``(N,)`` bound (a row of its block), in the order
        #: the layers were added
        self.rows: List[torch.Tensor] = []
        #: per-layer constants as tensors, keyed by the layers' keys and device
        self._constants: Dict[tuple, Dict[str, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, a: torch.Tensor, g: torch.Tensor, bias: bool, c_rel: float) -> bool:
        """Keep a layer's ``a: (N, T, D)``, ``g: (N, T, p)`` for its bound; False (nothing kept)
        when its operands have no fast Gram path or a single position (the caller forms the
        bound now)."""
        model = fast_gram_model(a)
        if model is None or a.shape[1] == 1 or g.dtype != a.dtype:
            return False
        if self.held_limit is not None:
            if self._held + g.numel() > self.held_limit:
                return False
            self._held += g.numel()
        self._pending.append(_Pending(a, g, bias, model, c_rel))
        return True

    def clear(self) -> None:
        """Drop what was kept (a failed norm pass) and the last bounds."""
        self._pending, self._held, self.rows = [], 0, []

    @without_autocast
    def take(self) -> List[torch.Tensor]:
        """The certified squared norms of every kept layer, as float64 ``(L_k, N)`` blocks (per
        number of positions and device, in blocks of at most ``ROW_ELEMENTS`` row elements, of
        layers of like widths side by side, each block's rows in the order its layers were added;
        each layer's row also in :attr:`rows`), and forget the layers."""
        pending = self._pending
        self.clear()
        groups: Dict[tuple, List[int]] = {}
        for i, p in enumerate(pending):
            groups.setdefault((p.a.shape[0], p.a.shape[1], p.a.device), []).append(i)
        rows: List[Optional[torch.Tensor]] = [None] * len(pending)
        parts: List[List[int]] = []
        retries: List[Retry] = []
        for (N, T, device), idx in groups.items():
            # operands of one shape side by side: one stack per run (_grams_and_norms)
            idx = sorted(idx, key=lambda i: _widths(pending[i]))
            most = BOUND_ELEMENTS if ieee_matmul(device) else BOUND_ELEMENTS * 2 // 3
            per_chunk = max(1, most // max(1, N * T * T))
            per_block = max(per_chunk, ROW_ELEMENTS // max(1, N * T))
            for s in range(0, len(idx), per_block):
                parts.append(idx[s:s + per_block])
                retries.append(self._bounds([pending[i] for i in parts[-1]], per_chunk))
        second_tries(retries)
        blocks = []
        for part, retry in zip(parts, retries):
            # the block's rows in the order the layers were added (one stack if sorting moved
            # them): the sum of the norms over them then runs in the same order as ever
            order = sorted(range(len(part)), key=part.__getitem__)
            block = (retry.block if order == list(range(len(part)))
                     else torch.stack([retry.block[j] for j in order]))
            blocks.append(block)
            for j, k in enumerate(order):
                rows[part[k]] = block[j]
        self.rows = rows  # type: ignore[assignment]
        return blocks

    # -- per group of layers with N samples and T positions -------------------------------------
    def _bounds(self, layers: Sequence[_Pending], per_chunk: int) -> Retry:
        """``(L, N)`` certified squared norms of ``layers`` (one N, T and device), with what the
        second try of their loose samples needs (:func:`.ghost_retry.second_tries`). The Grams
        are formed ``per_chunk`` layers at a time (:func:`_chunk_rows`); what follows them is
        work on ``(L, N, T)`` rows, done once for all the layers."""
        c = self._constants_for(layers)
        T = layers[0].a.shape[1]
        form = form_constants(T)
        parts = [_chunk_rows(layers[s:s + per_chunk], c, slice(s, s + per_chunk))
                 for s in range(0, len(layers), per_chunk)]
        na, ng, n2, m2, dots, forms_g, forms_a, mags = (
            parts[0][k] if len(parts) == 1 else torch.cat([p[k] for p in parts])
            for k in range(8))
        del parts
        # M_i = Σ_t ‖ã_t‖‖g_t‖ raised for its rounding and underflow (mass_of)
        pair = (na * ng).sum(2)
        mass = pair.mul(c["mass_slack"]).add_(T * ETA64)
        # ghost_terms' sums of the float32 rows, over all layers at once
        nu = _nonnegative_or_nan(dots.sum(-1, dtype=torch.float64))
        wg = torch.mul(forms_g.add_(form.row_loss), n2).sum(-1)
        wa = torch.mul(forms_a.add_(form.row_loss), m2).sum(-1)
        mag = mags.sum(-1, dtype=torch.float64)
        cross = (n2 * m2).sum(-1)
        slack = ghost_slack(wg, wa, cross, mag, form)
        bound = (nu + slack).mul_(1 + 2.0 ** -50)
        # kept: finite, and loose by no more than LOOSE·ν̃ or the release's own rounding term
        # (gram.release_term's c_r·Σ_t n_t m_t, as the per-layer path weighs it)
        ok = tight(bound, slack, nu, loose_floor(T), pair.mul_(c["c_rel"]))
        # certified_ghost with c_ν = 0: (√max(ν⁺, 0) + c_r M)² (an infinite or NaN M gives a
        # non-finite bound either way: the sample is dropped)
        block = released_bound(bound, c["c_rel"], mass)
        return Retry(layers, block, ok, na, ng, c["c_rel"], mass)

    def _constants_for(self, layers: Sequence[_Pending]) -> Dict[str, torch.Tensor]:
        """Each layer's constants as ``(L, 1[, 1])`` float64 tensors (formed once per set of
        layers and device)."""
        device = layers[0].a.device
        key = (device, tuple(p.key() for p in layers))
        found = self._constants.get(key)
        if found is not None:
            return found
        if len(self._constants) > 16:
            self._constants.clear()
        u32, u64 = unit_roundoff(torch.float32), unit_roundoff(torch.float64)
        T = layers[0].a.shape[1]
        rows: Dict[str, list] = {k: [] for k in (
            "fa", "ca", "fg", "cg", "mass_slack", "floor_a", "scale_a", "floor_g", "scale_g",
            "c_rel")}
        for p in layers:
            D, P = p.a.shape[2], p.g.shape[2]
            tensor_core, eta = p.model
            wa, wg = D + p.bias, P
            ga, gg = gram_gamma(wa, tensor_core), gram_gamma(wg, tensor_core)
            rows["fa"].append(1 + gamma(D + 2, u32))
            rows["ca"].append((D * ETA32) ** 0.5)
            rows["fg"].append(1 + gamma(P + 2, u32))
            rows["cg"].append((P * ETA32) ** 0.5)
            rows["mass_slack"].append(1 + gamma(T + D + 4, u64))
            rows["floor_a"].append(math.sqrt(2 * wa * eta / ga))
            rows["scale_a"].append(weight_scale(ga, T))
            rows["floor_g"].append(math.sqrt(2 * wg * eta / gg))
            rows["scale_g"].append(weight_scale(gg, T))
            rows["c_rel"].append(p.c_rel)
        out = {k: torch.tensor(v, dtype=torch.float64, device=device).reshape(-1, 1, 1)
               for k, v in rows.items() if k in ("fa", "ca", "fg", "cg", "floor_a", "scale_a",
                                                 "floor_g", "scale_g")}
        out.update({k: torch.tensor(rows[k], dtype=torch.float64, device=device).reshape(-1, 1)
                    for k in ("mass_slack", "c_rel")})
        bias = [p.bias for p in layers]
        out["any_bias"] = any(bias)  # type: ignore[assignment]
        out["bias"] = torch.tensor(bias, device=device).reshape(-1, 1, 1)
        out["bias32"] = torch.tensor(bias, dtype=torch.float32,
                                     device=device).reshape(-1, 1, 1, 1)
        self._constants[key] = out
        return out


def _widths(p: _Pending) -> tuple:
    """What orders a block's layers: their operands' widths and dtypes."""
    return (p.a.shape[2], p.g.shape[2], str(p.a.dtype), str(p.g.dtype))


def _chunk_rows(layers: Sequence[_Pending], c: Dict[str, torch.Tensor],
                sl: slice) -> Tuple[torch.Tensor, ...]:
    """The Gram-side work of one chunk of layers (``sl``: their rows of the constants ``c``):
    the Grams (:func:`_grams_and_norms`), the row-norm bounds ``na``, ``ng`` (float64, raised
    for their rounding: :func:`.rounding.row_norms64`; the bias column: :func:`.rounding.
    pair_norms`), the floored weights ``n2``, ``m2`` (:func:`.gram._floored`), and the four
    float32 ``(L, N, T)`` row results of :func:`.gram.ghost_terms`' passes over the Grams —
    ``Σ_s Ã_ts G̃_ts`` (:func:`.gram.row_dots32`), ``Σ_s |G̃_ts|·fl32(n2_s)`` and
    ``Σ_s |Ã_ts|·fl32(m2_s)`` (:func:`.gram.weighted_rows32`), ``Σ_s |Ã_ts||G̃_ts|`` — the same
    operations in the same order, whose sums over t the caller forms for all chunks at once."""
    aat, na32 = _grams_and_norms([p.a for p in layers])
    ggt, ng32 = _grams_and_norms([p.g for p in layers])
    if c["any_bias"]:
        aat.add_(c["bias32"][sl])  # the w_a-th term of the sum (+0: exact for layers without)
    # row norms raised for their rounding (row_norms64's n·f + c, the float32 norms widened exactly
    # inside one float64 multiply-add, which may round once where the product and the sum round
    # twice: within an ulp of float64, far inside the u32 margin of f = 1 + γ_{w+2}, whose sum of
    # w squares and square root need γ_{w+1}), the bias column (pair_norms)
    na = torch.addcmul(c["ca"][sl], na32, c["fa"][sl])
    if c["any_bias"]:
        na = torch.where(c["bias"][sl], (na.square() + 1).sqrt(), na)
    ng = torch.addcmul(c["cg"][sl], ng32, c["fg"][sl])
    n2 = (na + c["floor_a"][sl]).mul_(c["scale_a"][sl])
    m2 = (ng + c["floor_g"][sl]).mul_(c["scale_g"][sl])
    ieee = ieee_matmul(aat.device)
    dots = row_dots32(aat, ggt, ieee)
    forms_g = weighted_rows32(ggt, n2, ieee)
    forms_a = weighted_rows32(aat, m2, ieee)
    mags = row_dots32(aat, ggt, ieee)  # Σ |Ã||G̃|: both are absolute values now
    return na, ng, n2, m2, dots, forms_g, forms_a, mags


def _grams_and_norms(ts: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(L, N, T, T)`` float32 Grams ``t tᵀ`` (:func:`.gram._gram32`) and ``(L, N, T)`` float32
    row norms of ``ts`` (each ``(N, T, w)``): each run of consecutive operands of one shape and
    dtype stacked for one batched matmul and one reduction (at most ``STACK_ELEMENTS`` elements
    at a time; on CUDA, 16-bit operands stacked straight into the rows their Gram kernels need,
    :func:`_stack_positions`), written into the run's rows of the result (float32 Grams by the
    matmul itself). When one stack holds every operand its Grams and norms are returned as they
    are."""
    runs: List[Tuple[int, int]] = []
    for i, t in enumerate(ts):
        s = runs[-1][0] if runs else 0
        per = max(1, STACK_ELEMENTS // max(1, t.numel()))
        if (runs and ts[s].shape == t.shape and ts[s].dtype == t.dtype
                and runs[-1][1] - s < per):
            runs[-1] = (s, i + 1)
        else:
            runs.append((i, i + 1))
    N, T = ts[0].shape[0], ts[0].shape[1]
    gram = norm = None
    if len(runs) > 1:
        gram = ts[0].new_empty((len(ts), N, T, T), dtype=torch.float32)
        norm = ts[0].new_empty((len(ts), N, T), dtype=torch.float32)
    for s, e in runs:
        first = ts[s]
        x = (first.unsqueeze(0) if e - s == 1 else
             _stack_positions(ts[s:e], _gram_rows(first)))
        rows, w = x.shape[-2], x.shape[-1]
        flat = x.reshape(-1, rows, w)
        dtype = None if x.dtype == torch.float32 else torch.float32
        if gram is None or norm is None:
            gram = _gram32(flat, T).reshape(e - s, N, T, T)
            norm = torch.linalg.vector_norm(x[..., :T, :], dim=-1, dtype=dtype)
            return gram, norm
        with torch.no_grad():  # written into the buffers: no graph (the bounds need none)
            if x.dtype == torch.float32 and rows == T:
                torch.bmm(flat, flat.transpose(1, 2), out=gram[s:e].view(-1, T, T))
            else:
                gram[s:e].copy_(_gram32(flat, T).reshape(e - s, N, T, T))
            torch.linalg.vector_norm(x[..., :T, :], dim=-1, dtype=dtype, out=norm[s:e])
    return gram, norm  # type: ignore[return-value]


def _gram_rows(t: torch.Tensor) -> int:
    """The rows a Gram operand like ``t: (N, T, w)`` is given: ``T``, rounded up to a multiple of
    8 for 16-bit CUDA operands (:func:`.base.aligned_positions`)."""
    T = t.shape[1]
    return aligned_count(T) if t.device.type == "cuda" and t.element_size() == 2 else T


#: at most this many operands are copied one by one into a padded stack (one pass over them, a
#: kernel each); more are stacked, then padded (two passes, three kernels)
COPIED_ONE_BY_ONE = 3


def _stack_positions(ts: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
    """``(L, N, rows, w)``: the operands ``ts`` (each ``(N, T, w)``) stacked, zero rows appended
    up to ``rows`` (:func:`_gram_rows`). ``rows == T``: one ``torch.stack``. Else, for at most
    ``COPIED_ONE_BY_ONE`` operands, each is copied straight into its rows of the padded stack and
    only the appended rows are zeroed (one copy of the operands instead of a stack and a padded
    copy of it); for more, a stack and one padded copy (:func:`.base.pad_positions`: no fill of
    the whole), which launches fewer kernels."""
    first = ts[0]
    T = first.shape[1]
    if rows == T:
        return torch.stack(list(ts))
    if len(ts) > COPIED_ONE_BY_ONE:
        return pad_positions(torch.stack(list(ts)), rows)
    out = first.new_empty((len(ts), first.shape[0], rows, first.shape[2]))
    for j, t in enumerate(ts):
        out[j, :, :T].copy_(t)
    out[:, :, T:].zero_()
    return out
