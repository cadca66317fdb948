"""The layerwise decision of mixed ghost clipping and its report (Bu, Mao & Xu 2022, "Scalable and
Efficient Training of Large Convolutional Neural Networks with Differential Privacy", Algorithm 1,
eq. 4.1).

Per layer and per batch: use the ghost norm iff ``2·T² < p·D`` (mode "mixed", the memory rule of Bu,
Mao & Xu 2022; mode "bk_mixed" applies it to what book-keeping keeps), iff its time is below
instantiation's (mode "bk_mixopt": :func:`ghost_time` < :func:`instantiate_time`; see
:func:`use_ghost`), always (modes "ghost" and "bk"), or never (mode "per_sample"). Layers whose
per-sample gradient is no larger than an activation row (affine parameters of LayerNorm/GroupNorm)
are always instantiated.

Modes starting with ``bk`` are *book-keeping* (Bu et al. 2023, "Differentially Private Optimization
on Large Model at Small Cost"): one backward pass; the clipped gradient is formed from the kept
activations and output gradients (``aᵀ·diag(C)·g``) or from kept per-sample gradients, never by a
second backward.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import nn

from ..layers import LayerDims

CLIPPING_MODES = ("mixed", "ghost", "per_sample", "bk", "bk_mixed", "bk_mixopt")
#: the single-backward (book-keeping) modes
BOOK_KEEPING_MODES = ("bk", "bk_mixed", "bk_mixopt")
#: the default of PrivacyEngine, layer_plan and the commands: chosen from the measurements in
#: docs/benchmarks.md (fastest or tied for fastest on every model measured, ≈ non-DP peak memory;
#: docs/engine.md)
DEFAULT_CLIPPING_MODE = "bk_mixed"


@dataclass(frozen=True)
class LayerDecision:
    """One row of the layer plan.

    ``ghost_cost = 2·T²`` (times the number of groups for grouped convolutions) and
    ``instantiate_cost = p·D`` are per-sample memory in elements (Bu, Mao & Xu 2022, Table 1).
    ``calls`` counts the layer's calls in the forward pass (their positions are concatenated).
    """

    name: str
    layer_type: str
    T: int
    D: int
    p: int
    ghost_cost: int
    instantiate_cost: int
    use_ghost: bool
    groups: int = 1
    calls: int = 1
    ghost_capable: bool = True
    #: elements per sample of the layer's inputs and outputs (all calls): what book-keeping keeps
    #: for it
    io_size: int = 0


def check_mode(mode: str) -> str:
    if mode not in CLIPPING_MODES:
        raise ValueError(
            f"clipping_mode must be one of {CLIPPING_MODES}, got {mode!r}: "
            "'mixed'/'ghost'/'per_sample' run a "
            "norm pass and a second backward; 'bk'/'bk_mixed'/'bk_mixopt' one backward "
            "(book-keeping)."
        )
    return mode


def is_book_keeping(mode: str) -> bool:
    """True for the single-backward book-keeping modes ("bk", "bk_mixed", "bk_mixopt")."""
    return mode in BOOK_KEEPING_MODES


def merge_dims(dims: Sequence[LayerDims]) -> LayerDims:
    """Dimensions of a layer called several times: positions of all calls concatenated."""
    first = dims[0]
    return LayerDims(
        T=sum(d.T for d in dims),
        D=first.D,
        p=first.p,
        groups=first.groups,
        ghost_capable=first.ghost_capable,
        gram_D=first.gram_D,
        io_size=sum(d.io_size for d in dims),
    )


def use_ghost(dims: LayerDims, mode: str) -> bool:
    """Ghost norm (True) or instantiation (False) for one layer.

    * "mixed": Bu, Mao & Xu 2022, eq. (4.1), the memory rule: ghost iff ``2·T² < p·D`` (per-sample
      memory of two T×T Gram matrices vs one p×D gradient).
    * "bk_mixed": the same memory rule for what book-keeping must *keep* until the clip factors are
      known. A ghost layer keeps its input and output gradient (``io_size`` per sample, ``T·(D +
      p)`` for a Linear); an instantiated one keeps its per-sample gradient ``p·D`` when that is
      at most :data:`KEEP_GRADS_SLACK` times the former (:func:`keeps_grads`), else the former.
      So instantiate when ``p·D ≤ io_size`` (it keeps less and is also faster: no Gram matrices,
      no matmul at the end); otherwise eq. (4.1), ``2·T² < p·D``, picks the cheaper transient.
    * "bk_mixopt": the time rule of book-keeping (Bu et al. 2023, "Differentially Private
      Optimization on Large Model at Small Cost", with measured costs): ghost iff
      :func:`ghost_time` < :func:`instantiate_time`. Instantiated gradients are always kept,
      whatever their size.
    * "ghost", "bk": always ghost; "per_sample": never.
    """
    if not dims.ghost_capable:
        return False
    if mode in ("ghost", "bk"):
        return True
    if mode == "per_sample":
        return False
    if mode == "bk_mixopt":
        return ghost_time(dims) < instantiate_time(dims)
    if mode == "bk_mixed" and dims.io_size and dims.instantiate_cost <= dims.io_size:
        return False
    return dims.ghost_cost < dims.instantiate_cost


#: what one element of an instantiated per-sample gradient costs, in float32 multiply-adds: it is
#: written, read by its norm and read again by ``Σ_i C_i G_i``, and a layer's ``B·p·D`` of them
#: leave the caches (151 MB for a 512-channel 3×3 convolution at batch 16). From per-layer timings
#: of ResNet-18 at 64², batch 16, on one CPU core, with Grams then formed in float64 (twice the
#: float32 cost): the ghost norm was ≈ 10× faster than instantiation for its 4×4 feature maps
#: (T = 16) and ≈ 1.5× slower for its 8×8 ones (T = 64), which puts this constant between 3 and
#: 70 (between 1.5 and 35 for the float32 Grams of :func:`ghost_time`).
INSTANTIATED_ELEMENT_COST = 32


def ghost_time(dims: LayerDims) -> int:
    """Per-sample time of a ghost norm beyond what instantiation also pays, in float32
    multiply-adds: the two Gram matrices ``T²·(groups·D + p)`` (``D`` the activation side's width:
    1 for an Embedding), formed in float32 and certified by an a-posteriori bound
    (:mod:`private_engine.layers.gram`; the rare sample whose bound is loose is redone at a higher
    cost, not counted). Both paths pay the layer's weight-gradient product ``T·p·D`` once — the
    ghost path in its release ``gᵀ·diag(C)·a``, instantiation in ``G_i`` — so it is left out of
    both."""
    d = dims.D if dims.gram_D is None else dims.gram_D
    return dims.T * dims.T * (dims.groups * d + dims.p)


def instantiate_time(dims: LayerDims) -> int:
    """Per-sample time of instantiation beyond what the ghost path also pays, in float32
    multiply-adds: moving the ``p·D`` elements of ``G_i`` through memory,
    ``INSTANTIATED_ELEMENT_COST·p·D`` (the contraction ``Σ_i C_i G_i``, ``p·D`` multiply-adds per
    sample, is part of that traffic)."""
    return INSTANTIATED_ELEMENT_COST * dims.p * dims.D


#: how much larger per sample than its input and output gradient ``(a, g)`` an instantiated layer's
#: per-sample gradients may be for book-keeping to keep them (:func:`keeps_grads`)
KEEP_GRADS_SLACK = 1.25


def keeps_grads(mode: str, grad_size: int, pair_size: int) -> bool:
    """Book-keeping keeps an instantiated layer's per-sample gradients ``G_i`` (``grad_size``
    numbers per sample) until the clip factors are known (True), or its ``(a, g)`` (``pair_size``
    per sample; False). "bk_mixopt": always. The other modes: when ``grad_size ≤
    KEEP_GRADS_SLACK·pair_size``. ``G_i`` was formed for the norm anyway; kept, the clipped sum is
    the contraction ``Σ_i C_i G_i`` (``p·D`` multiply-adds per sample), where ``(a, g)`` need one
    more weight-gradient kernel over the batch (``T·p·D``). ResNet-18's 64-channel 3×3 layers on
    16×16 maps (``G_i`` 36,864 numbers per sample against 32,768 for ``(a, g)``): four such
    kernels fewer per step, ``bk_mixed`` 6–8 % faster on a loaded 2-core VM, for 1.2 MB more at
    batch 16."""
    return mode == "bk_mixopt" or grad_size <= KEEP_GRADS_SLACK * pair_size


def decide(name: str, module: nn.Module, dims: Sequence[LayerDims], mode: str) -> LayerDecision:
    """The decision for one layer given the dimensions of its calls in this batch (a pure function
    of its arguments: cached, since the same shapes come back at every step)."""
    return _decide(name, type(module).__name__, tuple(dims), mode)


@functools.lru_cache(maxsize=1 << 14)
def _decide(name: str, layer_type: str, dims: tuple, mode: str) -> LayerDecision:
    merged = merge_dims(dims)
    return LayerDecision(
        name=name,
        layer_type=layer_type,
        T=merged.T,
        D=merged.D,
        p=merged.p,
        ghost_cost=merged.ghost_cost,
        instantiate_cost=merged.instantiate_cost,
        use_ghost=use_ghost(merged, mode),
        groups=merged.groups,
        calls=len(dims),
        ghost_capable=merged.ghost_capable,
        io_size=merged.io_size,
    )


def layer_plan(
    model: nn.Module, example_input, mode: str = DEFAULT_CLIPPING_MODE
) -> List[LayerDecision]:
    """The per-layer ghost/instantiate decision for ``model`` on ``example_input``, without
    training.

    Runs one forward pass with recording hooks (no backward, no parameter change) and applies eq.
    (4.1) of Bu, Mao & Xu 2022 to every trainable layer that has a rule. ``example_input`` is a
    tensor or a tuple of positional inputs, batch-first.
    """
    from ..capture.recorder import LayerRecorder
    from ..guards.model_check import clipped_layers

    check_mode(mode)

    recorder = LayerRecorder(clipped_layers(model, strict=False))
    try:
        with torch.enable_grad():
            args = example_input if isinstance(example_input, tuple) else (example_input,)
            model(*args)
        return [
            decide(l.name, l.module, [c.dims for c in l.calls], mode)
            for l in recorder.active_layers()
        ]
    finally:
        recorder.remove()


def _fmt(n: int) -> str:
    return f"{n:,}"


def format_plan(plan: Sequence[LayerDecision], title: Optional[str] = None) -> str:
    """A readable table of a layer plan with per-strategy totals of per-sample memory.

    Layers without a ghost form (affine norms, "-" in the 2T² column) count at p·D in every total.
    """
    headers = ["layer", "type", "T", "D", "p", "2T²", "pD", "choice"]
    rows = []
    for d in plan:
        rows.append(
            [
                d.name + (f" (x{d.calls})" if d.calls > 1 else ""),
                d.layer_type,
                _fmt(d.T),
                _fmt(d.D),
                _fmt(d.p),
                _fmt(d.ghost_cost) if d.ghost_capable else "-",
                _fmt(d.instantiate_cost),
                "ghost" if d.use_ghost else "instantiate",
            ]
        )
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    line = lambda r: "  ".join(
        c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
    )
    out = [title] if title else []
    out += [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]
    ghost_total = sum(d.ghost_cost if d.ghost_capable else d.instantiate_cost for d in plan)
    inst_total = sum(d.instantiate_cost for d in plan)
    mixed_total = sum(d.ghost_cost if d.use_ghost else d.instantiate_cost for d in plan)
    n_ghost = sum(d.use_ghost for d in plan)
    out.append("")
    out.append(
        f"per-sample memory (elements): all ghost {_fmt(ghost_total)} "
        f"| all instantiate {_fmt(inst_total)} | this plan {_fmt(mixed_total)} "
        f"({n_ghost} ghost, {len(plan) - n_ghost} instantiate)"
    )
    return "\n".join(out)
