"""Privatising torch optimizers: accumulation of clipped sums, Gaussian noise, scaling, step.

After ``k`` virtual steps and one step over physical batches B_1..B_{k+1} (a logical batch), the
parameters are updated by the wrapped optimizer with

    ĝ = ( Σ_{i ∈ B_1 ∪ … ∪ B_{k+1}} C_i·g_i  +  N(0, σ²R²·I) ) / B_expected,

noise drawn once per logical batch (Abadi et al. 2016; seed 002, Appendix E). ``B_expected`` is
the declared (expected) logical batch size. DP-SGD, DP-Adam and DP-AdamW are the torch optimizers
with this gradient.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

from .grad_sums import GradSums
from .layers.base import cast
from .noise import gaussian_noise_

if TYPE_CHECKING:  # pragma: no cover
    from .engine import PrivacyEngine


class PrivateStep:
    """The state a privatised optimizer carries: clipped-gradient sums of the current logical batch."""

    def __init__(self, engine: "PrivacyEngine", optimizer: torch.optim.Optimizer):
        self.engine = engine
        self.optimizer = optimizer
        self.original_step = optimizer.step
        self.grad_sums: Optional[GradSums] = None
        self.samples = 0
        self.attached = True

    def accumulate(self, loss) -> None:
        """Clip this physical batch and add ``Σ_i C_i g_i`` to the running sums (no parameter change)."""
        sums, n = self.engine.clipped_sums(loss)
        if self.grad_sums is None:
            self.grad_sums = sums
        else:
            self.grad_sums.add_(sums)
        self.samples += n

    def noisy_gradients(self, loss) -> list:
        """``(Σ_{logical batch} C_i g_i + σR·ξ) / B_expected`` per parameter, ξ ~ N(0, I) drawn once, with this
        physical batch's clipped sum included. Built in place in this batch's fresh sums — one operation per flat
        buffer (:mod:`private_engine.grad_sums`) for the running sums and the noise, and one multi-tensor division
        that writes each parameter's gradient as a tensor of its own — so the running sums and the state stay
        untouched until the step succeeds."""
        sums, _ = self.engine.clipped_sums(loss)  # validates and clips; raises before anything changes
        engine = self.engine
        std = engine.noise_multiplier * engine.max_grad_norm
        if self.grad_sums is not None:
            sums.add_(self.grad_sums)
        if std > 0:
            add_gaussian_noise(sums.buffers, std, engine.noise_generator, engine.secure_mode)
        grads = sums.own_grads(float(engine.batch_size))  # one operation: divided, out of the flat buffers
        return [cast(g, p.dtype) for p, g in zip(engine.params, grads)]

    def reset(self) -> None:
        self.grad_sums = None
        self.samples = 0


#: elements drawn by one ``normal_`` call in ``add_gaussian_noise`` (64 MiB of float32)
NOISE_CHUNK = 1 << 24


def add_gaussian_noise(tensors: Sequence[torch.Tensor], std: float,
                       generator: Optional[torch.Generator] = None,
                       secure_mode: bool = False) -> None:
    """``t ← t + std·ξ_t`` in place for every tensor, ξ ~ N(0, I) independent across all coordinates (the
    Gaussian mechanism's noise, Abadi et al. 2016; seed 002, Alg. 1). The tensors must not overlap.

    Consecutive tensors of one device and dtype share one ``normal_`` draw of at most ``NOISE_CHUNK``
    elements, added by one ``_foreach_add_``; a contiguous tensor larger than that (a flat buffer of clipped
    sums) is noised chunk by chunk. So a step costs a few kernel launches here, not two per parameter tensor,
    and at most one chunk of noise is alive at a time. On the CPU a chunk is drawn by several threads, each
    block of it by its own generator keyed from ``generator`` (:mod:`private_engine.cpu_noise`).
    ``secure_mode``: each chunk from the OS cryptographic generator instead, as the sum of four
    draws over two (:func:`private_engine.noise.gaussian_noise_`); ``generator`` must be None.
    """
    group: List[torch.Tensor] = []
    size = 0

    def flush():
        if not group:
            return
        first = group[0]
        noise = gaussian_noise_(torch.empty(size, device=first.device, dtype=first.dtype), std,
                                generator, secure_mode)
        views, offset = [], 0
        for t in group:
            views.append(noise[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()
        torch._foreach_add_(group, views)
        group.clear()

    pieces: List[torch.Tensor] = []
    for t in tensors:
        if t.numel() > NOISE_CHUNK and t.is_contiguous():
            pieces.extend(t.view(-1).split(NOISE_CHUNK))
        else:
            pieces.append(t)
    for t in pieces:
        if group and (t.device != group[0].device or t.dtype != group[0].dtype or size + t.numel() > NOISE_CHUNK):
            flush()
            size = 0
        group.append(t)
        size += t.numel()
    flush()


def attach(engine: "PrivacyEngine", optimizer: torch.optim.Optimizer) -> PrivateStep:
    """Replace ``optimizer.step`` by the private step and add ``optimizer.virtual_step``."""
    state = PrivateStep(engine, optimizer)

    def virtual_step(loss=None):
        """Clip the per-sample ``loss`` of this physical batch and accumulate (gradient accumulation)."""
        if not state.attached:
            raise RuntimeError(_DETACHED)
        if loss is None:
            raise ValueError("virtual_step needs loss=<per-sample losses, shape (B,)>.")
        state.accumulate(loss)

    engine = state.engine

    def step(loss=None, closure=None):
        """Clip ``loss`` (per-sample), add noise once, average, and update the parameters."""
        if not state.attached:
            raise RuntimeError(_DETACHED)
        if closure is not None:
            raise ValueError("closures are not supported by private steps; pass loss=<per-sample losses>.")
        if loss is None:
            raise ValueError(
                "optimizer.step() needs loss=<per-sample losses, shape (B,)> (reduction='none'): the engine clips "
                "each sample's gradient from it. Use optimizer.virtual_step(loss=...) to accumulate."
            )
        engine.check_optimizer(state.optimizer)  # every parameter it updates must be clipped
        noisy = state.noisy_gradients(loss)  # validates and clips; state untouched on error
        saved = [p.grad for p in engine.params]
        for p, g in zip(engine.params, noisy):
            p.grad = g
        try:
            result = state.original_step()
        except Exception:
            for p, g in zip(engine.params, saved):
                p.grad = g
            raise
        engine._account_step()
        state.reset()
        return result

    optimizer.step = step
    optimizer.virtual_step = virtual_step
    return state


_DETACHED = "the privacy engine was detached from this optimizer; call engine.attach(optimizer) again."


def detach(state: PrivateStep) -> None:
    """Restore the optimizer's own (non-private) step; private calls then raise a clear error."""
    opt = state.optimizer
    original = state.original_step
    state.attached = False
    state.reset()

    def step(*args, loss=None, **kwargs):
        if loss is not None:
            raise RuntimeError(_DETACHED)
        return original(*args, **kwargs)

    def virtual_step(loss=None):
        raise RuntimeError(_DETACHED)

    opt.step = step
    opt.virtual_step = virtual_step


def _dp_optimizer(base: type, formula: str) -> type:
    def __init__(self, params, *args, privacy_engine: "PrivacyEngine", **kwargs):
        base.__init__(self, params, *args, **kwargs)
        privacy_engine.attach(self)

    doc = (f"{base.__name__} on the private gradient ĝ = (Σ_i C_i g_i + N(0, σ²R²I)) / B (Abadi et al. 2016); "
           f"{formula}\n\nConstruct with the same arguments as ``torch.optim.{base.__name__}`` plus "
           "``privacy_engine=``; then call ``step(loss=per_sample_losses)`` / ``virtual_step(loss=...)``.")
    return type("DP" + base.__name__, (base,), {"__init__": __init__, "__doc__": doc})


DPSGD = _dp_optimizer(torch.optim.SGD, "update θ ← θ − η·ĝ (with the SGD options given).")
DPAdam = _dp_optimizer(torch.optim.Adam, "Adam moments m, v of ĝ; θ ← θ − η·m̂/(√v̂ + ε).")
DPAdamW = _dp_optimizer(torch.optim.AdamW, "Adam on ĝ with decoupled weight decay θ ← θ − ηλθ.")

__all__ = ["DPSGD", "DPAdam", "DPAdamW", "attach", "detach", "PrivateStep"]
