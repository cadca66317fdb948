"""What stands between the backward passes of :class:`~.module.PrivateModule` and the DP
optimizer's step: the clipped sums in ``p.grad`` (how many backward passes, clipped at which
thresholds R, how many samples and how many left unclipped), and the states in which the
optimizer must refuse to release them (hooks removed, unclipped or stale gradients)."""
from __future__ import annotations

from typing import Optional

import torch


class ReleaseState:
    """The ledger of the clipped sums in ``p.grad`` since the optimizer last consumed them."""

    def __init__(self):
        #: backward passes whose clipped sums are in p.grad since the optimizer last consumed them
        self.backward_passes = 0
        #: the optimizer read p.grad (``pre_step``) and no ``zero_grad()`` followed yet
        self.consumed = False
        self.grad_accumulation_allowed = True
        #: set when a backward with hooks disabled left unclipped gradients in p.grad (cleared by
        #: zero_grad)
        self.unclipped_grads = False
        #: set by remove_hooks()/cleanup(): nothing is clipped any more, so the optimizer refuses to
        #: step
        self.hooks_removed = False
        #: the thresholds R the clipped sums now in p.grad were clipped at (flat clipping)
        self.clipped_at: set = set()
        #: per-sample gradient norms ‖g_i‖ of the last backward (flat clipping)
        self.last_norms: Optional[torch.Tensor] = None
        #: samples clipped, and those left unclipped (clip factor 1), since the optimizer last
        #: consumed p.grad (flat clipping; read by the adaptive-clipping optimizer)
        self.sample_count = 0
        self.unclipped_count: Optional[torch.Tensor] = None
        #: a backward ran after optimizer.step() without zero_grad(): p.grad holds the noised
        #: gradient of the last step, so the next step is refused (as Opacus' is) until zero_grad()
        self.stale_grads = False

    def optimizer_consumed(self) -> None:
        """The optimizer read p.grad (``pre_step``)."""
        self.consumed = True
        self.backward_passes = 0
        self.clipped_at = set()
        self._reset_counts()

    def optimizer_zero_grad(self) -> None:
        """``zero_grad()``: p.grad is empty again."""
        self.consumed = False
        self.backward_passes = 0
        self.unclipped_grads = False
        self.stale_grads = False
        self.clipped_at = set()
        self._reset_counts()

    def _reset_counts(self) -> None:
        self.sample_count = 0
        self.unclipped_count = None

    def count_unclipped(self, factors: torch.Tensor, dropped=None) -> None:
        """Add a batch to :attr:`sample_count` and :attr:`unclipped_count`: samples whose clip
        factor is 1 (``‖g_i‖ + 1e-6 ≤ R``, Opacus' ``AdaClipDPOptimizer`` count), without the
        dropped ones (``dropped``: a bool mask of them, or their number when they are among the
        factors with factor 1). No host synchronisation."""
        unclipped = (factors >= 1)
        if isinstance(dropped, torch.Tensor):
            unclipped = unclipped & ~dropped
        count = unclipped.sum()
        if isinstance(dropped, int):
            count = count - dropped
        self.sample_count += factors.shape[0]
        self.unclipped_count = count if self.unclipped_count is None \
            else self.unclipped_count + count

    def check_clipped(self) -> None:
        """Refuse to release gradients that were not clipped (hooks removed, a stale p.grad,
        gradients of a backward with hooks disabled); Opacus raises in these cases too."""
        if self.hooks_removed:
            raise ValueError(
                "the privacy hooks of this module were removed (remove_hooks()/cleanup()), so its "
                "gradients are not clipped; nothing was released. Call make_private again to train "
                "privately."
            )
        if self.stale_grads:
            raise ValueError(
                "Gradients haven't been cleared since the last optimizer step: a backward ran "
                "after optimizer.step() without optimizer.zero_grad(), so p.grad mixes the noised "
                "gradient of the last step with new clipped sums; nothing was released. Call "
                "optimizer.zero_grad() after every optimizer.step()."
            )
        if self.unclipped_grads:
            raise ValueError(
                "p.grad holds unclipped gradients: a backward ran while the hooks were disabled "
                "(disable_hooks()). Call optimizer.zero_grad() before the next private step, or "
                "enable_hooks() before the backward."
            )

    def check_threshold(self, max_grad_norm: float) -> None:
        """Refuse clipped sums clipped at another R than the one the optimizer adds noise for."""
        if self.clipped_at and self.clipped_at != {max_grad_norm}:
            raise ValueError(
                "the gradients in p.grad were clipped at max_grad_norm "
                f"{sorted(self.clipped_at)} but the optimizer would add noise for "
                f"{max_grad_norm}: max_grad_norm "
                "changed between backward passes of one logical batch. Change it after "
                "optimizer.step() (a grad-clip scheduler steps after the optimizer).")

    def start_backward(self) -> bool:
        """Checks at the start of a backward's clipping. Returns False when p.grad still holds the
        noised gradient of the last step (no ``zero_grad()`` since ``step()``): the backward is
        not clipped, and the next step raises (Opacus refuses at that step too)."""
        if self.consumed:
            self.stale_grads = True
            return False
        if not self.grad_accumulation_allowed and self.backward_passes > 0:
            raise ValueError(
                "Poisson sampling is not compatible with grad accumulation. You need to call "
                "optimizer.step() after every forward/backward pass or consider using "
                "BatchMemoryManager."
            )
        return True
