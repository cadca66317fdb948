"""One DP training run through the real engine, observed at every step on the canary directions.

The run is the one a user would write, through either door: :class:`private_engine.PrivacyEngine`
with Poisson batches from :func:`private_engine.data.poisson_loader` (its secret generator) and
``optimizer.step(loss=…)`` through :func:`private_engine.training.private_logical_step`, in the
clipping mode asked for; or :class:`private_engine.opacus_compat.PrivacyEngine`'s
``make_private`` (its Poisson ``DPDataLoader``), ``loss.mean().backward()`` and the optimizer's
``step()``. The engine's clipping and its noise (its own OS-entropy generator) are unchanged;
the optimizer is plain SGD. A white-box auditor sees every iterate θ_t; with SGD (no momentum)
``θ_t − θ_{t+1} = lr·ĝ_t`` and ``B·ĝ_t = Σ_{i∈batch} C_i g_i + N(0, σ²R²I)`` (B: the expected
batch size the step divides by), so the observation of canary i at step t is

    y_{t,i} = ⟨B·(θ_t − θ_{t+1})/lr, u_i⟩ / R  =  1[i included and sampled at t] + N(0, σ²)
              (+ cross-talk ⟨u_j, u_i⟩ of other canaries for random directions),

in units of the claimed clipping norm R, on the parameters of canary i's head. ``Σ_t y_{t,i} =
⟨θ₀ − θ_T, u_i⟩·B/(lr·R)``: the final model's score is the sum.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Observations", "observe_training"]


@dataclass
class Observations:
    """``y`` (steps × m): the per-step observations of the canaries, in units of R (the
    ``linear`` canaries first, then each other path's); the mean cross-entropy of the examples in
    the first and last batch."""

    y: torch.Tensor
    first_loss: float
    last_loss: float


def observe_training(model, dataset, canary_set, *, batch_size: int, steps: int,
                     noise_multiplier: float, max_grad_norm: float, unit: float, delta: float,
                     accountant: str, lr: float, progress: bool = False, paths: Sequence = (),
                     door: str = "native", clipping_mode: str = None) -> Observations:
    """Train ``model`` on ``dataset`` for ``steps`` private steps of the real engine at
    ``(noise_multiplier, max_grad_norm)`` and return the canaries' observations divided by
    ``unit`` (the claimed R).

    ``canary_set``: the ``linear`` canaries (None when that path is not audited); ``paths``: the
    other paths' canaries (:mod:`private_engine.audit.paths`). ``door``: "native"
    (:class:`private_engine.PrivacyEngine`, ``optimizer.step(loss=…)``, in ``clipping_mode``) or
    "opacus" (:class:`private_engine.opacus_compat.PrivacyEngine`, ``make_private`` with Poisson
    sampling, ``loss.mean().backward()``, its optimizer's ``step``)."""
    from tqdm.auto import tqdm

    from .model import per_sample_loss

    n = len(dataset)
    m_lin = canary_set.m if canary_set is not None else 0
    m = m_lin + sum(p.m for p in paths)
    y = torch.empty(steps, m, dtype=torch.float64)
    data_losses = []

    def loss_fn(net, inputs, c, weight, is_canary, labels, slot=None):
        loss = per_sample_loss(net, inputs, c, weight, is_canary, labels, slot, paths)
        examples = loss.detach()[~is_canary]
        data_losses.append(float(examples.mean()) if examples.numel() else float("nan"))
        return loss

    head = model.canary_head.weight if canary_set is not None else None

    def snapshot():
        return (head.detach().clone() if head is not None else None,
                [p.snapshot() for p in paths])

    def observe(t, before, divisor):
        after = snapshot()
        scale = divisor / lr / unit
        parts = []
        if head is not None:
            parts.append(canary_set.project((before[0] - after[0]).to(torch.float64)) * scale)
        parts += [p.project(b - a) * scale for p, b, a in zip(paths, before[1], after[1])]
        y[t] = torch.cat(parts)

    with warnings.catch_warnings():
        # Opacus' RDP accountant warns when a control's tiny σ has its optimal order at the edge
        # of its grid (the engine's own budget of the run); the audit's claim is computed apart.
        # The fallback head is named in a warning, and Opacus warns that secure_mode is off.
        warnings.filterwarnings("ignore", message="Optimal order is the", category=UserWarning)
        warnings.filterwarnings("ignore", message="these modules are clipped by the torch.func")
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        warnings.filterwarnings("ignore", message="There is a performance drop")  # vmap, SDPA
        run = _opacus_run if door == "opacus" else _native_run
        with contextlib.closing(run(model, dataset, loss_fn, snapshot, n=n,
                                    batch_size=batch_size, steps=steps,
                                    noise_multiplier=noise_multiplier,
                                    max_grad_norm=max_grad_norm, delta=delta,
                                    accountant=accountant, lr=lr, progress=progress,
                                    clipping_mode=clipping_mode, tqdm=tqdm)) as run_steps:
            for t, before, divisor in run_steps:
                observe(t, before, divisor)
    losses = data_losses or [float("nan")]
    return Observations(y, losses[0], losses[-1])


def _batches(loader):
    """Batches forever (a new pass over the Poisson loader when one ends)."""
    while True:
        yield from loader


def _native_run(model, dataset, loss_fn, snapshot, *, n, batch_size, steps, noise_multiplier,
                max_grad_norm, delta, accountant, lr, progress, clipping_mode, tqdm):
    """The native door: ``(t, parameters before step t, divisor B)`` after each step."""
    from ..clipping.plan import DEFAULT_CLIPPING_MODE
    from ..data import poisson_loader
    from ..engine import PrivacyEngine
    from ..training import private_logical_step
    from .canaries import collate_rows

    engine = PrivacyEngine(model, batch_size=batch_size, sample_size=n,
                           max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
                           steps=steps, target_delta=delta, accountant=accountant,
                           clipping_mode=clipping_mode or DEFAULT_CLIPPING_MODE,
                           # exactly `steps` steps; the claim is accounted apart (run.py), so the
                           # engine's own step guard (one accountant call per run) is not needed
                           allow_overrun=True)
    try:
        optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=lr))
        batches = _batches(poisson_loader(dataset, batch_size, collate_fn=collate_rows))
        for t in tqdm(range(steps), desc="audit steps", disable=not progress, leave=False):
            batch = next(batches)
            before = snapshot()
            private_logical_step(optimizer, batch, lambda *b: loss_fn(model, *b),
                                 physical_batch_size=n)
            yield t, before, batch_size
    finally:
        engine.detach()


def _opacus_run(model, dataset, loss_fn, snapshot, *, n, batch_size, steps, noise_multiplier,
                max_grad_norm, delta, accountant, lr, progress, clipping_mode, tqdm):
    """The Opacus door: ``make_private`` (its Poisson ``DPDataLoader`` at rate
    ``1/len(loader) = B/n``), ``loss.mean().backward()``, ``optimizer.step()``; the divisor is
    the optimizer's expected batch size."""
    from torch.utils.data import DataLoader

    from ..opacus_compat import PrivacyEngine as OpacusPrivacyEngine
    from .canaries import collate_rows

    if n % batch_size:
        raise ValueError(f"the Opacus door samples at rate 1/len(loader): batch_size "
                         f"({batch_size}) must divide the {n} rows.")
    engine = OpacusPrivacyEngine(accountant=accountant)
    loader = DataLoader(dataset, batch_size=batch_size, collate_fn=collate_rows)
    private, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), data_loader=loader,
        noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, poisson_sampling=True)
    try:
        if abs(loader.sample_rate - batch_size / n) > 1e-12:
            raise RuntimeError(f"internal error: the Opacus loader samples at "
                               f"{loader.sample_rate}, not {batch_size / n}.")
        batches = _batches(loader)
        for t in tqdm(range(steps), desc="audit steps", disable=not progress, leave=False):
            batch = next(batches)
            before = snapshot()
            loss_fn(private, *batch).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            yield t, before, optimizer.expected_batch_size
    finally:
        private.remove_hooks()
