"""Privatising torch optimizers: accumulation of clipped sums, Gaussian noise, scaling, step.

After ``k`` virtual steps and one step over physical batches B_1..B_{k+1} (a logical batch), the
parameters are updated by the wrapped optimizer with

    ĝ = ( Σ_{i ∈ B_1 ∪ … ∪ B_{k+1}} C_i·g_i  +  N(0, σ²R²·I) ) / B_expected,

noise drawn once per logical batch (Abadi et al. 2016; seed 002, Appendix E). ``B_expected`` is
the declared (expected) logical batch size. DP-SGD, DP-Adam and DP-AdamW are the torch optimizers
with this gradient.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .engine import PrivacyEngine


class PrivateStep:
    """The state a privatised optimizer carries: clipped-gradient sums of the current logical batch."""

    def __init__(self, engine: "PrivacyEngine", optimizer: torch.optim.Optimizer):
        self.engine = engine
        self.optimizer = optimizer
        self.original_step = optimizer.step
        self.grad_sums: Optional[list] = None
        self.samples = 0
        self.attached = True

    def accumulate(self, loss) -> None:
        """Clip this physical batch and add ``Σ_i C_i g_i`` to the running sums (no parameter change)."""
        grads, n = self.engine.clipped_grad_sum(loss)
        if self.grad_sums is None:
            self.grad_sums = grads
        else:
            for s, g in zip(self.grad_sums, grads):
                s.add_(g)
        self.samples += n

    def noisy_gradients(self, loss) -> list:
        """``(Σ_{logical batch} C_i g_i + σR·ξ) / B_expected`` per parameter, ξ ~ N(0, I) drawn once, with this
        physical batch's clipped sum included. Built in place in this batch's fresh sums (one parameter-sized
        noise draw at a time), so the running sums and the state stay untouched until the step succeeds."""
        grads, _ = self.engine.clipped_grad_sum(loss)  # validates and clips; raises before anything changes
        engine = self.engine
        std = engine.noise_multiplier * engine.max_grad_norm
        out = []
        for k, (p, g) in enumerate(zip(engine.params, grads)):
            if self.grad_sums is not None:
                g.add_(self.grad_sums[k])
            if std > 0:
                g.add_(torch.normal(0.0, std, size=p.shape, device=g.device, dtype=g.dtype,
                                    generator=engine.noise_generator))
            out.append(g.div_(engine.batch_size).to(p.dtype))
        return out

    def reset(self) -> None:
        self.grad_sums = None
        self.samples = 0


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
