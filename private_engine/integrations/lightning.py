"""Differentially private training with Lightning (``lightning.pytorch``).

::

    from private_engine.data import poisson_loader
    from private_engine.integrations.lightning import DPCallback

    trainer = lightning.Trainer(max_steps=1000, callbacks=[DPCallback(target_epsilon=3.0,
                                                                      max_grad_norm=1.0)])
    trainer.fit(module, train_dataloaders=poisson_loader(dataset, 256))

:class:`DPCallback` makes Lightning's automatic optimization the engine's private step
(:class:`private_engine.PrivacyEngine`). The module's ``training_step`` returns the per-sample
losses, shape ``(B,)`` (``reduction="none"``; or a dict whose ``"loss"`` is that vector), not
their mean. Where Lightning would call ``loss.backward()``, the callback keeps the vector, and the
optimizer's step (called by Lightning with its closure) is the engine's: per-sample clipping at
``R = max_grad_norm``, ``Σ_i C_i g_i + N(0, σ²R²I)`` released once per batch and divided by the
expected batch size B, then the optimizer's update. Each batch is one logical batch: the training
loader must be a Poisson loader at rate ``q = B/n`` (:func:`private_engine.data.poisson_loader`);
fixed-size batches are refused, as the engine refuses them. ε is logged as ``"epsilon"`` with
``self.log`` after every step, and the engine's state goes into every Lightning checkpoint and is
restored by ``trainer.fit(..., ckpt_path=...)`` (a step ledger next to the checkpoints counts the
steps released after the last one).

What the engine cannot do exactly under Lightning is refused before anything is released, saying
what to do: several devices or processes, or a strategy other than the single-device one (use
:class:`private_engine.PrivacyEngine` under ``torch.distributed``, docs/distributed.md);
precisions other than ``"32-true"`` and ``"bf16-mixed"`` (float16's GradScaler scales a
batch-mean loss); ``gradient_clip_val`` (the engine clips per sample; Lightning's clipping of the
noisy mean would be another algorithm); ``accumulate_grad_batches`` > 1 (the union of several
Poisson batches is not the Poisson batch the accountant counts: a sample can be in two of them);
manual optimization and several optimizers; a ``training_step`` that returns None (a skipped
step depends on the batch).
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any, Dict, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import SingleDeviceStrategy

from ..accounting import PrivacyReport
from ..accounting.sampling_check import check_loader, loader_sampling
from ..checkpoint import use_ledger
from ..engine import PrivacyEngine

#: the key of the engine's state in a Lightning checkpoint, and its step ledger's file name
CHECKPOINT_KEY = "private_engine"
LEDGER_NAME = "private_engine.ledger"
#: the precisions whose backward the engine runs as Lightning would
SUPPORTED_PRECISIONS = ("32-true", "32", "bf16-mixed")


class DPCallback(Callback):
    """Train a ``LightningModule`` with differential privacy (module docstring).

    Args:
        max_grad_norm: R, the per-sample clipping threshold.
        target_epsilon: ε to reach at the end of training (σ calibrated from it, q and the
            trainer's number of steps); or give ``noise_multiplier``.
        noise_multiplier: σ (the noise's standard deviation is σ·R).
        target_delta: δ; None gives ``1 / (2n)`` for a training set of n examples.
        batch_size: the expected logical batch B; None reads it from the Poisson loader's rate
            (``B = q·n``).
        clipping_mode, clipping_fn, accountant, secure_mode: as in
            :class:`private_engine.PrivacyEngine`.

    The engine is built when training starts (``privacy_engine``), on the module, the
    trainer's single optimizer and the training loader; the training length σ is calibrated for
    is ``trainer.estimated_stepping_batches`` (``max_steps``, or ``max_epochs`` times the
    batches per epoch).
    """

    def __init__(self, *, max_grad_norm: float, target_epsilon: Optional[float] = None,
                 noise_multiplier: Optional[float] = None, target_delta: Optional[float] = None,
                 batch_size: Optional[int] = None, clipping_mode: str = "bk_mixed",
                 clipping_fn: str = "abadi", accountant: str = "rdp", secure_mode: bool = False):
        if (target_epsilon is None) == (noise_multiplier is None):
            raise ValueError("DPCallback: give exactly one of target_epsilon or "
                             "noise_multiplier.")
        if not (isinstance(max_grad_norm, (int, float)) and 0 < max_grad_norm < math.inf):
            raise ValueError(f"DPCallback: max_grad_norm must be a finite number > 0, got "
                             f"{max_grad_norm!r}.")
        self.max_grad_norm = float(max_grad_norm)
        self.target_epsilon = target_epsilon
        self.noise_multiplier = noise_multiplier
        self.target_delta = target_delta
        self.batch_size = batch_size
        self.clipping_mode = clipping_mode
        self.clipping_fn = clipping_fn
        self.accountant = accountant
        self.secure_mode = secure_mode
        #: the privacy engine (built when training starts)
        self.privacy_engine: Optional[PrivacyEngine] = None
        self._pending: Optional[torch.Tensor] = None
        self._loaded_state: Optional[Dict[str, Any]] = None
        self._module_backward = None

    # -- refusals ---------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse, before anything runs, the settings the engine cannot train exactly with."""
        if stage != "fit":
            return
        strategy = trainer.strategy
        if (trainer.world_size > 1 or trainer.num_devices > 1
                or not isinstance(strategy, SingleDeviceStrategy)):
            raise ValueError(
                f"DPCallback trains on one device in one process (this trainer has "
                f"{trainer.num_devices} devices, world size {trainer.world_size}, strategy "
                f"{type(strategy).__name__}); pass devices=1 and no strategy. For data-parallel "
                "DP training use private_engine.PrivacyEngine under torch.distributed "
                "(docs/distributed.md).")
        precision = str(trainer.precision)
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(
                f"DPCallback: precision={precision!r} is not supported; use '32-true' or "
                "'bf16-mixed' (float16's GradScaler scales a batch-mean loss, not the per-sample "
                "losses the engine clips).")
        if trainer.gradient_clip_val:
            raise ValueError(
                f"DPCallback: gradient_clip_val={trainer.gradient_clip_val} would clip the noisy "
                "mean gradient, which is not the private algorithm; remove it and set the "
                "per-sample threshold with DPCallback(max_grad_norm=...).")
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"DPCallback: accumulate_grad_batches={trainer.accumulate_grad_batches} is not "
                "supported: each batch of the Poisson loader is one logical batch, and the union "
                "of several Poisson batches is not the Poisson batch the accountant counts (a "
                "sample can be drawn twice). Raise the loader's batch_size instead; to bound "
                "memory, use private_engine.PrivacyEngine with optimizer.virtual_step "
                "(docs/engine.md).")
        if not pl_module.automatic_optimization:
            raise ValueError(
                "DPCallback drives Lightning's automatic optimization; with "
                "automatic_optimization=False, build private_engine.PrivacyEngine yourself and "
                "call optimizer.step(loss=per_sample_losses) in training_step.")

    # -- the engine -------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Build the engine on the module, the optimizer and the training loader, restore a
        checkpoint's engine state, and make the optimizer's step the private step."""
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            raise ValueError(f"DPCallback trains with exactly one optimizer, "
                             f"configure_optimizers gave {len(optimizers)}.")
        optimizer = optimizers[0]
        loader = trainer.train_dataloader
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise ValueError("DPCallback needs one torch DataLoader for training: "
                             "private_engine.data.poisson_loader(dataset, B).")
        n = len(loader.dataset)
        B = self._logical_batch(loader, n)
        # a loader the engine can read (a Poisson sampler's rate, or fixed-size batches, which it
        # refuses) is checked at construction; another one (DPCallback(batch_size=B) over the
        # user's own sampler) by its batch sizes as they are stepped
        checked = loader if any(v is not None for v in loader_sampling(loader)) else None
        steps = trainer.estimated_stepping_batches
        length = dict(steps=int(steps)) if math.isfinite(steps) else {}
        if not length and self.target_epsilon is not None:
            raise ValueError("DPCallback(target_epsilon=...) needs a finite training length to "
                             "calibrate σ: set max_steps or max_epochs.")
        self.privacy_engine = PrivacyEngine(
            pl_module, batch_size=B, sample_size=n, max_grad_norm=self.max_grad_norm,
            noise_multiplier=self.noise_multiplier, target_epsilon=self.target_epsilon,
            target_delta=self.target_delta, clipping_mode=self.clipping_mode,
            clipping_fn=self.clipping_fn, accountant=self.accountant,
            secure_mode=self.secure_mode, data_loader=checked, **length)
        if self._loaded_state is not None:
            from ..checkpoint import load_engine_state_dict

            near = os.path.dirname(os.path.abspath(trainer.ckpt_path)) if trainer.ckpt_path \
                else None
            load_engine_state_dict(self.privacy_engine, self._loaded_state, near=near)
            self._loaded_state = None
        self.privacy_engine.attach(optimizer)
        private_step = optimizer.step

        def step(closure=None, **kwargs):
            """Lightning's ``optimizer.step(closure)``: the closure runs ``training_step`` (whose
            per-sample losses the module's ``backward`` keeps), then the private step."""
            if closure is None:
                raise ValueError("DPCallback: the optimizer is stepped by Lightning's training "
                                 "loop with its closure; do not call optimizer.step() yourself.")
            closure()
            losses, self._pending = self._pending, None
            if losses is None:
                raise ValueError(
                    "DPCallback: training_step returned None. Every batch is stepped (an empty "
                    "Poisson batch releases noise only): a step skipped because of what the batch "
                    "holds tells what the batch holds. Return the per-sample losses, shape (B,) "
                    "(shape (0,) for an empty batch).")
            return private_step(loss=losses)

        optimizer.step = step
        self._module_backward = pl_module.backward
        pl_module.backward = self._keep_losses

    def _logical_batch(self, loader, n: int) -> int:
        """B: given, or ``q·n`` from the Poisson sampler's rate q (a fixed-size loader is refused
        by the engine with what to use instead)."""
        if self.batch_size is not None:
            return int(self.batch_size)
        fixed, rate = loader_sampling(loader)
        if rate is None:
            if fixed is not None:
                check_loader(loader, fixed, n)  # raises: fixed-size batches
            raise ValueError("DPCallback: the training loader is not a Poisson loader, so the "
                             "logical batch B is unknown; use "
                             "private_engine.data.poisson_loader(dataset, B), or pass "
                             "DPCallback(batch_size=B).")
        B = round(rate * n)
        if B < 1 or abs(B - rate * n) > 1e-6 * max(1.0, B):
            raise ValueError(f"DPCallback: the Poisson loader's rate q={rate} is not B/n for an "
                             f"integer B (n={n}); pass DPCallback(batch_size=B).")
        return B

    def _keep_losses(self, loss: torch.Tensor, *args, **kwargs) -> None:
        """The module's ``backward`` under DP: keep the per-sample losses for the private step."""
        if not isinstance(loss, torch.Tensor) or loss.dim() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"DPCallback: training_step must return the per-sample losses, shape (B,) "
                f"(e.g. F.cross_entropy(logits, y, reduction='none')), got {shape}; the engine "
                "clips each sample's gradient from them.")
        self._pending = loss

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Give the module its own ``backward`` back."""
        if self._module_backward is not None:
            pl_module.backward = self._module_backward
            self._module_backward = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """Give the module its own ``backward`` back when training stops on an error."""
        self.on_train_end(trainer, pl_module)

    def privacy_report(self) -> PrivacyReport:
        """The engine's :class:`private_engine.accounting.PrivacyReport` (ε spent, δ, σ, q,
        steps); ``str()`` gives one line."""
        if self.privacy_engine is None:
            raise RuntimeError("DPCallback.privacy_report(): training has not started.")
        return self.privacy_engine.privacy_report()

    # -- logs and checkpoints ---------------------------------------------------------------
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs,
                           batch, batch_idx: int) -> None:
        """Log ε spent so far (at the engine's δ) as ``"epsilon"``."""
        if self.privacy_engine is not None:
            pl_module.log("epsilon", self.privacy_engine.get_epsilon(), on_step=True,
                          on_epoch=False, prog_bar=True, batch_size=1)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: Dict[str, Any]) -> None:
        """Write the engine's state (public values only:
        :func:`private_engine.checkpoint.engine_state_dict`) under ``"private_engine"``; from the
        first checkpoint on, every step is recorded before its release in the step ledger
        ``private_engine.ledger`` in the checkpoint folder."""
        engine = self.privacy_engine
        if engine is None:
            return
        if engine.ledger is None:
            folder = getattr(trainer.checkpoint_callback, "dirpath", None) \
                or trainer.default_root_dir
            os.makedirs(folder, exist_ok=True)
            use_ledger(engine, os.path.join(folder, LEDGER_NAME))
        checkpoint[CHECKPOINT_KEY] = engine.state_dict()

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: Dict[str, Any]) -> None:
        """Keep the checkpoint's engine state for the engine built when training starts (the
        accountant takes the step ledger's history; other privacy parameters are refused:
        :func:`private_engine.checkpoint.load_engine_state_dict`)."""
        state = checkpoint.get(CHECKPOINT_KEY)
        if not isinstance(state, Mapping):
            raise ValueError("DPCallback: this checkpoint holds no engine state: it was not "
                             "written under DPCallback, and resuming from it would forget the "
                             "privacy spent.")
        self._loaded_state = dict(state)
