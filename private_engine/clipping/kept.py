"""Kept per-sample gradients: laid side by side so that their certified norms and clipped sums are
one reduction and one matrix-vector product per group, not one of each per parameter."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch import nn

from ..layers.base import certified_kept
from ..layers.ruled import KeptPairs

#: small kept per-sample gradients are laid side by side (copied) in groups of at most this many
#: elements; on CUDA, where each operation is a kernel launch that costs more host time than
#: copying a few MiB, a gradient is "small" up to ``KEPT_SMALL_CUDA`` elements; on the CPU, where
#: a large copy costs more than the operations it saves, up to ``KEPT_SMALL_CPU`` elements *per
#: sample* (whatever the batch size, so that a LayerNorm's weight and bias stay grouped at any
#: batch). Larger ones stay alone (no copy).
KEPT_GROUP_ELEMENTS = 1 << 22
KEPT_SMALL_CUDA = 1 << 20
KEPT_SMALL_CPU = 1 << 11
#: device types whose kept gradients are small by their whole size (``KEPT_SMALL_CUDA``); on the
#: others, by their size per sample (``KEPT_SMALL_CPU``)
SMALL_BY_TOTAL = ("cuda",)

KeptGroup = Tuple[List[nn.Parameter], torch.Tensor]


def per_sample_numel(t: torch.Tensor) -> int:
    """Elements per sample (row of dim 0) of ``t``, from its shape (``t[0].numel()`` would
    dispatch an op)."""
    return t.numel() // t.shape[0] if t.shape[0] else 0


def rows_kept(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``t`` with the rows (dim 0, one per sample) of dropped samples set to zero (integer ids
    kept)."""
    if not t.is_floating_point():
        return t
    zero = torch.zeros((), dtype=t.dtype, device=t.device)
    return torch.where(keep.reshape(-1, *([1] * (t.dim() - 1))), t, zero)


def group_kept_grads(items: List[Tuple[nn.Parameter, torch.Tensor]], batch_size: int,
                     key=None) -> Tuple[List[KeptGroup], List[torch.Tensor]]:
    """``(groups, norm terms)`` for kept per-sample gradients ``[(parameter, G (B, *shape))]``.

    The small ones are laid side by side as ``(B, n)`` matrices of at most ``KEPT_GROUP_ELEMENTS``
    elements (one dtype and device each, in the order given, a large one between them leaving
    their group open; a large one stays alone, uncopied), so that their
    certified squared norms ``Σ_θ ‖G_i^θ‖²`` are one reduction per group
    (:func:`private_engine.layers.base.certified_kept`) and their clipped sums one product
    ``Gᵀ C`` per group. Each original is released (its slot in ``items`` set to None) as soon as
    its group is formed. ``key`` (optional, ``parameter -> key``): parameters of different keys
    are never grouped together (FSDP2: one group never spans two units).
    """
    B = batch_size
    groups: List[KeptGroup] = []
    terms: List[torch.Tensor] = []
    current: list = []
    size = 0

    def flush(run):
        if not run:
            return
        params = [p for p, _ in run]
        if len(run) == 1:
            mat = run[0][1].reshape(B, -1)
        else:
            mat = torch.cat([G.reshape(B, -1) for _, G in run], 1)
        run.clear()
        terms.append(certified_kept([mat], mat))
        groups.append((params, mat))

    for k in range(len(items)):
        p, G = items[k]
        items[k] = None
        small = (G.numel() <= KEPT_SMALL_CUDA if G.device.type in SMALL_BY_TOTAL
                 else per_sample_numel(G) <= KEPT_SMALL_CPU)
        if not small:  # a group of its own; the small ones around it stay one group
            flush([(p, G)])
            continue
        if current and (G.dtype != current[0][1].dtype or G.device != current[0][1].device
                        or (key is not None and key(p) != key(current[0][0]))
                        or size + G.numel() > KEPT_GROUP_ELEMENTS):
            flush(current)
            size = 0
        current.append((p, G))
        size += G.numel()
    flush(current)
    return groups, terms


def kept_pair_params(kept_pairs: Sequence[KeptPairs]) -> List[nn.Parameter]:
    """The parameters of kept ``(module, rule, pairs)`` entries, in the order given."""
    return [getattr(m, n) for m, rule, _ in kept_pairs for n in rule.param_names
            if isinstance(getattr(m, n, None), nn.Parameter)]
