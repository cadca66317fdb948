"""Clipping functions ``C_i = C(‖g_i‖, R)``: each keeps ``‖C_i g_i‖ ≤ R`` for every norm ≥ 0."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Union

import torch

ClipFn = Callable[[torch.Tensor, float], torch.Tensor]

ABADI_EPS = 1e-6
AUTOMATIC_GAMMA = 0.01


def abadi_clip(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """Abadi et al. (2016) clipping: ``C_i = min(1, R / (‖g_i‖ + 1e-6))``.

    The 1e-6 guard matches Opacus, so ``‖C_i g_i‖ ≤ R`` and results agree with it exactly.
    """
    return (max_grad_norm / (norms + ABADI_EPS)).clamp(max=1.0)


def automatic_clip(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """Automatic clipping (Bu et al., 2022, "Automatic clipping"): ``C_i = R / (‖g_i‖ + γ)``, γ =
    0.01.

    Every sample is normalised; ``‖C_i g_i‖ = R·‖g_i‖/(‖g_i‖+γ) < R``.
    """
    return max_grad_norm / (norms + AUTOMATIC_GAMMA)


def global_clip(norms: torch.Tensor, max_grad_norm: float,
                threshold: Optional[float] = None) -> torch.Tensor:
    """Global clipping (Bu et al., 2021): ``C_i = (R / Z)·1{‖g_i‖ < Z}`` with threshold Z
    (default Z = R).

    Samples with norm below Z are kept, rescaled by R/Z; others are dropped, so ``‖C_i g_i‖ < R``.
    """
    z = max_grad_norm if threshold is None else threshold
    return (norms < z).to(norms.dtype) * (max_grad_norm / z)


CLIPPING_FUNCTIONS: Dict[str, ClipFn] = {
    "abadi": abadi_clip,
    "automatic": automatic_clip,
    "global": global_clip,
}


def resolve_clipping_fn(clipping_fn: Union[str, ClipFn]) -> Tuple[ClipFn, bool]:
    """The clip function for a name or callable, and whether it is user-supplied (then checked)."""
    if callable(clipping_fn):
        return clipping_fn, True
    if clipping_fn not in CLIPPING_FUNCTIONS:
        raise ValueError(
            f"clipping_fn must be one of {sorted(CLIPPING_FUNCTIONS)} or a callable "
            "(norms, max_grad_norm) -> "
            f"factors; got {clipping_fn!r}."
        )
    return CLIPPING_FUNCTIONS[clipping_fn], False


def per_sample_factors(clip_fn: ClipFn, norms: torch.Tensor,
                       max_grad_norm: float) -> torch.Tensor:
    """``C_i = clip_fn(‖g_i‖, R)`` evaluated on each sample's norm alone, so that no factor can
    depend on another sample's norm (a user's ``R / norms.max()`` would couple every sample's
    factor to the largest norm of the batch, and one sample could then move all the others).

    ``torch.vmap`` over ``norms.view(B, 1)`` calls the function on a batch of one norm per sample,
    in one vectorised call. A function vmap cannot run (Python control flow on a norm's value,
    ``float()``/``.item()``, random draws) is refused with a ``ValueError``: called sample by
    sample in batch order it could carry state from one sample's call to the next. Returns what
    the function returned, ``(B,)`` when it gives one value per call (else refused by
    :func:`clip_factors`).
    """
    one_each = norms.reshape(-1, 1)
    try:
        out = torch.vmap(lambda n: clip_fn(n, max_grad_norm))(one_each)
    except Exception as e:  # noqa: BLE001 - any failure is the function's: refuse it, naming it
        raise ValueError(
            f"the custom clipping_fn {getattr(clip_fn, '__name__', clip_fn)!r} cannot be "
            f"vectorised by torch.vmap ({type(e).__name__}: {str(e)[:200]}): a clipping function "
            "must be a pure function of one sample's norm, written with tensor operations "
            "(torch.where instead of a Python if, no .item()/float(), no state kept between "
            "calls), so that it can be applied to each sample alone.") from e
    if not isinstance(out, torch.Tensor) or out.numel() != norms.numel():
        return out
    return out.reshape(norms.shape)


def clip_factors(
    clip_fn: ClipFn, norms: torch.Tensor, max_grad_norm: float, checked: bool = False
) -> torch.Tensor:
    """``C_i = clip_fn(‖g_i‖, R)``. ``checked`` (a user's function): evaluated per sample
    (:func:`per_sample_factors`), and the factors must be finite, ``≥ 0`` and keep
    ``C_i·‖g_i‖ ≤ R`` (to a relative 1e-6), or a ValueError is raised before anything is
    released."""
    if checked:
        factors = per_sample_factors(clip_fn, norms, max_grad_norm)
    else:
        factors = clip_fn(norms, max_grad_norm)
    if checked:
        if not isinstance(factors, torch.Tensor) or factors.shape != norms.shape:
            raise ValueError(
                "a custom clipping_fn must return one factor per sample (same shape as norms)."
            )
        too_big = factors * norms > max_grad_norm * (1 + 1e-6)
        bad = ~torch.isfinite(factors) | (factors < 0) | too_big
        if bool(bad.any()):
            raise ValueError(
                "the custom clipping_fn returned factors that are not finite, or with C_i < 0 "
                "or C_i·‖g_i‖ > max_grad_norm (norms are ≥ 0, possibly 0); the sensitivity "
                "would exceed max_grad_norm and the privacy guarantee would not hold."
            )
    return factors


def finite_factors(factors_of: Callable[[torch.Tensor], torch.Tensor], norms: torch.Tensor,
                   loss: Optional[torch.Tensor] = None):
    """``(norms, factors, keep, dropped)``: clip factors ``factors_of(norms)`` for certified
    ``norms``, with every sample whose norm (or loss) is not finite dropped — ``C_i = 0``, and
    ``keep`` (bool ``(B,)``, None when nothing was dropped) tells the clipped sums to zero its
    rows. A per-sample decision: one sample (a crafted value that overflows the forward, a float16
    overflow) never makes the step fail. ``dropped`` is a Python int (one host sync).

    Norm and loss are tested together, ``isfinite(‖g_i‖ + 0·L_i)``: ``0·L_i`` is ±0 for a finite
    loss (the sum is the norm itself) and NaN for an infinite or NaN one."""
    probe = norms if loss is None else norms + loss.detach() * 0
    ok = torch.isfinite(probe)
    dropped = norms.shape[0] - int(ok.sum())
    if not dropped:
        return norms, factors_of(norms), None, 0
    norms = torch.where(ok, norms, torch.zeros_like(norms))
    factors = torch.where(ok, factors_of(norms), torch.zeros_like(norms))
    return norms, factors, ok, dropped
