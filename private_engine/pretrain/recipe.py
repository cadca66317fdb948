"""DP-MAES, the two-step recipe of Yu, Sanjabi, Ma, Chaudhuri & Guo, "ViP: A Differentially
Private Foundation Model for Computer Vision" (Section 3.3):

* **Step 1** — synthetic pre-training for initialisation: minimise the MAE loss
  ``(1/n_s) Σ_j ℓ(s_j; θ)`` over procedural images ``s_j`` with plain AdamW (no private data, no
  privacy cost): :func:`pretrain_synthetic`.
* **Step 2** — DP training from that initialisation: DP-AdamW on the private images, each step
  on a Poisson batch of expected size B (rate q = B/n) with

      ĝ = ( Σ_{i∈B} clip_C(∇ℓ(x_i; θ)) + N(0, σ²C²I) ) / B,

  the logical batch accumulated over physical chunks, σ calibrated so that the whole run is
  (ε, δ)-DP (Opacus' RDP accountant by default): :func:`dp_mae_train`.

The paper's defaults are :class:`DPMAEConfig`'s: ε = 8, δ = 1/(2n), C = 0.1, mask ratio 0.75
(the model's), AdamW. :func:`dp_maes` runs both steps.

Randomness. Step 2's masks are :class:`~private_engine.pretrain.masks.KeyedMasks`: sample i's
mask at step t is a keyed pseudorandom function of (t, x_i) with a secret 256-bit key, so it does
not depend on the other samples of the batch or of any earlier batch, and the clipped sum moves
by at most R when one sample is added or removed. The Poisson batches and the noise draw from OS
entropy (:mod:`private_engine.foundation.randomness`). Step 1's order and masks are secret by
default too. A seed given for either step makes it reproducible, with a
``ReproducibleRandomnessWarning``.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader, Dataset

from ..foundation.randomness import secret_generator
from .mae import MaskedAutoencoder
from .masks import KeyedMasks

log = logging.getLogger(__name__)

__all__ = ["SyntheticConfig", "DPMAEConfig", "DPMAEResult", "pretrain_synthetic",
           "dp_mae_train", "dp_maes"]


@dataclass
class SyntheticConfig:
    """Step 1, non-private AdamW (β = (0.9, 0.95) and weight decay 0.05 as in He et al.,
    "Masked Autoencoders Are Scalable Vision Learners")."""

    epochs: int = 5
    batch_size: int = 128
    lr: float = 1.5e-3
    weight_decay: float = 0.05
    betas: Tuple[float, float] = (0.9, 0.95)


@dataclass
class DPMAEConfig:
    """Step 2, DP-AdamW. ``delta`` None: 1/(2n). ``batch_size``: the expected logical batch B of
    Poisson sampling; ``physical_batch_size``: samples per forward/backward."""

    epsilon: float = 8.0
    delta: Optional[float] = None
    max_grad_norm: float = 0.1
    epochs: int = 10
    batch_size: int = 256
    physical_batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.05
    betas: Tuple[float, float] = (0.9, 0.95)
    clipping_mode: str = "bk_mixed"
    clipping_fn: str = "abadi"
    accountant: str = "rdp"


@dataclass
class DPMAEResult:
    """What step 2 did: the privacy spent and the mean training loss of each logical batch."""

    epsilon: float
    delta: float
    noise_multiplier: float
    steps: int
    losses: List[float] = field(default_factory=list)
    evaluations: List[float] = field(default_factory=list)


def _images(batch):
    return batch[0] if isinstance(batch, (list, tuple)) else batch


def _quiet(*args, **kwargs) -> None:
    """What a rank other than 0 reports: nothing (rank 0 reports for the run)."""


def pretrain_synthetic(model: MaskedAutoencoder, data: Dataset,
                       config: SyntheticConfig = SyntheticConfig(), *,
                       device: Optional[torch.device] = None, seed: Any = None,
                       progress: bool = True,
                       evaluate: Optional[Callable[[], float]] = None) -> List[float]:
    """Step 1: non-private AdamW on ``(1/|b|) Σ_{j∈b} ℓ(s_j; θ)`` over shuffled mini-batches of
    ``data`` (items ``x`` or ``(x, …)``), with masks ``argsort(u_j)``, ``u_j ~ U(0, 1)^L`` i.i.d.
    Returns the mean training loss of each epoch; ``evaluate()`` (if given) is called before the
    first and after every epoch and its values logged (``logging``, INFO, this module's logger).

    The order and the masks draw from one generator: ``seed`` None (default) a secret one
    (:func:`private_engine.foundation.randomness.secret_generator`); an int or a generator makes the
    step reproducible, with a ``ReproducibleRandomnessWarning``. Only public images are read here,
    so these masks need not be keyed per sample as step 2's are."""
    from tqdm.auto import tqdm

    device = device or next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                            weight_decay=config.weight_decay)
    rng = secret_generator(seed, "cpu", "the order and masks of synthetic pre-training")
    loader = DataLoader(data, batch_size=config.batch_size, shuffle=True, generator=rng,
                        drop_last=len(data) > config.batch_size)
    say = log.info
    if evaluate is not None:
        say(f"synthetic pre-training: test loss before {evaluate():.4f}")
    history = []
    model.train()
    for epoch in range(1, config.epochs + 1):
        total, count = 0.0, 0
        bar = tqdm(loader, desc=f"synthetic {epoch}/{config.epochs}", leave=False,
                   disable=not progress)
        for batch in bar:
            x = _images(batch).to(device)
            ids = model.shuffle_ids(torch.rand(x.shape[0], model.num_patches, generator=rng))
            loss = model(x, ids_shuffle=ids.to(device)).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * x.shape[0]
            count += x.shape[0]
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
        history.append(total / max(count, 1))
        note = f", test loss {evaluate():.4f}" if evaluate is not None else ""
        say(f"synthetic epoch {epoch}: train loss {history[-1]:.4f}{note}")
    opt.zero_grad(set_to_none=True)
    return history


def dp_mae_train(model: MaskedAutoencoder, data: Dataset, config: DPMAEConfig = DPMAEConfig(),
                 *, device: Optional[torch.device] = None, checkpoint: Optional[str] = None,
                 resume: bool = False, distributed: Optional[bool] = None, mask_seed: Any = None,
                 progress: bool = True, evaluate: Optional[Callable[[], float]] = None,
                 loader_generator: Optional[torch.Generator] = None,
                 step_logger: Any = None) -> DPMAEResult:
    """Step 2: (ε, δ)-DP MAE training of ``model`` on the private ``data`` (items ``x`` or
    ``(x, …)``; labels are never read) with DP-AdamW (see the module docstring).

    σ is calibrated from ``config.epsilon`` for ``epochs · ⌊n/B⌋`` Poisson steps (rate B/n);
    each logical batch goes through ``private_logical_step`` in physical chunks. ``checkpoint``:
    after every epoch, model + optimizer + engine (accountant, noise generator) + progress are
    written there atomically (:func:`private_engine.save_checkpoint`; secret like the data);
    ``resume`` continues from it. ``distributed`` as in ``PrivacyEngine``/``poisson_loader``
    (None: on under an initialised process group). The Poisson sampler and the noise draw from
    OS entropy unless ``loader_generator`` is given (tests).

    The masks: sample i's mask at step t (the engine's step count) is
    ``KeyedMasks.ids(x_i, t)``, a keyed pseudorandom function of t and of x_i's own bytes
    (:mod:`private_engine.pretrain.masks`): it does not depend on the other samples of this or
    any earlier batch, so the clipped sum moves by at most C when one sample is added or
    removed. The 256-bit key is secret (``mask_seed`` None, default) or drawn from ``mask_seed``
    (an int or a generator: reproducible masks, with a ``ReproducibleRandomnessWarning``); under
    ``torch.distributed`` every rank takes rank 0's key, so that a sample's mask does not depend
    on its rank; it is saved in the checkpoint and a resumed run keeps it.
    ``evaluate()`` (if given) is called before and after every epoch on rank 0. The run's
    summary and each epoch's ε are logged (``logging``, INFO); ``step_logger`` (a TensorBoard
    ``SummaryWriter`` or a callable) gets every step's metrics
    (:meth:`private_engine.PrivacyEngine.add_step_logger`).
    """
    from tqdm.auto import tqdm

    from ..checkpoint import load_checkpoint, save_checkpoint
    from ..data import poisson_loader
    from ..engine import PrivacyEngine
    from ..optim import DPAdamW
    from ..training import private_logical_step

    device = device or next(model.parameters()).device
    rank = 0
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
    loader = poisson_loader(data, config.batch_size, generator=loader_generator,
                            distributed=distributed)
    steps = config.epochs * len(loader)
    engine = PrivacyEngine(model, batch_size=config.batch_size, sample_size=len(data),
                           steps=steps, max_grad_norm=config.max_grad_norm,
                           target_epsilon=config.epsilon, target_delta=config.delta,
                           clipping_mode=config.clipping_mode, clipping_fn=config.clipping_fn,
                           accountant=config.accountant, distributed=distributed,
                           step_logger=step_logger)
    opt = DPAdamW(model.parameters(), lr=config.lr, betas=config.betas,
                  weight_decay=config.weight_decay, privacy_engine=engine)
    masks = KeyedMasks(model.num_patches, seed=mask_seed)
    if engine.distributed is not None:
        masks.broadcast_(engine.distributed.device)
    result = DPMAEResult(0.0, engine.target_delta, engine.noise_multiplier, 0)
    start = 1
    if resume and checkpoint and os.path.exists(checkpoint):
        extra = load_checkpoint(checkpoint, model=model, optimizer=opt, engine=engine)
        start = int(extra["epoch"]) + 1
        result.losses = list(extra["losses"])
        result.evaluations = list(extra["evaluations"])
        masks.load_state_dict(extra["masks"])
    say = log.info if rank == 0 else _quiet
    say(f"DP-MAE: n={len(data)}, B={config.batch_size} (physical "
        f"{config.physical_batch_size}), {steps} steps, σ={engine.noise_multiplier:.4f}, "
        f"C={config.max_grad_norm}, ε={config.epsilon}, δ={engine.target_delta:.3g}, "
        f"mode={config.clipping_mode}")
    if evaluate is not None and rank == 0 and not result.evaluations:
        result.evaluations.append(evaluate())
        say(f"DP-MAE: test loss before {result.evaluations[-1]:.4f}")

    def per_sample_loss(x, ids):
        return model(x, ids_shuffle=ids)

    model.train()
    for epoch in range(start, config.epochs + 1):
        bar = tqdm(loader, desc=f"DP-MAE {epoch}/{config.epochs}", leave=False,
                   disable=not progress or rank != 0)
        for batch in bar:
            images = _images(batch)
            ids = masks.ids(images, engine.steps_taken)  # row i: (key, t, x_i) only
            loss = private_logical_step(opt, (images, ids), per_sample_loss,
                                        config.physical_batch_size, device=device)
            result.losses.append(loss)
            bar.set_postfix(loss=f"{loss:.3f}", eps=f"{engine.get_epsilon():.2f}")
        note = ""
        if evaluate is not None and rank == 0:
            result.evaluations.append(evaluate())
            note = f", test loss {result.evaluations[-1]:.4f}"
        say(f"DP-MAE epoch {epoch}: ε = {engine.get_epsilon():.3f}{note}")
        if checkpoint:
            save_checkpoint(checkpoint, model=model, optimizer=opt, engine=engine,
                            extra={"epoch": epoch, "losses": result.losses,
                                   "evaluations": result.evaluations,
                                   "masks": masks.state_dict()})
    result.epsilon = engine.get_epsilon()
    result.steps = engine.steps_taken
    engine.detach()
    return result


def dp_maes(model: MaskedAutoencoder, synthetic: Dataset, private: Dataset,
            synthetic_config: SyntheticConfig = SyntheticConfig(),
            dp_config: DPMAEConfig = DPMAEConfig(), *, device: Optional[torch.device] = None,
            seed: Any = None, progress: bool = True,
            **dp_kwargs) -> Tuple[List[float], DPMAEResult]:
    """DP-MAES: step 1 (:func:`pretrain_synthetic` on ``synthetic``, its order and masks from
    ``seed``: None, secret), then step 2 (:func:`dp_mae_train` on ``private``) from its weights.
    Only step 2 touches the private data, so the whole is (ε, δ)-DP with respect to it. Returns
    ``(step-1 epoch losses, step-2 result)``; ``dp_kwargs`` go to :func:`dp_mae_train`
    (``mask_seed``: None, a secret mask key)."""
    history = pretrain_synthetic(model, synthetic, synthetic_config, device=device, seed=seed,
                                 progress=progress)
    return history, dp_mae_train(model, private, dp_config, device=device, progress=progress,
                                 **dp_kwargs)
