"""One physical batch through the clipping core: the per-sample loss checked, the graph walked
(parameters reached outside their layer refused), loss scaling applied, certified norms, clip
factors with non-finite samples dropped, and the clipped sums."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

from ..capture.graph_walk import GraphWalk, outside_error
from ..foundation.dtypes import accumulation_dtype
from ..layers.precision import without_autocast
from .checkpointing import explain_activation_checkpointing
from .clipper import PerSampleClipper
from .grad_sums import GradSums
from .loss_scaling import LossScaling

log = logging.getLogger(__name__)


def check_per_sample_loss(loss, *, name: str = "loss") -> torch.Tensor:
    """Validate a per-sample loss vector ``(B,)`` (reduction="none")."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of per-sample losses, got {type(loss).__name__}.")
    if loss.dim() != 1:
        raise ValueError(
            f"{name} must hold one value per sample (shape (B,)); got shape "
            f"{tuple(loss.shape)}. Compute it with reduction=\"none\", e.g. "
            'F.cross_entropy(logits, y, reduction="none").'
        )
    if loss.numel() and not loss.requires_grad:
        raise ValueError(f"{name} does not require grad: it must come from the model's forward "
                         "pass with grad enabled.")
    return loss


@dataclass
class ClippedBatch:
    """What clipping one physical batch gives."""

    #: ``Σ_i C_i ∂L_i/∂θ`` per parameter, in flat buffers
    sums: GradSums
    #: B, the number of per-sample losses
    size: int
    #: certified ``‖g_i‖`` (None for an empty batch)
    norms: Optional[torch.Tensor]
    #: samples dropped (``C_i = 0``) because their loss or norm was not finite
    dropped: int
    #: the per-sample losses, detached (None for an empty batch); for the step's metrics
    loss: Optional[torch.Tensor] = None


def check_batch(clipper: PerSampleClipper, loss: torch.Tensor,
                names: Optional[Dict[int, str]] = None) -> Optional[GraphWalk]:
    """The checks of :func:`clip_batch` that run before any backward: the loss follows the
    batch flow and is a per-sample vector, and (non-empty) its graph reaches no trainable
    parameter outside a recorded call of its layer. Returns the graph walk (None for an empty
    loss); raises, with the clipper's records released, otherwise."""
    clipper.check_loss(loss)
    check_per_sample_loss(loss)
    if loss.numel() == 0:
        return None
    walk = clipper.recorder.walk(loss, clipper.params)
    if walk.outside:
        clipper.release()
        names = names or {}
        raise outside_error([names.get(id(p), tuple(p.shape)) for p in walk.outside],
                            {names.get(i, i): f for i, f in walk.custom_functions.items()})
    return walk


@without_autocast
def clip_batch(clipper: PerSampleClipper, loss: torch.Tensor, *,
               loss_scaling: Optional[LossScaling] = None,
               names: Optional[Dict[int, str]] = None,
               all_dropped_hint: Optional[str] = None,
               before_sums: Optional[Callable[[PerSampleClipper], None]] = None,
               walk: Optional[GraphWalk] = None,
               sums_by_buffer: Optional[tuple] = None) -> ClippedBatch:
    """Clip one physical batch of per-sample losses ``loss`` (shape ``(B,)``).

    Raises on a malformed loss, or one that reaches a trainable parameter outside a recorded call
    of its layer, before anything is modified. With ``loss_scaling`` (float16), the backward runs
    on ``S·Σ L_i`` and norms and factors are unscaled in float32. A sample whose loss or certified
    norm is not finite is dropped (``C_i = 0``, its rows zeroed). ``names``: ``{id(param): name}``
    for messages. Dropped samples go to DEBUG log records only (whether one sample was dropped
    tells whether it was in the batch; the count is in the step metrics): with
    ``all_dropped_hint`` (advice) when every sample of a batch was dropped, and under loss
    scaling, when half the batch or more was, with the scale to use instead
    (:meth:`LossScaling.overflow_advice`). ``before_sums`` (optional): called with the clipper
    once the clip factors are known, before the clipped sums are formed (FSDP2 frees the gathered
    parameters there when the sums need no weights). ``walk``: the result of
    :func:`check_batch` when the caller ran it already (the checks are not repeated).
    ``sums_by_buffer``: ``(sink, order)`` to form the sums one flat buffer at a time
    (:meth:`PerSampleClipper.clipped_sums_by_buffer`, book-keeping modes); the batch's ``sums``
    are then None (the sink holds them).
    """
    if walk is None:
        walk = check_batch(clipper, loss, names)
    if loss.numel() == 0:  # an empty (Poisson) batch contributes nothing
        clipper.release()
        # in the sums' dtype (at least float32), as a non-empty batch's: accumulated and reduced
        # across ranks alike
        zeros = [torch.zeros_like(p, dtype=accumulation_dtype(p)) for p in clipper.params]
        return ClippedBatch(GradSums.separate(zeros), 0, None, 0)
    scaling = loss_scaling if loss_scaling is not None and loss_scaling.enabled else None
    loss_in, scale = scaling.scale(loss) if scaling is not None else (loss, None)
    with explain_activation_checkpointing():
        try:
            norms = clipper.per_sample_norms(loss_in, walk)
            if scale is not None:
                norms = norms / scale.to(norms.dtype)
            # the step's one host sync
            norms, factors, keep, dropped = clipper.finite_factors(norms, loss)
            if before_sums is not None:
                before_sums(clipper)
        except BaseException:
            clipper.release()
            raise
        if scale is not None:
            factors = factors / scale.to(factors.dtype)
        if sums_by_buffer is not None:
            clipper.clipped_sums_by_buffer(factors, keep, *sums_by_buffer)
            sums = None
        else:
            sums = clipper.clipped_sums(loss_in, factors, keep=keep)  # releases what it kept
    if scaling is not None:
        scaling.update(dropped)
    # whether one sample was dropped is a membership signal: DEBUG records (off by default),
    # the count in the step metrics and engine.dropped_samples (non-private statistics)
    if dropped:
        log.debug("%d of %d samples of this batch dropped (clip factor 0): non-finite loss or "
                  "gradient norm", dropped, loss.shape[0])
    if scaling is not None and dropped and 2 * dropped >= loss.shape[0]:
        log.debug("%d of the %d samples of this batch had a non-finite scaled loss or gradient "
                  "norm: %s", dropped, loss.shape[0], scaling.overflow_advice())
    elif dropped == loss.shape[0] and all_dropped_hint is not None:
        log.debug("every sample of this batch (%d) had a non-finite loss or gradient norm: %s",
                  dropped, all_dropped_hint)
    return ClippedBatch(sums, loss.shape[0], norms.detach(), dropped, loss.detach())
