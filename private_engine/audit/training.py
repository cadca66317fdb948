"""One DP training run through the real engine, observed at every step on the canary directions.

The run is :class:`private_engine.PrivacyEngine` as a user would run it: Poisson batches from
:func:`private_engine.data.poisson_loader` (its secret generator), ``optimizer.step(loss=…)``
through :func:`private_engine.training.private_logical_step`, the engine's clipping and its noise
(its own OS-entropy generator), plain SGD. A white-box auditor sees every iterate θ_t; with SGD
(no momentum) ``θ_t − θ_{t+1} = lr·ĝ_t`` and ``B·ĝ_t = Σ_{i∈batch} C_i g_i + N(0, σ²R²I)``, so
the observation of canary i at step t is

    y_{t,i} = ⟨B·(θ_t − θ_{t+1})/lr, u_i⟩ / R  =  1[i included and sampled at t] + N(0, σ²)
              (+ cross-talk ⟨u_j, u_i⟩ of other canaries for random directions),

in units of the claimed clipping norm R. ``Σ_t y_{t,i} = ⟨θ₀ − θ_T, u_i⟩·B/(lr·R)``: the final
model's score is the sum.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

__all__ = ["Observations", "observe_training"]


@dataclass
class Observations:
    """``y`` (steps × m): the per-step observations of the canaries, in units of R; the mean
    cross-entropy of the examples in the first and last batch."""

    y: torch.Tensor
    first_loss: float
    last_loss: float


def observe_training(model, dataset, canary_set, *, batch_size: int, steps: int,
                     noise_multiplier: float, max_grad_norm: float, unit: float, delta: float,
                     accountant: str, lr: float, progress: bool = False) -> Observations:
    """Train ``model`` on ``dataset`` for ``steps`` private steps of the real engine at
    ``(noise_multiplier, max_grad_norm)`` and return the canaries' observations divided by
    ``unit`` (the claimed R)."""
    from tqdm.auto import tqdm

    from ..data import poisson_loader
    from ..engine import PrivacyEngine
    from ..training import private_logical_step
    from .canaries import collate_rows
    from .model import per_sample_loss

    n = len(dataset)
    y = torch.empty(steps, canary_set.m, dtype=torch.float64)
    data_losses = []

    def loss_fn(inputs, c, weight, is_canary, labels):
        loss = per_sample_loss(model, inputs, c, weight, is_canary, labels)
        examples = loss.detach()[~is_canary]
        data_losses.append(float(examples.mean()) if examples.numel() else float("nan"))
        return loss

    with warnings.catch_warnings():
        # Opacus' RDP accountant warns when a control's tiny σ has its optimal order at the edge
        # of its grid (the engine's own budget of the run); the audit's claim is computed apart
        warnings.filterwarnings("ignore", message="Optimal order is the", category=UserWarning)
        engine = PrivacyEngine(model, batch_size=batch_size, sample_size=n,
                               max_grad_norm=max_grad_norm,
                               noise_multiplier=noise_multiplier, steps=steps,
                               target_delta=delta, accountant=accountant)
        optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=lr))
        loader = poisson_loader(dataset, batch_size, collate_fn=collate_rows)
        head = model.canary_head.weight
        batches = iter(())
        try:
            for t in tqdm(range(steps), desc="audit steps", disable=not progress, leave=False):
                batch = next(batches, None)
                if batch is None:
                    batches = iter(loader)
                    batch = next(batches)
                before = head.detach().clone()
                private_logical_step(optimizer, batch, loss_fn, physical_batch_size=n)
                update = (before - head.detach()).to(torch.float64) * (batch_size / lr)
                y[t] = canary_set.project(update) / unit
        finally:
            engine.detach()
    losses = data_losses or [float("nan")]
    return Observations(y, losses[0], losses[-1])
