"""``private_engine.opacus_compat.PrivacyEngine(accountant="prv", secure_mode=False)``: the
Opacus 1.6 API on our clipping.

:class:`PrivacyEngine` subclasses ``opacus.PrivacyEngine`` and replaces only what touches
per-sample gradients: ``_prepare_model`` returns a :class:`~.module.PrivateModule` (our hooks;
book-keeping clipping, mode "bk_mixed", in the one ordinary backward) instead of a
``GradSampleModule``; ``_prepare_optimizer`` returns Opacus' fast-gradient-clipping optimizer
fed with our clipped sums; ``_prepare_criterion`` returns our loss wrapper. Everything else —
argument handling of ``make_private`` / ``make_private_with_epsilon``, ``DPDataLoader``
(Poisson sampling), ``get_noise_multiplier``, the accountants and their optimizer hook,
``get_epsilon``, checkpoints — is Opacus' own code, so results and ε match Opacus for the same
seeds.

One default differs: with ``secure_mode=False`` and no ``noise_generator``, Opacus draws the noise
and the Poisson sampling from torch's global generator, which scripts seed publicly
(``torch.manual_seed``); whoever knows that seed can subtract the noise and knows each batch.
Here both come from :func:`~private_engine.foundation.randomness.entropy_seeded_generator` (state
from OS entropy): the noise from one on the parameters' device, the sampling from one on the CPU
unless the data loader has its own ``generator``. A ``noise_generator`` given makes the run Opacus'
reproducible run: noise from it, sampling from the loader's generator or torch's global one (as
the noise is then known, secret batches would add little).

grad_sample_mode mapping (the per-sample math is the same, so every mode runs the engine's
book-keeping mode "bk_mixed", :attr:`PrivacyEngine.clipping_mode`: one backward, each layer's
per-sample norm by ghost norm or instantiation as decided by the layerwise rule of mixed ghost
clipping — Bu, Mao & Xu (2022), "Scalable and Efficient Training of Large Convolutional Neural
Networks with Differential Privacy", eq. 4.1 — applied to what book-keeping keeps):

=================  ===========================================================================
"hooks"            plain ``loss.backward()`` → book-keeping clipping ("bk_mixed", one backward)
"functorch", "ew"  same as "hooks"
"no_op"            same as "hooks"
"ghost"            wrapped criterion returned; its ``loss.backward()`` → the same book-keeping
                   clipping of the per-sample losses ("bk_mixed", one backward)
"ghost_fsdp"       ValueError: FSDP is not supported (docs/distributed.md)
=================  ===========================================================================

``clipping="per_layer"`` (not with the "ghost" modes, as in Opacus) instantiates per-sample
gradients, one threshold per parameter tensor (:mod:`.module`). ``clipping="adaptive"`` (Andrew,
Thakkar, McMahan & Ramaswamy 2021, "Differentially Private Learning with Adaptive Clipping"):
Opacus' ``AdaClipDPOptimizer`` arguments and accounting, on our clipped sums and counts
(:class:`~.optimizer.AdaptiveClippedSumOptimizer`).

Parameters outside a ruled layer are clipped as in the native engine: by the parameter-entry
tracer (:mod:`private_engine.capture.tracer`) and the ``torch.func`` fallback
(:mod:`private_engine.capture.fallback`), batch-first inputs only.

Distributed data parallel, as in Opacus 1.6: a model wrapped in Opacus'
``DifferentiallyPrivateDistributedDataParallel`` (DPDDP) or torch's ``DistributedDataParallel``
makes Opacus' ``make_private`` run its ``distributed`` flow (``DPDataLoader`` with the distributed
Poisson sampler, ``expected_batch_size`` per rank). Our hooks sit on the wrapped model
(``wrapper.module``), so each rank leaves the clipped sum of its own samples in ``p.grad``;
the optimizer is then Opacus' ``DistributedDPOptimizerFastGradientClipping`` on those sums
(:class:`~.optimizer.DistributedClippedSumOptimizer`): noise on rank 0 only, ``all_reduce(SUM)``,
division by the per-rank expected batch size × the world size. torch DDP is used for its
forward only: its backward all-reduce (of raw, unclipped gradients) is turned off
(:class:`~.module.PrivateModule`).
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List, Optional, Union

import opacus
import torch
from opacus.data_loader import DPDataLoader
from opacus.optimizers import DPOptimizer
from torch import nn, optim

from ..accounting.ledger import StepLedger
from ..accounting.opacus_bridge import PRVAccountant
from ..checkpoint import find_ledger
from ..foundation.randomness import entropy_seeded_generator
from ..guards.model_check import check_no_batchnorm, scan_model
from .arguments import check_arguments, check_attention_layout, is_data_parallel
from .loss import PrivateLoss
from .module import PrivateModule
from .optimizer import (
    AdaptiveClippedSumOptimizer,
    ClippedSumOptimizer,
    DistributedClippedSumOptimizer,
    DistributedPerLayerClippedSumOptimizer,
    PerLayerClippedSumOptimizer,
)
from .sequence_bias import clipped_layers_for_door


class PrivacyEngine(opacus.PrivacyEngine):
    """Drop-in for ``opacus.PrivacyEngine``: same constructor, ``make_private``,
    ``make_private_with_epsilon``, ``get_epsilon(delta)``, ``accountant``, checkpoints.

    Returned objects: a :class:`PrivateModule` (use it as the model; with ``wrap_model=False``
    keep using your own model and call ``cleanup()`` on the returned object), Opacus' DP optimizer
    holding our clipped sums, Opacus' ``DPDataLoader`` (Poisson) or the original loader, and
    for ``grad_sample_mode="ghost"`` a :class:`PrivateLoss` criterion.
    """

    #: the engine's clipping mode used for every grad_sample_mode
    clipping_mode = "bk_mixed"

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False):
        super().__init__(accountant=accountant, secure_mode=secure_mode)
        if accountant == "prv":  # the same ε, without the RDP warning of its domain sizing
            self.accountant = PRVAccountant()
        self._module: Optional[PrivateModule] = None
        #: whether the current make_private call got a noise_generator (Opacus' reproducible run)
        self._reproducible = False
        #: the step ledger each step is recorded in before its update (set by the checkpoints)
        self._ledger: Optional[StepLedger] = None

    # -- the parts that touch per-sample gradients -------------------------------------------
    def _prepare_model(self, module: nn.Module, *, batch_first: bool = True, max_grad_norm=1.0,
                       loss_reduction: str = "mean", grad_sample_mode: str = "hooks",
                       wrap_model: bool = True):
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}.")
        # DPDDP / DDP: our hooks sit on the wrapped model; the wrapper stays the forward
        inner, wrapper = (module.module, module) if is_data_parallel(module) else (module, None)
        if isinstance(inner, PrivateModule):
            raise ValueError("this module was already returned by make_private; "
                             "pass the original nn.Module.")
        self.validate(module=module, optimizer=None, data_loader=None)  # Opacus' own checks first
        check_no_batchnorm(inner)
        scan = scan_model(inner)
        layers = clipped_layers_for_door(inner, scan)
        check_attention_layout(inner, batch_first)
        # parameters outside a ruled layer: the native engine's tracer and torch.func fallback
        self._module = PrivateModule(inner, layers, max_grad_norm=max_grad_norm,
                                     loss_reduction=loss_reduction, mode=self.clipping_mode,
                                     batch_first=batch_first, wrapper=wrapper,
                                     traced=scan.traced, fallbacks=scan.fallbacks)
        return self._module

    def _prepare_optimizer(self, *, optimizer: optim.Optimizer, noise_multiplier: float,
                           max_grad_norm, expected_batch_size: int, loss_reduction: str = "mean",
                           distributed: bool = False, clipping: str = "flat",
                           noise_generator=None, grad_sample_mode="hooks", **kwargs):
        if isinstance(optimizer, DPOptimizer):
            optimizer = optimizer.original_optimizer
        generator = self.secure_rng if self.secure_mode else noise_generator
        if generator is None and not self.secure_mode:
            generator = _entropy_noise_generator(optimizer)
        common = dict(noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size,
                      loss_reduction=loss_reduction, generator=generator,
                      secure_mode=self.secure_mode, module=self._module, **kwargs)
        # distributed (a DPDDP/DDP model): Opacus' distributed optimizer — noise on rank 0 only,
        # the ranks' noised sums all-reduced, divided by the per-rank expected batch size × the
        # world size (Opacus passes expected_batch_size already divided by the world size)
        if clipping == "per_layer":
            cls = DistributedPerLayerClippedSumOptimizer if distributed else \
                PerLayerClippedSumOptimizer
            dp_optimizer = cls(optimizer, max_grad_norm=max_grad_norm, **common)
            self._module.bind_per_layer_norms(dp_optimizer.params, max_grad_norm)
            return dp_optimizer
        if clipping == "adaptive":
            if distributed:  # Opacus' get_optimizer_class refuses it with this message too
                raise ValueError("Unexpected optimizer parameters. Clipping: adaptive, "
                                 "distributed: True (adaptive clipping is not supported in "
                                 "distributed training).")
            dp_optimizer = AdaptiveClippedSumOptimizer(optimizer, max_grad_norm=max_grad_norm,
                                                       **common)
            self._module.bind_optimizer(dp_optimizer)  # clipping follows the adapted bound
            return dp_optimizer
        cls = DistributedClippedSumOptimizer if distributed else ClippedSumOptimizer
        dp_optimizer = cls(optimizer, max_grad_norm=max_grad_norm, **common)
        self._module.bind_optimizer(dp_optimizer)
        return dp_optimizer

    def _prepare_criterion(self, *, module, optimizer, criterion, loss_reduction: str = "mean",
                           **kwargs):
        return PrivateLoss(module, optimizer, criterion, loss_reduction)

    def _prepare_data_loader(self, data_loader, *, poisson_sampling: bool, distributed: bool,
                             batch_first: bool = True, rand_on_empty: bool = False):
        """Opacus' ``_prepare_data_loader``, except that its ``DPDataLoader`` samples from an
        :func:`entropy_seeded_generator` (CPU) where Opacus would use torch's global generator:
        Poisson sampling, not secure mode, no ``noise_generator`` and no ``data_loader.generator``.
        """
        if (not poisson_sampling or self.secure_mode or self._reproducible
                or data_loader.generator is not None):
            return super()._prepare_data_loader(
                data_loader, poisson_sampling=poisson_sampling, distributed=distributed,
                batch_first=batch_first, rand_on_empty=rand_on_empty)
        # Opacus' bookkeeping of the dataset (and its warning on a new one); without Poisson
        # sampling and secure mode it returns the loader as is
        super()._prepare_data_loader(data_loader, poisson_sampling=False, distributed=distributed,
                                     batch_first=batch_first, rand_on_empty=rand_on_empty)
        return DPDataLoader.from_data_loader(
            data_loader, generator=entropy_seeded_generator("cpu"), distributed=distributed,
            batch_first=batch_first, rand_on_empty=rand_on_empty)

    # -- argument checks Opacus does deeper inside (here before anything is built) -------------
    def make_private(self, *, module: nn.Module, optimizer: optim.Optimizer,
                     criterion=nn.CrossEntropyLoss(), data_loader, noise_multiplier: float,
                     max_grad_norm: Union[float, List[float]], batch_first: bool = True,
                     loss_reduction: str = "mean", poisson_sampling: bool = True,
                     clipping: str = "flat", noise_generator=None, grad_sample_mode: str = "hooks",
                     wrap_model: bool = True, rand_on_empty: bool = False, **kwargs):
        """Same arguments and return values as ``opacus.PrivacyEngine.make_private`` (opacus 1.6).

        Returns ``(module, optimizer, data_loader)``, or ``(module, optimizer, criterion,
        data_loader)`` for ``grad_sample_mode`` "ghost"/"ghost_fsdp". The optimizer step releases
        ``(Σ_i C_i g_i + N(0, σ²R²I)) / B_exp`` with ``C_i = min(1, R/(‖g_i‖+1e-6))``.
        """
        check_arguments(module=module, optimizer=optimizer, noise_multiplier=noise_multiplier,
                         max_grad_norm=max_grad_norm, batch_first=batch_first,
                         loss_reduction=loss_reduction, clipping=clipping,
                         grad_sample_mode=grad_sample_mode, wrap_model=wrap_model,
                         rand_on_empty=rand_on_empty)
        self._module = None
        self._reproducible = noise_generator is not None
        if not poisson_sampling and not isinstance(data_loader, DPDataLoader):
            warnings.warn(
                "poisson_sampling=False: the data loader's batches are accounted as Poisson "
                "sampling at rate 1/len(data_loader), as Opacus does; for fixed-size or shuffled "
                "batches that ε is not a guarantee (it can be far too small). Keep "
                "poisson_sampling=True for a privacy claim.", UserWarning, stacklevel=2)
        try:
            return super().make_private(
                module=module, optimizer=optimizer, criterion=criterion, data_loader=data_loader,
                noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                batch_first=batch_first, loss_reduction=loss_reduction,
                poisson_sampling=poisson_sampling, clipping=clipping,
                noise_generator=noise_generator, grad_sample_mode=grad_sample_mode,
                wrap_model=wrap_model, rand_on_empty=rand_on_empty, **kwargs)
        except BaseException:
            if self._module is not None:  # leave the user's model without our hooks
                self._module.remove_hooks()
                self._module = None
            raise

    # -- checkpoints: Opacus' format, the given generator's state and the step ledger -----------
    def save_checkpoint(self, *, path, module, optimizer=None, noise_scheduler=None,
                        grad_clip_scheduler=None, checkpoint_dict: Optional[Dict[str, Any]] = None,
                        module_state_dict_kwargs=None, torch_save_kwargs=None):
        """Opacus' checkpoint (module, optimizer, accountant history, schedulers), public values
        only, plus:

        * when the user gave a ``noise_generator`` (a reproducible run), its state, so a resumed
          run continues its stream. The default, entropy-seeded generator's state is never
          written: whoever read it could regenerate the noise of every step drawn from it
          (MT19937 and Philox are not one-way); a resumed run draws fresh secret noise instead;
        * the step ledger (:mod:`private_engine.accounting.ledger`), when ``path`` is a file path
          and ``optimizer`` is given: the first save creates ``<path>.ledger`` (refused if it
          exists: another run's) and from then on the optimizer's accountant hook writes and
          ``fsync``-s each step there before the update is applied; the checkpoint names it, and
          :meth:`load_checkpoint` counts the steps released after the checkpoint. Under
          ``torch.distributed`` rank 0 writes it.

        No accumulation in progress is written (Opacus keeps it in ``p.summed_grad``, outside
        the optimizer's ``state_dict``: a checkpoint taken mid-batch resumes without it)."""
        checkpoint_dict = dict(checkpoint_dict or {})
        generator = getattr(optimizer, "generator", None)
        if isinstance(generator, torch.Generator) and self._reproducible:
            checkpoint_dict["noise_generator_state"] = generator.get_state()
        if isinstance(path, (str, os.PathLike)) and optimizer is not None and _records():
            if self._ledger is None:
                self._ledger = StepLedger.beside(path, self.accountant.history)
            self._record_steps(optimizer)
        if self._ledger is not None:
            checkpoint_dict[LEDGER_KEY] = {"run": self._ledger.run, "path": self._ledger.path}
        return super().save_checkpoint(path=path, module=module, optimizer=optimizer,
                                       noise_scheduler=noise_scheduler,
                                       grad_clip_scheduler=grad_clip_scheduler,
                                       checkpoint_dict=checkpoint_dict,
                                       module_state_dict_kwargs=module_state_dict_kwargs,
                                       torch_save_kwargs=torch_save_kwargs)

    def load_checkpoint(self, *, path, module, optimizer=None, noise_scheduler=None,
                        grad_clip_scheduler=None, module_load_dict_kwargs=None,
                        torch_load_kwargs=None, ledger=None) -> Dict:
        """Inverse of :meth:`save_checkpoint`; restores the noise generator state when both the
        checkpoint and the optimizer have one (a reproducible run).

        A checkpoint that names a step ledger: the accountant takes the ledger's history, which
        extends the checkpoint's with every step released after it, and the optimizer goes on
        recording there. The ledger is looked up at its path, then next to ``path``; ``ledger=``
        gives another path, or False (the caller asserts that no step was released after the
        checkpoint). A missing or foreign ledger raises ``ValueError`` before anything changes.
        A checkpoint without one (Opacus' own files) loads its accountant history as Opacus
        does."""
        found = None
        if isinstance(path, (str, os.PathLike)):
            kwargs = dict(torch_load_kwargs or {})
            kwargs.setdefault("weights_only", False)  # as Opacus' load_checkpoint reads it
            kwargs.setdefault("map_location", "cpu")
            peek = torch.load(path, **kwargs)
            history = peek.get("privacy_accountant_state_dict", {}).get("history", [])
            near = os.path.dirname(os.path.abspath(os.fspath(path)))
            found = find_ledger({"ledger": peek.get(LEDGER_KEY)}, history, ledger, near)
        checkpoint = super().load_checkpoint(path=path, module=module, optimizer=optimizer,
                                             noise_scheduler=noise_scheduler,
                                             grad_clip_scheduler=grad_clip_scheduler,
                                             module_load_dict_kwargs=module_load_dict_kwargs,
                                             torch_load_kwargs=torch_load_kwargs)
        checkpoint.pop(LEDGER_KEY, None)
        if found is not None:
            if self._ledger is not None:
                self._ledger.close()
            self._ledger = StepLedger.open(found[0], writer=_records())
            self.accountant.history = list(self._ledger.history)
            if optimizer is not None:
                self._record_steps(optimizer)
        state = checkpoint.pop("noise_generator_state", None)
        generator = getattr(optimizer, "generator", None)
        if state is not None and isinstance(generator, torch.Generator):
            generator.set_state(state)
        elif state is not None and optimizer is not None:
            warnings.warn("the checkpoint holds a noise generator state but the optimizer has no "
                          "torch.Generator; the resumed noise will differ from an uninterrupted "
                          "run.")
        return checkpoint

    def _record_steps(self, optimizer) -> None:
        """Make ``optimizer``'s accountant hook (run before the update is applied) record each
        step in the step ledger after the accountant counts it (once per optimizer)."""
        hook = getattr(optimizer, "step_hook", None)
        if hook is None or getattr(hook, "_records_for", None) is self:
            return

        def recorded(opt):
            hook(opt)  # the accountant's step
            if self._ledger is not None:
                sigma, q, _ = self.accountant.history[-1]
                self._ledger.record(sigma, q)

        recorded._records_for = self
        optimizer.step_hook = recorded


#: the key of a checkpoint's step ledger (its run identifier and path)
LEDGER_KEY = "private_engine_ledger"


def _records() -> bool:
    """Whether this process writes the step ledger: one process, or rank 0."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _entropy_noise_generator(optimizer: optim.Optimizer) -> Optional[torch.Generator]:
    """:func:`entropy_seeded_generator` on the device of ``optimizer``'s parameters, where
    Opacus' ``_generate_noise`` draws each parameter's noise. Parameters on several devices
    cannot share one generator: then None (torch's global generators), with a warning."""
    devices = {p.device for group in optimizer.param_groups for p in group["params"]}
    if len(devices) > 1:
        warnings.warn(
            f"the optimizer's parameters are on several devices ({sorted(map(str, devices))}): "
            "the noise is drawn from torch's global generators, which torch.manual_seed makes "
            "predictable; use secure_mode=True for noise that cannot be predicted.",
            RuntimeWarning, stacklevel=5)
        return None
    return entropy_seeded_generator(devices.pop() if devices else "cpu")
