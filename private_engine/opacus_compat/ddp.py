"""Torch ``DistributedDataParallel`` under the Opacus door, used for its forward only.

DDP's reducer would all-reduce the raw gradients in the backward, which the door's hooks replace
by zeros, and at the end of the backward copy that average over the clipped sums in ``p.grad``.
:class:`DDPGradSync` keeps the reducer idle (DDP's ``no_sync()`` state) while the door's hooks
are on; the DP optimizer's step all-reduces the clipped sums instead."""
from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel


class DDPGradSync:
    """Turns ``wrapper``'s backward all-reduce off until :meth:`restore`, which puts back the
    ``require_backward_grad_sync`` it found."""

    def __init__(self, wrapper: DistributedDataParallel):
        self.wrapper = wrapper
        #: the wrapper's require_backward_grad_sync before the door (restored by restore())
        self.saved = wrapper.require_backward_grad_sync
        _no_ddp_grad_sync(wrapper, ())
        # before every forward (no_sync() restores the flag it found, a user may set it)
        self._handle = wrapper.register_forward_pre_hook(_no_ddp_grad_sync)

    def restore(self) -> None:
        """Remove the hook and put the wrapper's flag back."""
        self._handle.remove()
        self.wrapper.require_backward_grad_sync = self.saved


def _no_ddp_grad_sync(ddp: DistributedDataParallel, inputs) -> None:
    """Forward pre-hook on a torch DDP wrapper: no reducer work in the coming backward (DDP's
    ``no_sync()`` state)."""
    ddp.require_backward_grad_sync = False
