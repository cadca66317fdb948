"""The criterion returned by ``make_private(..., grad_sample_mode="ghost")``.

Same interface as Opacus' ``DPLossFastGradientClipping`` (per-sample losses computed with the
criterion's ``reduction`` temporarily set to "none"; the ``shape=`` argument for per-token
losses of sequence models; arithmetic ``loss * w``, ``loss + other``, ``.item()``), but
``loss.backward()`` runs our clipping in the book-keeping mode "bk_mixed": one activation-only
backward over ``Σ_i L_i`` that yields the certified per-sample norms and keeps what the clipped
sum needs (book-keeping: Bu et al. 2023, "Differentially Private Optimization on Large Model at
Small Cost"), then forms ``Σ_i C_i ∂L_i/∂θ`` from what it kept and leaves it in ``p.grad`` — no
second backward.
"""
from __future__ import annotations

from opacus.utils.fast_gradient_clipping_utils import (
    DPLossFastGradientClipping,
    DPTensorFastGradientClipping,
)


class PrivateLossTensor(DPTensorFastGradientClipping):
    """Per-sample losses whose ``backward()`` writes the clipped gradient sum into ``p.grad``."""

    def backward(self):
        """``p.grad += Σ_i C_i ∂L_i/∂θ`` with ``C_i = min(1, R/(‖∂L_i/∂θ‖ + 1e-6))``."""
        if self.loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction = {self.loss_reduction}. Only 'sum' and 'mean' "
                             "losses are supported")
        self.module.criterion_backward(self.loss_per_sample)


def _rewrap(name):
    base = getattr(DPTensorFastGradientClipping, name)

    def op(self, *args):
        out = base(self, *args)
        return PrivateLossTensor(out.module, out.optimizer, out.loss_per_sample, out.loss_reduction)

    op.__name__ = name
    op.__doc__ = base.__doc__
    return op


for _name in ("__truediv__", "__mul__", "__rmul__", "__add__", "__radd__", "__sub__", "__rsub__",
              "__neg__"):
    setattr(PrivateLossTensor, _name, _rewrap(_name))


class PrivateLoss(DPLossFastGradientClipping):
    """Wraps a criterion: ``criterion(output, target)`` returns a :class:`PrivateLossTensor`."""

    def __call__(self, *args, shape=None, **kwargs) -> PrivateLossTensor:
        out = super().__call__(*args, shape=shape, **kwargs)
        return PrivateLossTensor(out.module, out.optimizer, out.loss_per_sample, out.loss_reduction)
