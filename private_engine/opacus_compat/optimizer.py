"""Opacus' own optimizers, fed with our clipped sums.

Opacus' ``DPOptimizerFastGradientClipping`` expects ``p.grad`` to already hold the clipped
gradient sum ``Σ_i C_i g_i``; its ``step`` then does exactly what every Opacus optimizer does
after clipping: accumulate across skipped steps (BatchMemoryManager), add Gaussian noise
``N(0, σ²R²)`` per parameter with ``_generate_noise`` (same generator calls, same secure mode),
divide by ``expected_batch_size × accumulated_iterations`` for ``loss_reduction="mean"``, call the
accountant hook and the wrapped optimizer. We subclass it only to

* count accumulated backward passes as Opacus' ``DPOptimizer`` does (``len(p.grad_sample)``),
* treat a parameter that received no gradient (empty Poisson batch) as a zero sum,
* tell the :class:`~.module.PrivateModule` when ``p.grad`` was consumed or zeroed,
* refuse to step on gradients the module did not clip (Opacus raises there too, for want of
  ``p.grad_sample``): a parameter that became trainable after ``make_private`` (``requires_grad_``
  or ``add_param_group``; ``self.params`` is recomputed each step, as in Opacus), or a backward run
  with the hooks disabled.

:class:`PerLayerClippedSumOptimizer` uses the noise scale of Opacus' ``DPPerLayerOptimizer``:
``R = ‖(R_1, …, R_K)‖₂``.

Distributed (a model wrapped in DPDDP or DDP): :class:`DistributedClippedSumOptimizer` is the same
thing on top of Opacus' ``DistributedDPOptimizerFastGradientClipping``. Each rank's ``p.grad``
holds the clipped sum of its own samples; ``step`` accumulates, adds the noise on rank 0 only,
divides by the per-rank ``expected_batch_size × accumulated_iterations``, then all-reduces (sum)
and, for ``loss_reduction="mean"``, divides by the world size — Opacus' code. Every rank then
holds ``(Σ_{all ranks} Σ_i C_i g_i + N(0, σ²R²I)) / (B_rank·W)``: one noise draw in total, and
the same update on every rank.
"""
from __future__ import annotations

import copy
from typing import List, Optional

import torch
from opacus.optimizers import (DistributedDPOptimizerFastGradientClipping,
                               DPOptimizerFastGradientClipping)

from .module import PrivateModule


class ClippedSumOptimizer(DPOptimizerFastGradientClipping):
    """Opacus DP optimizer whose clipping happened in :class:`PrivateModule`'s backward.

    Step: ``θ ← opt(θ, (Σ_i C_i g_i + N(0, σ²R²I)) / (B_exp·k))`` with k accumulated backward
    passes (``loss_reduction="mean"``; no division for "sum").
    """

    def __init__(self, optimizer, *, module: Optional[PrivateModule] = None, **kwargs):
        super().__init__(optimizer, **kwargs)
        self.private_module = module

    @property
    def accumulated_iterations(self) -> int:
        if self.private_module is None:
            return 1
        return max(1, self.private_module.backward_passes)

    def accumulate(self):
        """``p.summed_grad += p.grad`` (a parameter without gradient adds zero)."""
        for p in self.params:
            grad = p.grad.data if p.grad is not None else torch.zeros_like(p)
            if p.summed_grad is not None:
                p.summed_grad.add_(grad)
            else:
                p.summed_grad = copy.deepcopy(grad)

    def pre_step(self, closure=None):
        # raises on unclipped p.grad: nothing consumed, nothing released
        if self.private_module is not None:
            self.private_module.check_releasable(self.params)
        try:
            return super().pre_step(closure)
        finally:
            if self.private_module is not None:
                self.private_module.optimizer_consumed()

    def zero_grad(self, set_to_none: bool = False):
        super().zero_grad(set_to_none)
        if self.private_module is not None:
            self.private_module.optimizer_zero_grad()


class PerLayerClippedSumOptimizer(ClippedSumOptimizer):
    """Per-layer clipping (one threshold per parameter tensor); noise std ``σ·‖(R_k)‖₂`` as in
    Opacus."""

    def __init__(self, optimizer, *, max_grad_norm: List[float], **kwargs):
        self.max_grad_norms = list(max_grad_norm)
        flat = torch.norm(torch.Tensor(self.max_grad_norms), p=2).item()
        super().__init__(optimizer, max_grad_norm=flat, **kwargs)


class DistributedClippedSumOptimizer(ClippedSumOptimizer,
                                     DistributedDPOptimizerFastGradientClipping):
    """Opacus' ``DistributedDPOptimizerFastGradientClipping`` fed with our clipped sums.

    Step: ``θ ← opt(θ, all_reduce_sum((S_r + [r = 0]·N(0, σ²R²I)) / (B_exp·k)) / W)`` with
    ``S_r`` rank r's clipped sum, ``B_exp`` the per-rank expected batch size (Opacus divides the
    global one by the world size W) and k accumulated backward passes ("mean"; for "sum" neither
    division).
    """


class DistributedPerLayerClippedSumOptimizer(PerLayerClippedSumOptimizer,
                                             DistributedClippedSumOptimizer):
    """Per-layer clipping in distributed training: the noise and scaling of Opacus'
    ``SimpleDistributedPerLayerOptimizer`` (std ``σ·‖(R_k)‖₂`` on rank 0, all-reduced sums)."""
