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
  or ``add_param_group``; ``self.params`` is recomputed each step, as in Opacus), a backward run
  with the hooks disabled, or a backward after ``step()`` without ``zero_grad()``,
* say so when ``grad_samples`` is read: per-sample gradients are not stored.

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
import math
from typing import List, Optional

import torch
from opacus.optimizers import (
    AdaClipDPOptimizer,
    DistributedDPOptimizerFastGradientClipping,
    DPOptimizerFastGradientClipping,
)
from opacus.optimizers.optimizer import _check_processed_flag, _generate_noise, _mark_as_processed

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

    @property
    def grad_samples(self):
        """Not available: per-sample gradients are never stored (the clipped sums are formed in
        the backward); raises ``AttributeError`` saying so. ``module.last_norms`` holds the
        per-sample gradient norms of the last backward."""
        raise AttributeError(
            "optimizer.grad_samples is not available with private_engine's make_private: "
            "per-sample gradients are never materialised (p.grad_sample does not exist); each "
            "backward leaves the clipped sum Σ_i C_i·∂L_i/∂θ in p.grad. The per-sample gradient "
            "norms of the last backward are in the returned module's last_norms.")

    def clip_and_accumulate(self):
        """Nothing to do: the module's backward already clipped (Opacus' fast-gradient-clipping
        optimizer does the same)."""

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

    def step(self, closure=None):
        """Opacus' step; afterwards the module's state guard records the updated parameters, the
        state the next step must leave as it is."""
        try:
            return super().step(closure)
        finally:
            if self.private_module is not None:
                self.private_module.state_guard.arm()

    def zero_grad(self, set_to_none: bool = False):
        super().zero_grad(set_to_none)
        if self.private_module is not None:
            self.private_module.optimizer_zero_grad()


class AdaptiveClippedSumOptimizer(ClippedSumOptimizer, AdaClipDPOptimizer):
    """Adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy 2021, "Differentially Private
    Learning with Adaptive Clipping"), Opacus' ``AdaClipDPOptimizer`` interface and arguments
    (``target_unclipped_quantile`` γ, ``clipbound_learning_rate`` η, ``max_clipbound``,
    ``min_clipbound``, ``unclipped_num_std`` σ_b), on our clipped sums.

    Each step (a logical batch of expected size m = ``expected_batch_size`` × accumulated
    backward passes, n samples, b_i = 1 when sample i was not clipped, ``‖g_i‖ + 1e-6 ≤ R``):

    * the gradient: ``(Σ_i C_i g_i + N(0, σ_Δ²R²I)) / m`` with
      ``σ_Δ = (σ^-2 − (2σ_b)^-2)^{-1/2}`` (Theorem 1 of the paper; σ the ``noise_multiplier``,
      which the accountant is given, as in Opacus; σ < 2σ_b is required);
    * the unclipped fraction ``b̃ = (Σ_i (b_i − 1/2) + N(0, σ_b²)) / m + 1/2`` (the paper's
      recentred count: sensitivity 1/2 under adding or removing a sample, the factor 2 above;
      m is public, n is not);
    * the bound ``R ← clamp(R·exp(−η (b̃ − γ)), min_clipbound, max_clipbound)``, used by the next
      step's clipping and noise.

    With fixed-size batches (no Poisson sampling, n = m) ``b̃ = (Σ_i b_i + N(0, σ_b²)) / n``,
    Opacus' formula, and for the same noise generator the results are Opacus'. Opacus divides by
    the sampled batch size n, which under Poisson sampling is private; and it counts only the
    last physical batch of a ``BatchMemoryManager`` logical batch (its ``zero_grad`` resets the
    count at skipped steps), where this optimizer counts the whole logical batch.
    """

    def __init__(self, optimizer, **kwargs):
        super().__init__(optimizer, **kwargs)
        self.unclipped_num = torch.zeros(())
        #: m of the last step (samples expected in its logical batch)
        self._expected_samples = 0.0

    def zero_grad(self, set_to_none: bool = False):
        """Clear the gradients, and the counts unless the last step was skipped (a
        ``BatchMemoryManager`` physical batch: the counts run over the logical batch)."""
        skipped = self._is_last_step_skipped
        super().zero_grad(set_to_none)
        if not skipped:
            self.sample_size = 0
            self.unclipped_num = torch.zeros(())

    def pre_step(self, closure=None):
        """Take the module's counts, then Opacus' step (accumulate, noise, scale, accountant
        hook) and, on a full step, the clip bound update."""
        module = self.private_module
        if module is not None:
            module.check_releasable(self.params)
            if module.unclipped_count is not None:
                self.unclipped_num = (self.unclipped_num.to(module.unclipped_count.device)
                                      + module.unclipped_count)
            self.sample_size += module.sample_count
        if self.expected_batch_size is None:
            raise ValueError("adaptive clipping needs expected_batch_size (the public expected "
                             "number of samples per logical batch).")
        iterations = self.accumulated_iterations
        full = super().pre_step(closure)
        if full:
            self._expected_samples = float(self.expected_batch_size * iterations)
            self.update_max_grad_norm()
        return full

    def add_noise(self):
        """``p.grad = Σ_i C_i g_i + N(0, σ_Δ²R²I)`` per parameter, then
        ``unclipped_num += N(0, σ_b²)`` (Opacus' draws, in Opacus' order)."""
        sigma = self.noise_multiplier
        adjusted = ((sigma ** -2 - (2 * self.unclipped_num_std) ** -2) ** -0.5
                    if sigma > 0 else 0.0)
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            noise = _generate_noise(std=adjusted * self.max_grad_norm, reference=p.summed_grad,
                                    generator=self.generator, secure_mode=self.secure_mode)
            p.grad = (p.summed_grad + noise).view_as(p)
            _mark_as_processed(p.summed_grad)
        count = torch.as_tensor(self.unclipped_num, dtype=torch.float32)
        self.unclipped_num = count + _generate_noise(
            std=self.unclipped_num_std, reference=count, generator=self.generator,
            secure_mode=self.secure_mode)

    def update_max_grad_norm(self):
        """``R ← clamp(R·exp(−η (b̃ − γ)), min_clipbound, max_clipbound)`` with the recentred
        noisy fraction ``b̃ = (noisy Σ b_i − n/2) / m + 1/2``."""
        m = self._expected_samples
        frac = (float(self.unclipped_num) - self.sample_size / 2) / m + 0.5
        # in log space, clamped before the exp: a large η cannot overflow (Opacus' torch.exp
        # gives inf, clamped to max_clipbound: the same bound)
        log_bound = math.log(float(self.max_grad_norm)) - \
            self.clipbound_learning_rate * (frac - self.target_unclipped_quantile)
        log_bound = min(max(log_bound, math.log(self.min_clipbound)), math.log(self.max_clipbound))
        self.max_grad_norm = min(max(math.exp(log_bound), self.min_clipbound), self.max_clipbound)


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
