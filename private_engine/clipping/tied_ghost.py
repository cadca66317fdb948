"""The ghost norm of a tied weight: the per-sample norm of ``W``'s gradient summed over its uses,
from T×T quantities, never a per-sample ``V×d`` matrix.

Every use k of a weight ``W: (V, d)`` contributes an outer-product sum to sample i's gradient,
``G_i^k = Σ_t u_t v_tᵀ``: a Linear (``y = W h + b``) has ``u_t = δ_t`` (its output gradient, V
wide) and ``v_t = h_t`` (its input, d wide); an Embedding looking up token ``x_s`` has
``u_s = e_{x_s}`` (one-hot) and ``v_s = g_s`` (its output gradient). Stacking the rows of all
uses, ``G_i = Σ_k G_i^k = Uᵀ V`` and (Bu, Mao & Xu 2022, "Scalable and Efficient Training of
Large Convolutional Neural Networks with Differential Privacy", eq. 2.7, over the rows of every
use)::

    ‖G_i‖² = ⟨U Uᵀ, V Vᵀ⟩ = Σ_{k,l} Σ_{t,s} ⟨u_t^k, u_s^l⟩·⟨v_t^k, v_s^l⟩

which holds the cross terms ``2·⟨G_i^k, G_i^l⟩``. The blocks of ``U Uᵀ`` are ``δ_t·δ_s`` (two
Linears), ``δ_t[x_s]`` (a Linear and an Embedding: a gather, no arithmetic) and
``1[x_t = x_s]`` (two Embeddings). A Linear's bias is one more column of ``V`` (1 on its own
rows, 0 elsewhere), so ``‖(G_W, G_b)‖²`` comes out of the same inner product. Cost per sample:
``T_L²·V`` multiply-adds for the Linear rows' Gram (what the Linear's own ghost norm costs),
``(T_L + T_E)²·d`` for ``V Vᵀ`` and a ``T_E×T_L`` gather; memory ``(T_L + T_E)²`` — against
``V·d`` for the instantiated gradient (GPT-2: 50257·768 ≈ 3.9·10⁷ per sample; with ``T = 1024``
on both uses, ``(2T)² ≈ 4.2·10⁶``).

The certificate follows the single-layer one (:mod:`private_engine.layers.rounding`): the Grams
in float64 (exact products of the recorded values), their inner product summed over s then t,
``|ν̃ − ‖G‖²| ≤ c_ν·M²`` with ``M = Σ_rows ‖u‖·‖(v, 1)‖``; each use releases its own clipped sum
(``Gᵀ·diag(C)·A`` or the Embedding's index-add) with its rounding ``c_r^k·M_k``, and the uses'
sums are added into the parameter's buffer (``γ_K`` of the accumulator on their magnitudes).
"""
from __future__ import annotations

from typing import List, Sequence, Set, Tuple

import torch
from torch import nn

from ..foundation.dtypes import accumulation_dtype, release_dtype
from ..layers.base import LayerDims, LayerRule
from ..layers.embedding import EmbeddingRule
from ..layers.linear import LinearRule
from ..layers.rounding import (
    ETA64,
    gamma,
    ghost_underflow,
    gram_coefficient,
    pair_mass,
    release_coefficient,
    row_norms64,
    unit_roundoff,
)
from .plan import use_ghost

Member = Tuple[nn.Module, object, list]  # (module, rule, [(a, g)])


def ghost_capable(members: Sequence[Tuple[nn.Module, object]]) -> bool:
    """True when the uses can be normed jointly here: Embeddings and (untransposed) Linears
    sharing one weight and nothing else but, possibly, their biases."""
    weights = set()
    for module, rule in members:
        if type(rule) is EmbeddingRule:
            pass
        elif type(rule) is LinearRule:
            bias = getattr(module, "bias", None)
            if isinstance(bias, nn.Parameter) and bias.requires_grad and \
                    any(bias is getattr(m, "weight", None) for m, _ in members):
                return False
        else:
            return False
        w = getattr(module, "weight", None)
        if not (isinstance(w, nn.Parameter) and w.requires_grad):
            return False
        weights.add(id(w))
    return len(weights) == 1


def joint_dims(members: Sequence[Tuple[nn.Module, LayerRule, Sequence[LayerDims]]]) -> LayerDims:
    """Dimensions of the stacked rows for the memory rule: ``T = Σ_k T_k``, ``p = V``, ``D = d``
    plus one column per trained bias."""
    T = sum(d.T for _, _, dims in members for d in dims)
    module = members[0][0]
    V, d = module.weight.shape
    biases = {id(m.bias) for m, r, _ in members
              if isinstance(r, LinearRule) and isinstance(getattr(m, "bias", None), nn.Parameter)
              and m.bias.requires_grad}
    io = sum(d.io_size for _, _, dims in members for d in dims)
    return LayerDims(T=T, D=d + len(biases), p=V, io_size=io)


def joint_ghost_chosen(group, layers: Sequence, batch_size: int, mode: str,
                       handed: Set[int]) -> bool:
    """Whether a tied group (book-keeping modes) is normed by its joint ghost norm: Embeddings and
    Linears sharing one weight (``group.ghost_capable``), none of them also followed by the tracer
    (``handed``: ids of such modules), every recorded call of ``layers`` (the recorder's) with one
    row per sample, and the mode's rule picking the ghost norm for the stacked rows
    (:func:`joint_dims`)."""
    if not group.ghost_capable or any(id(m) in handed for _, m, _ in group.members):
        return False
    ids = {id(m) for _, m, _ in group.members}
    recs = [r for r in layers if id(r.module) in ids]
    calls = [c for r in recs for c in r.calls]
    if not calls or not all(c.activation is not None and c.activation.shape[0] == batch_size
                            for c in calls):
        return False
    return use_ghost(joint_dims([(r.module, r.rule, [c.dims for c in r.calls]) for r in recs]),
                     mode)


def certified_joint_norm_sq(members: Sequence[Member]) -> torch.Tensor:
    """Certified ``‖release_i‖²`` (float64, ``(B,)``) at ``C_i = 1`` for the uses ``members`` of
    one tied weight (with their biases): ``(√(max(ν̃, 0) + c_ν M²) + Σ_k c_r^k M_k + γ_K·M')²``
    (module docstring)."""
    us: List[Tuple[str, torch.Tensor]] = []  # ("dense", δ (B, T, V)) or ("ids", x (B, T))
    vs: List[torch.Tensor] = []  # (B, T, d) float64
    bias_of: List[int] = []  # per member: its bias column (-1: none)
    columns: dict = {}
    masses, c_rel = [], []
    widest = 1
    for module, rule, pairs in members:
        if isinstance(rule, EmbeddingRule):
            ids, G = rule._views(module, pairs)
            B, T = ids.shape
            us.append(("ids", ids))
            vs.append(G.double())
            slack = 1 + gamma(T + G.shape[2] + 4, unit_roundoff(torch.float64))
            masses.append(row_norms64(G).sum(1) * slack)
            c_rel.append(release_coefficient(G.dtype, G.device, B * T))
            bias_of.append(-1)
        else:
            A, G = rule._views(module, pairs)
            bias = isinstance(getattr(module, "bias", None), nn.Parameter) and \
                module.bias.requires_grad
            us.append(("dense", G.double()))
            vs.append(A.double())
            widest = max(widest, G.shape[2])
            masses.append(pair_mass(A, G, bias))
            c_rel.append(release_coefficient(release_dtype(G), G.device,
                                             A.shape[0] * A.shape[1]))
            bias_of.append(columns.setdefault(id(module.bias), len(columns)) if bias else -1)
    nb = len(columns)
    if nb:
        widened = []
        for v, col in zip(vs, bias_of):
            extra = torch.zeros(*v.shape[:2], nb, dtype=v.dtype, device=v.device)
            if col >= 0:
                extra[..., col] = 1.0
            widened.append(torch.cat([v, extra], 2))
        vs = widened
    Vrows = torch.cat(vs, 1)
    vvt = torch.bmm(Vrows, Vrows.transpose(1, 2))
    uut = torch.cat([torch.cat([_u_block(a, b) for b in us], 2) for a in us], 1)
    nu = uut.mul_(vvt).sum(2).sum(1)
    mass = sum(masses)
    positions = Vrows.shape[1]
    c_nu = gram_coefficient(Vrows.shape[2], widest, positions, unit_roundoff(torch.float64))
    released = sum(c * m for c, m in zip(c_rel, masses))
    acc = accumulation_dtype(members[0][0].weight)
    adding = gamma(len(members), unit_roundoff(acc)) * (1 + max(c_rel)) * mass
    base = nu.clamp(min=0) + c_nu * mass * mass
    if members[0][0].weight.dtype == torch.float64:  # float64 products may underflow
        u_sum = sum(row_norms64(u).sum(1) if kind == "dense" else
                    torch.full_like(mass, float(u.shape[1])) for kind, u in us)
        base = base + ghost_underflow(row_norms64(Vrows).sum(1), u_sum, Vrows.shape[2], widest,
                                      positions, ETA64)
    base = base.sqrt()
    return (base + released + adding).square()


def _u_block(a: Tuple[str, torch.Tensor], b: Tuple[str, torch.Tensor]) -> torch.Tensor:
    """``⟨u_t, u_s⟩`` for the rows t of use ``a`` and s of use ``b`` (float64, ``(B, T_a, T_b)``):
    a Gram for two Linears, a gather ``δ_t[x_s]`` for a Linear and an Embedding, token equality
    for two Embeddings."""
    (kind_a, ua), (kind_b, ub) = a, b
    if kind_a == "dense" and kind_b == "dense":
        return torch.bmm(ua, ub.transpose(1, 2))
    if kind_a == "ids" and kind_b == "ids":
        return (ua.unsqueeze(2) == ub.unsqueeze(1)).double()
    if kind_a == "dense":  # δ_t[x_s]: (B, T_a, T_b)
        return ua.gather(2, ub.unsqueeze(1).expand(-1, ua.shape[1], -1))
    return ub.gather(2, ua.unsqueeze(1).expand(-1, ub.shape[1], -1)).transpose(1, 2)
