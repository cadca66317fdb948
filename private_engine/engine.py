"""The native privacy engine: assembles capture, clipping, the private optimizer and accounting.

::

    engine = PrivacyEngine(model, batch_size=1000, sample_size=50_000, epochs=3,
                           max_grad_norm=0.1, target_epsilon=3.0)
    engine.attach(optimizer)
    optimizer.step(loss=per_sample_losses)       # or virtual_step(loss=...) to accumulate
    engine.get_epsilon()

The Opacus API (``make_private``) is :class:`private_engine.opacus_compat.PrivacyEngine`
(docs/migrating-from-opacus.md). Under an initialised ``torch.distributed`` process group the
engine trains data-parallel (:mod:`private_engine.optim.distributed`, docs/distributed.md).
"""
from __future__ import annotations

import contextlib
import logging
import math
import warnings
from typing import Callable, List, Optional, Sequence, Union

import torch
from torch import nn

from . import optim as _optim
from .accounting import (PrivacyBudget, PrivacyReport, SamplingRateCheck,
                         calibrate_noise_multiplier, check_loader, make_accountant, steps_for)
from .clipping.batch import ClippedBatch, check_batch, clip_batch
from .clipping.assembly import assemble_clipping_core
from .clipping.functions import ClipFn
from .clipping.loss_scaling import LossScaling
from .clipping.plan import DEFAULT_CLIPPING_MODE, LayerDecision, check_mode, is_book_keeping
from .randomness import keyed_by_state
from .guards.model_check import check_no_batchnorm, clipped_layers, scan_model
from .optim import noise as _noise
from .optim.private_step import check_clipped_params
from .optim.sharded import ShardedDataParallel, fsdp1_names, fsdp2_modules
from .step_metrics import (BatchRecord, EpsilonTracker, StepLogger, StepMetrics,
                           StepMetricsRecorder)

log = logging.getLogger(__name__)


class PrivacyEngine:
    """Differentially private training of ``model`` by per-sample clipping and Gaussian noise.

    Each logical batch releases ``Σ_i C_i·g_i + N(0, σ²R²I)`` (divided by the expected batch size),
    where ``g_i`` is sample i's gradient over every trainable parameter, ``C_i`` its clip factor and
    ``R = max_grad_norm``. Per-sample norms come from ghost norms or instantiated per-sample
    gradients, chosen per layer (Bu, Mao & Xu 2022, "Scalable and Efficient Training of Large
    Convolutional Neural Networks with Differential Privacy": mixed ghost clipping); the clipped sum
    comes, in the book-keeping modes (default), from the same single backward (``gᵀ·diag(C)·a`` per
    layer or kept per-sample gradients, Bu et al. 2023), or from the same per-layer formulas during
    a second, activation-only backward. Every norm is a certified upper bound of what is released
    for the sample, rounding included (docs/engine.md, "Privacy guarantees").

    Args:
        model: the ``nn.Module`` to train; every trainable parameter is clipped by a layer rule, the
            parameter-entry tracer or the torch.func fallback (docs/engine.md; a use none of them
            can clip raises a ValueError naming it). BatchNorm is rejected (see ``fix_batchnorm``).
        batch_size: expected logical batch size B (the divisor of the noisy sum).
        sample_size: number of training examples n; the sampling rate is ``q = B / n``.
        epochs / steps: training length, needed when calibrating σ from ``target_epsilon``.
        max_grad_norm: clipping threshold R.
        noise_multiplier: σ; or give ``target_epsilon`` (and epochs/steps) to calibrate it.
        target_delta: δ; default ``1 / (2·sample_size)``.
        clipping_mode: the single-backward book-keeping modes (Bu et al. 2023) "bk_mixed" (default;
            the memory rule of Bu, Mao & Xu 2022 applied to what book-keeping keeps), "bk" (ghost
            norms) and "bk_mixopt" (time rule: ghost iff the two Grams cost less than moving the
            instantiated gradient through memory, :func:`private_engine.clipping.plan.ghost_time`),
            or the two-pass modes "mixed" (Bu, Mao & Xu 2022, eq. 4.1 per layer), "ghost",
            "per_sample" (norm pass + a second activation-only backward that writes the sums);
            every mode gives the same clipped gradient (docs/engine.md, "Clipping modes").
        clipping_fn: "abadi", "automatic", "global" or a callable ``(norms, R) -> factors``.
        accountant: "rdp", "prv" or "gdp" (Opacus' accountants) or "pld" (dp-accounting's
            privacy-loss-distribution accountant; :mod:`private_engine.accounting.pld`), all for
            the Poisson-subsampled Gaussian.
        check_sampling: refuse logical batches whose sizes contradict Poisson sampling at
            ``q = batch_size / sample_size``: the wrong mean rate, or fixed-size batches (a
            ``DataLoader(batch_size=B)``, shuffled or not), for which the accountants' ε does not
            hold (:mod:`private_engine.accounting.sampling_check`). ``False`` steps any batches
            and reports ε as if they were Poisson (with a warning at construction): for
            benchmarks, never for a privacy claim.
        data_loader: optional, the loader the batches come from: its data set must hold
            ``sample_size`` examples, and a loader that samples fixed-size batches, or Poisson
            batches at another rate than ``q``, is refused at construction (when
            ``check_sampling``).
        noise_generator: optional ``torch.Generator`` for the noise. By default (None) the noise
            comes from a generator on the parameters' device whose state is drawn from OS entropy
            (``private_engine.randomness.entropy_seeded_generator``), never from torch's global
            one, so ``torch.manual_seed`` does not make it reproducible. A generator given here is
            used as is and warns once (``ReproducibleNoiseWarning``): anyone who knows its seed can
            subtract the noise.
        secure_mode: draw every noise coordinate from the OS cryptographic generator as
            ``(z₁ + z₂ + z₃ + z₄)/2``, ``z_k`` i.i.d. N(0, σ²R²), against floating-point attacks on
            the Gaussian sampler (Holohan & Braghin 2021, "Secure Random Sampling in Differential
            Privacy"; Opacus' ``secure_mode``); much slower than the default draw. Excludes
            ``noise_generator``.
        data_free_buffers: qualified names (``fnmatch`` patterns) of buffers the model may write
            during a training forward because they depend on shapes only (a lazily built cache); any
            other buffer written from the data is refused
            (:class:`private_engine.guards.buffers.BufferGuard`).
        grad_scaler: a ``torch.amp.GradScaler`` for float16 autocast (book-keeping modes): the
            engine scales the loss, unscales norms and sums in float32, drops samples that overflow
            (``C_i = 0``) and keeps the scale fixed at the scaler's initial scale; a scaler left
            at torch's default (2¹⁶, tuned for a batch-mean loss, which overflows float16 on
            per-sample losses) starts at 2¹⁰ instead
            (:mod:`private_engine.clipping.loss_scaling`).
            bfloat16 autocast needs none.
        dynamic_loss_scale: move the scale by GradScaler's schedule (backoff after an overflow,
            growth after clean batches); the scale then depends on whether private samples
            overflowed — public state outside the DP guarantee — so it is off by default.
        distributed: data-parallel training over the default ``torch.distributed`` process group
            of W ranks (:mod:`private_engine.optim.distributed`). None (default): on when one is
            initialised with W > 1; True: requires one (ValueError otherwise); False: one
            process. ``batch_size`` and ``sample_size`` stay global (the expected logical batch
            over all ranks, the data set's size), so ``q = B/n`` and ε are those of one process.
            Each rank clips its own samples; at the step rank 0 adds ``N(0, σ²R²I)`` to its local
            sums, the sums are all-reduced, and every rank steps on
            ``(Σ_{all ranks} Σ_i C_i g_i + N(0, σ²R²I)) / B``. Only rank 0 has a noise
            generator. At construction the parameters and buffers are broadcast from rank 0
            (as ``DistributedDataParallel`` does). Pass the bare module, not a
            ``DistributedDataParallel`` wrapper. Every rank must call ``step`` together.
            A model sharded by FSDP2 (``fully_shard``) trains sharded under an initialised
            process group (``distributed`` None or True): each rank clips its samples on the
            unsharded parameters, the clipped sums are reduce-scattered into the shards and
            each rank adds the noise of the rows it owns
            (:mod:`private_engine.optim.sharded`; docs/distributed.md, "FSDP2").
        check_replicas: (debugging, data-parallel only) after every step compare a float64
            checksum of the parameters across ranks and raise
            :class:`private_engine.optim.ReplicaMismatchError` if they differ.
        step_logger: a TensorBoard ``SummaryWriter`` or a callable that gets the
            :class:`private_engine.step_metrics.StepMetrics` of every logical step (ε so far, and
            the non-private loss, clip fraction and dropped samples of the batch); see
            :meth:`add_step_logger`.
    """

    def __init__(self, model: Optional[nn.Module] = None, *, batch_size: int = None,
                 sample_size: int = None, max_grad_norm: float = None,
                 epochs: Optional[float] = None, steps: Optional[int] = None,
                 noise_multiplier: Optional[float] = None, target_epsilon: Optional[float] = None,
                 target_delta: Optional[float] = None, clipping_mode: str = DEFAULT_CLIPPING_MODE,
                 clipping_fn: Union[str, ClipFn] = "abadi", accountant: str = "rdp",
                 noise_generator: Optional[torch.Generator] = None, secure_mode: bool = False,
                 data_free_buffers: Sequence[str] = (),
                 grad_scaler: Optional["torch.amp.GradScaler"] = None,
                 dynamic_loss_scale: bool = False, allow_overrun: bool = False,
                 distributed: Optional[bool] = None, check_replicas: bool = False,
                 check_sampling: bool = True, data_loader=None,
                 step_logger: Optional[StepLogger] = None):
        if model is None:
            raise TypeError(
                "private_engine.PrivacyEngine needs the model: PrivacyEngine(model, "
                "batch_size=..., "
                "sample_size=..., max_grad_norm=..., noise_multiplier=... or target_epsilon=...). "
                "For Opacus' API (PrivacyEngine().make_private(...)) import "
                "private_engine.opacus_compat.PrivacyEngine."
            )
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}.")
        _refuse_data_parallel_wrapper(model)
        _refuse_fsdp1(model)
        sharded = bool(fsdp2_modules(model))
        if not (isinstance(batch_size, int) and batch_size > 0):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
        if not (isinstance(sample_size, int) and sample_size >= batch_size):
            raise ValueError(
                f"sample_size must be an integer ≥ batch_size ({batch_size}), got {sample_size!r}."
            )
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError("give exactly one of noise_multiplier or target_epsilon.")
        if data_loader is not None:
            check_loader(data_loader, batch_size, sample_size, poisson=bool(check_sampling))
        if not check_sampling:
            warnings.warn(
                "check_sampling=False: logical batches are not checked against Poisson sampling "
                f"at q={batch_size / sample_size:.4g}, and the ε reported assumes it; it is not a "
                "privacy guarantee for fixed-size or shuffled batches.", UserWarning,
                stacklevel=2)
        check_mode(clipping_mode)
        self.loss_scaling = LossScaling(grad_scaler, dynamic=dynamic_loss_scale)
        if self.loss_scaling.enabled and not is_book_keeping(clipping_mode):
            raise ValueError(
                "grad_scaler needs a book-keeping clipping_mode ('bk', 'bk_mixed' or "
                f"'bk_mixopt'), not "
                f"{clipping_mode!r}: the two-pass modes would backpropagate a float16 graph in "
                "which samples overflowed twice; book-keeping runs one backward and drops each "
                "overflowing sample alone."
            )
        self.model = model
        self.sample_size = sample_size
        self.sample_rate = batch_size / sample_size
        if not (isinstance(max_grad_norm, (int, float)) and 0 < max_grad_norm < math.inf):
            raise ValueError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm!r}.")
        self.target_delta = (
            float(target_delta) if target_delta is not None else 1.0 / (2 * sample_size)
        )
        self.target_epsilon = target_epsilon
        self.accountant_name = accountant
        self.accountant = make_accountant(accountant)
        self.clipping_mode = clipping_mode
        #: the collectives of data-parallel training (None: one process); a
        #: :class:`ShardedDataParallel` on an FSDP2 model
        self.distributed: Optional[_optim.DataParallel] = (
            _sharded(model, distributed, check_replicas) if sharded else
            _optim.data_parallel(distributed, _noise.parameters_device(model)))
        self.check_replicas = bool(check_replicas)
        generator = _noise.engine_noise_generator(model, noise_generator, secure_mode,
                                                  draws=self.draws_noise)
        if self.sharded:
            self.distributed.check_generators(generator)
        if target_epsilon is not None:
            self.steps = steps_for(epochs, steps, self.sample_rate)
            sigma = calibrate_noise_multiplier(
                target_epsilon, self.target_delta, self.sample_rate, self.steps, accountant
            )
        else:
            if noise_multiplier < 0 or not math.isfinite(noise_multiplier):
                raise ValueError(
                    f"noise_multiplier must be a finite number ≥ 0, got {noise_multiplier}."
                )
            sigma = float(noise_multiplier)
            self.steps = steps_for(epochs, steps, self.sample_rate) if (epochs or steps) else None

        #: σ, the expected batch size and the generator of the private steps' noise
        self.noise = _optim.NoiseSpec(sigma, batch_size, generator, bool(secure_mode))
        #: whether the user gave the noise generator (reproducible: checkpoints keep its state)
        self.noise_generator_given = noise_generator is not None
        #: the step ledger every step is recorded in before its release
        #: (:mod:`private_engine.accounting.ledger`; set by ``save_checkpoint`` or ``use_ledger``)
        self.ledger = None
        #: the target (ε, δ) and the guard that refuses a step beyond it
        self.budget = PrivacyBudget(noise_multiplier=sigma, sample_rate=self.sample_rate,
                                    delta=self.target_delta, accountant=accountant,
                                    planned_steps=self.steps, target_epsilon=target_epsilon,
                                    allow_overrun=allow_overrun)
        #: the samples of released logical batches against the declared batch_size
        self.sampling_check = SamplingRateCheck(batch_size, sample_size,
                                                enabled=bool(check_sampling))

        check_no_batchnorm(model)
        #: the trainable parameters the optimizer updates (FSDP2: the DTensor shards)
        self.params: List[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters (requires_grad=True).")
        # FSDP2: the clipping core is built on the unsharded parameters, the tensors the modules
        # hold while they compute (the modules hold them inside unsharded())
        with self._unsharded():
            scan = scan_model(model)
            layers = clipped_layers(model, strict=True, scan=scan)
            clip_params = (self.distributed.unsharded_params(self.params) if self.sharded
                           else self.params)
            if self.sharded and scan.fallbacks:
                raise ValueError(
                    "PrivacyEngine on an FSDP2 (fully_shard) model: the torch.func fallback is "
                    f"not supported ({[n for n, _ in scan.fallbacks]}): it replays modules "
                    "functionally on parameters that FSDP2 swaps between shards and gathered "
                    "tensors. Register a layer rule for these modules, or train them unsharded "
                    "(docs/distributed.md, \"FSDP2\").")
            self._names = self.parameter_names()
            if self.distributed is not None:
                self.distributed.broadcast_module(model)  # the replicas start identical
            #: the capture, the clipper and the guards of a step (the clipper runs the
            #: separability probe and the batch flow on the per-sample losses)
            self.core = assemble_clipping_core(
                model, layers, clip_params, traced=scan.traced, fallbacks=scan.fallbacks,
                mode=clipping_mode, clipping_fn=clipping_fn, max_grad_norm=max_grad_norm,
                data_free_buffers=data_free_buffers, compare_identity=not sharded,
                # dropout keyed from the user's noise_generator when one is given
                randomness_generator=None if noise_generator is None else
                keyed_by_state(noise_generator))
            self.clipper = self.core.clipper
            if self.sharded:  # one flat buffer per FSDP2 unit, freed once reduce-scattered
                self.clipper.buffer_group = self.distributed.unit_of
        #: FSDP2: whether physical batches are clipped with FSDP2's per-unit all-gathers
        #: (:meth:`_clip_sharded`)
        self._streamed = self.sharded and self.distributed.can_stream(self.clipper)
        #: refuses a training forward that changes a buffer from the data (a release without noise)
        self.buffer_guard = self.core.buffer_guard
        #: the randomness of training forwards (dropout) from a secret generator, not torch's
        #: publicly seeded global one
        self.model_randomness = self.core.model_randomness
        #: refuses a step during which a parameter or buffer changed outside the optimizer (in the
        #: forward, the loss or a backward hook): checked before every release
        self.state_guard = self.core.state_guard
        self._attached: List[_optim.PrivateStep] = []
        #: certified per-sample gradient norms ‖g_i‖ of the last clipped physical batch (None before
        #: the first)
        self.last_norms: Optional[torch.Tensor] = None
        #: samples dropped (clip factor 0) because their loss or gradient norm was not finite, since
        #: construction (a diagnostic for the analyst: it depends on the data and is not part of the
        #: private release)
        self.dropped_samples = 0
        #: the metrics of every logical step, sent to the step loggers (:meth:`add_step_logger`)
        self.step_metrics = StepMetricsRecorder(
            EpsilonTracker(lambda: self.accountant, self.target_delta))
        if step_logger is not None:
            self.add_step_logger(step_logger)
        log.info("PrivacyEngine: σ=%.4g, q=%.4g (B=%d, n=%d), R=%.4g, δ=%.3g, mode=%s, "
                 "accountant=%s, %s trainable parameters%s", sigma, self.sample_rate, batch_size,
                 sample_size, max_grad_norm, self.target_delta, clipping_mode, accountant,
                 sum(p.numel() for p in self.params),
                 "" if target_epsilon is None else
                 f", σ calibrated for ε={target_epsilon} over {self.steps} steps")

    @property
    def noise_multiplier(self) -> float:
        """σ: the noise's standard deviation is σ·R per coordinate."""
        return self.noise.noise_multiplier

    @property
    def noise_generator(self) -> Optional[torch.Generator]:
        """The generator the noise is drawn from (None in secure mode)."""
        return self.noise.generator

    @property
    def draws_noise(self) -> bool:
        """Whether this process draws the noise: one process, or rank 0 of a data-parallel
        group (the others add none: the all-reduced sum carries rank 0's one draw), or every
        rank of an FSDP2 model (each draws the noise of the rows it owns)."""
        return self.distributed is None or self.distributed.adds_noise

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded by FSDP2 (:mod:`private_engine.optim.sharded`)."""
        return isinstance(self.distributed, ShardedDataParallel)

    def _unsharded(self):
        """FSDP2: every module holds its unsharded parameters inside
        (:meth:`ShardedDataParallel.unsharded`); otherwise nothing."""
        return self.distributed.unsharded() if self.sharded else contextlib.nullcontext()

    @property
    def secure_mode(self) -> bool:
        """Whether the noise comes from the OS cryptographic generator (fixed at construction)."""
        return self.noise.secure_mode

    @property
    def batch_size(self) -> int:
        """B, the expected logical batch size: the divisor of the noisy sum (fixed at
        construction, as the sampling rate the accountant uses is)."""
        return self.noise.expected_batch_size

    # -- optimizer ---------------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Privatise ``optimizer`` in place: ``step(loss=...)`` and ``virtual_step(loss=...)``.

        Every parameter the optimizer updates must be a trainable parameter of the model.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"attach expects a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        self.check_optimizer(optimizer)
        if any(s.optimizer is optimizer and s.attached for s in self._attached):
            raise RuntimeError("this optimizer is already attached to the engine.")
        self.clipper.install()  # hooks removed by detach() come back
        if self.sharded:
            self.distributed.take_over_fsdp()
        self.buffer_guard.install()
        self.state_guard.install()
        self.state_guard.arm()
        self.model_randomness.install()
        state = _optim.PrivateStep(optimizer, self.params, self.clip_batch,
                                   lambda: self.clipper.max_grad_norm, self.noise,
                                   self.parameter_names, step_hook=self._account_step,
                                   pre_step=self._check_budget,
                                   pre_release=self._pre_release,
                                   reducer=self.distributed,
                                   post_step=self._check_replicas if self.check_replicas else None,
                                   on_step=self._record_step_metrics)
        self._attached.append(_optim.attach(state))
        return optimizer

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer that would update a trainable parameter the engine does not clip (one
        that is not the model's, or one unfrozen after the engine was built): its ``.grad`` would be
        released without clipping or noise. Run at ``attach`` and before every private step."""
        check_clipped_params(optimizer, {id(p) for p in self.params}, self.parameter_names)

    def detach(self) -> None:
        """Remove the hooks and restore every attached optimizer's own ``step`` (and, on an
        FSDP2 model, FSDP2's own gradient reduction and resharding settings)."""
        for state in self._attached:
            _optim.detach(state)
        self._attached = []
        self.clipper.remove()
        self.buffer_guard.remove()
        self.state_guard.remove()
        self.model_randomness.remove()
        if self.sharded:  # FSDP2 reduces its own gradients again
            self.distributed.restore_fsdp()

    # -- clipping ------------------------------------------------------------------------------
    def clipped_grad_sum(self, loss: torch.Tensor):
        """``([Σ_i C_i ∂L_i/∂θ for θ in params], B)`` for one physical batch (FSDP2: this rank's
        rows of the ranks' summed clipped sums, a collective on every rank).

        Raises on a malformed loss before anything is modified; a sample whose loss or gradient norm
        is not finite is dropped (clip factor 0, counted in ``dropped_samples``).
        """
        sums, n = self.clipped_sums(loss)
        return sums.own_grads(), n

    def clipped_sums(self, loss: torch.Tensor):
        """``(GradSums, B)``: :meth:`clipped_grad_sum` with the sums' flat buffers
        (:mod:`private_engine.clipping.grad_sums`), which the private step noises and scales in
        one operation each."""
        batch = self.clip_batch(loss)
        return batch.sums, batch.size

    def clip_batch(self, loss: torch.Tensor) -> ClippedBatch:
        """One physical batch through the clipping core
        (:func:`private_engine.clipping.batch.clip_batch`), with this engine's loss scaling; the
        norms and dropped samples are recorded for :attr:`last_norms` / :attr:`dropped_samples`."""
        if self.sharded:
            return self._clip_sharded(loss)
        self.model_randomness.end()  # the step's forward and loss are over
        try:
            batch = self._clip(loss)
            self._check_state()
        except BaseException:
            self.state_guard.disarm()
            raise
        return self._recorded(batch)

    def _clip(self, loss: torch.Tensor, **kwargs) -> ClippedBatch:
        return clip_batch(self.clipper, loss, loss_scaling=self.loss_scaling, names=self._names,
                          all_dropped_hint="the model may have diverged (lower the learning "
                          "rate; float16 autocast: pass grad_scaler=torch.amp.GradScaler("
                          "device)).", **kwargs)

    def _check_state(self) -> None:
        """Nothing of a batch is released before the state guard has seen the step; it records
        the state again at once: the next physical batch is watched from here."""
        self.state_guard.check(self.clipper.batch_flow.written_storages)
        self.state_guard.arm()

    def _recorded(self, batch: ClippedBatch) -> ClippedBatch:
        if batch.norms is not None:
            self.last_norms = batch.norms
        self.dropped_samples += batch.dropped
        return batch

    def _clip_sharded(self, loss: torch.Tensor) -> ClippedBatch:
        """:meth:`clip_batch` on an FSDP2 model: this rank's clipped sums reduce-scattered into
        its shard sums (:mod:`private_engine.optim.sharded`). The ranks first agree (one small
        all-gather) on how every rank runs the batch: with FSDP2's per-unit all-gathers in the
        one backward of a book-keeping mode (each unit's sums formed and reduce-scattered in
        turn after the clip factors; a rank with an empty batch runs the same backward on its
        zero-row graph), or, for the two-pass modes, rules that read weights, and batches on
        which some rank runs the separability probe, with the whole model gathered; a rank
        whose checks failed makes every rank raise before the backward."""
        d = self.distributed
        d.check_fsdp_state()
        self.model_randomness.end()  # the step's forward and loss are over
        error, walk = None, None
        try:
            walk = check_batch(self.clipper, loss, self._names)
        except Exception as e:
            error = e
        probe = self.clipper.probe is not None and self.clipper.probe.pending
        graphless = error is None and loss.numel() == 0 and loss.grad_fn is None  # no backward
        gather, failed = d.agree(error is None and (probe and loss.numel() > 0 or graphless),
                                 error is not None)
        if error is not None:
            self.state_guard.disarm()
            raise error
        if failed:
            self.clipper.release()
            self.state_guard.disarm()
            raise RuntimeError(f"rank(s) {failed} could not clip their batch (see their error): "
                               "this step is refused on every rank; nothing was updated.")
        try:
            if self._streamed and not gather:
                sums = d.new_shard_sums(self.params)
                with d.streaming():
                    if loss.numel() == 0:
                        d.empty_backward(self.clipper, loss)
                        batch = ClippedBatch(sums, 0, None, 0)
                    else:
                        batch = self._clip(loss, walk=walk, sums_by_buffer=d.sums_sink(sums))
                        batch.sums = sums
                d.fill_missing(sums)
            else:
                with d.unsharded():  # one all-gather of every unit, the same on every rank
                    batch = self._clip(loss, walk=walk, before_sums=d.free_gathered)
                batch.sums = d.scatter(batch.sums, self.params)
            self._check_state()
        except BaseException:
            self.state_guard.disarm()
            raise
        finally:
            d.end_batch()
        return self._recorded(batch)

    @property
    def max_grad_norm(self) -> float:
        """R: the clipping threshold and the noise's scale (one value, the clipper's: the two never
        drift apart)."""
        return self.clipper.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        if not (isinstance(value, (int, float)) and 0 < value < math.inf):
            raise ValueError(f"max_grad_norm must be a finite number > 0, got {value!r}.")
        if float(value) != self.clipper.max_grad_norm and any(
            s.attached and s.grad_sums is not None for s in self._attached
        ):
            raise ValueError(
                "max_grad_norm cannot change while a logical batch is being accumulated "
                "(virtual_step): its physical batches would be clipped at another R than the noise "
                "is drawn for. Change it after optimizer.step()."
            )
        self.clipper.max_grad_norm = float(value)

    @property
    def layer_plan(self) -> List[LayerDecision]:
        """The per-layer ghost/instantiate decisions made on the last batch."""
        return self.clipper.last_plan

    # -- accounting ----------------------------------------------------------------------------
    def _check_budget(self) -> None:
        """Before every private step: refuse it if it would exceed the budget
        (:class:`private_engine.accounting.BudgetExceededError`)."""
        self.budget.check_step(self.steps_taken)

    def _pre_release(self, samples: int) -> None:
        """Before a logical batch's noise: the sampling-rate check, then the step's line in the
        ledger, on disk before the update is applied (a step the run may release is counted)."""
        self.sampling_check.check(samples)
        if self.ledger is not None:
            self.ledger.record(self.noise_multiplier, self.sample_rate)

    def _account_step(self, samples: int) -> None:
        """The step hook of every attached optimizer: one Poisson-subsampled Gaussian release of a
        logical batch of ``samples`` samples."""
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
        self.sampling_check.commit(samples)
        self.state_guard.arm()  # after the update: the next step's state starts here

    def add_step_logger(self, sink: StepLogger, *,
                        epsilon_every: Optional[int] = None) -> Callable[[StepMetrics], None]:
        """Send the metrics of every logical step to ``sink``: a TensorBoard ``SummaryWriter``
        (scalars ``privacy/epsilon``, ``train/loss``, ``train/clip_fraction``,
        ``train/dropped_samples``, ``train/samples`` at ``global_step`` = the step) or any
        callable taking a :class:`private_engine.step_metrics.StepMetrics`
        (:mod:`private_engine.step_metrics`). ε is exact at every step with the RDP accountant;
        with another it is computed every ``epsilon_every`` steps (default 10; None between).
        The loss, clip fraction and dropped samples are non-private statistics of the batch.
        Returns the registered callable, for :meth:`remove_step_logger`."""
        if epsilon_every is not None:
            if not (isinstance(epsilon_every, int) and epsilon_every > 0):
                raise ValueError(
                    f"epsilon_every must be a positive integer, got {epsilon_every!r}.")
            self.step_metrics.epsilon.every = epsilon_every
        return self.step_metrics.add(sink)

    def remove_step_logger(self, fn: Callable[[StepMetrics], None]) -> None:
        """Stop sending step metrics to ``fn`` (what :meth:`add_step_logger` returned)."""
        self.step_metrics.remove(fn)

    def _record_step_metrics(self, records: List[BatchRecord]) -> None:
        """After every successful step: its metrics to the step loggers."""
        self.step_metrics.record(self.steps_taken, records, self.clipper.max_grad_norm)

    def _check_replicas(self) -> None:
        """After a data-parallel step (``check_replicas=True``): the float64 checksums
        ``(Σθ, Σθ²)`` of every rank's parameters must be equal
        (:meth:`private_engine.optim.DataParallel.check_replicas`)."""
        if self.distributed is not None:
            self.distributed.check_replicas(self.params)

    def privacy_report(self) -> PrivacyReport:
        """ε spent, steps, σ, q, δ, the budget and what remains of it, and the mean logical batch
        actually clipped (:class:`private_engine.accounting.PrivacyReport`; ``str()`` gives one
        line)."""
        return self.budget.report(self.get_epsilon(), self.steps_taken,
                                  self.sampling_check.mean_batch_size, self.batch_size,
                                  sampling_checked=self.sampling_check.enabled)

    def parameter_names(self) -> dict:
        """``{id(parameter): qualified name}`` of the model as it is now (FSDP2: of its
        ``DTensor`` shards and of the unsharded parameters the clipper holds)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        if self.sharded:
            for p in self.params:
                if id(p) in names:
                    u = self.distributed.unsharded_params([p])[0]
                    names[id(u)] = names[id(p)]
        return names

    # -- copies ------------------------------------------------------------------------------
    def _refuse_copy(self, *args):
        raise TypeError(
            "a PrivacyEngine cannot be copied or pickled: it holds hooks on its model and the "
            "state of one privacy budget, which a copy would share or spend twice. Save "
            "engine.state_dict() (private_engine.save_checkpoint) and build a new engine on the "
            "copied model (then load_state_dict) instead.")

    __copy__ = __deepcopy__ = __reduce_ex__ = __reduce__ = _refuse_copy

    @property
    def steps_taken(self) -> int:
        return sum(n for _, _, n in self.accountant.history)

    def get_epsilon(self, delta: Optional[float] = None) -> float:
        """ε spent so far at ``delta`` (default ``target_delta``) by the engine's accountant (with
        the RDP accountant, from one-step RDP curves cached per (σ, q): the accountant's value, in
        a fraction of a millisecond, :class:`private_engine.step_metrics.EpsilonTracker`)."""
        if not self.accountant.history:
            return 0.0
        delta = self.target_delta if delta is None else delta
        eps = self.step_metrics.epsilon.exact(delta)
        return eps if eps is not None else float(self.accountant.get_epsilon(delta=delta))

    # -- checkpoints -----------------------------------------------------------------------------
    @property
    def attached_steps(self) -> List[_optim.PrivateStep]:
        """The private step of every optimizer attached now (:meth:`attach`), in attach order."""
        return [s for s in self._attached if s.attached]

    def state_dict(self) -> dict:
        """The engine's state for a resumed run
        (:func:`private_engine.checkpoint.engine_state_dict`: privacy parameters, accountant
        history, step ledger, a given generator's state), public values only; refused in the
        middle of a logical batch (take it right after ``optimizer.step()``)."""
        from .checkpoint import engine_state_dict

        state = engine_state_dict(self)
        if self.sharded:  # each rank's own generator: a state is loaded on the rank that wrote it
            state["shard"] = {"rank": self.distributed.rank,
                              "world_size": self.distributed.world_size}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`: the accountant takes the history of the state's step ledger
        (steps released after the state count); a state written under other privacy parameters,
        or whose ledger is missing, raises ``ValueError``, with nothing changed
        (:func:`private_engine.checkpoint.load_engine_state_dict`)."""
        from .checkpoint import load_engine_state_dict

        if self.sharded:
            mine = {"rank": self.distributed.rank, "world_size": self.distributed.world_size}
            if not isinstance(state, dict) or state.get("shard") != mine:
                raise ValueError(
                    f"this FSDP2 engine (rank {mine['rank']} of {mine['world_size']}) loads only "
                    f"the state its own rank wrote (engine.state_dict() on rank {mine['rank']}); "
                    f"this one is {state.get('shard') if isinstance(state, dict) else None}: "
                    "each rank draws the noise of its own rows from its own generator, and "
                    "two ranks restoring one state would repeat their noise.")
        load_engine_state_dict(self, state)
        self.state_guard.arm()  # the loaded state is where the next step starts


def _refuse_data_parallel_wrapper(model: nn.Module) -> None:
    """Refuse a model wrapped in ``DistributedDataParallel`` (or Opacus' DPDDP): the engine forms
    no ``.grad`` by autograd (it clips per sample in its own backward), so the wrapper's gradient
    all-reduce would never carry the clipped sums; the engine reduces those itself."""
    wrapped = isinstance(model, nn.parallel.DistributedDataParallel) or (
        type(model).__name__ == "DifferentiallyPrivateDistributedDataParallel")
    if wrapped:
        raise ValueError(
            f"PrivacyEngine got a {type(model).__name__}: pass the bare module "
            "(ddp_model.module). The engine clips each sample's gradient in its own backward, "
            "which forms no .grad for DDP's reducer to all-reduce, and sums the ranks' clipped "
            "gradients itself (noise once, on rank 0) under an initialised process group "
            "(distributed=None detects it).")


def _refuse_fsdp1(model: nn.Module) -> None:
    """Refuse a model wrapped by FSDP1 (``FullyShardedDataParallel``): it flattens parameters into
    one flat parameter per unit, so no layer owns its own weight and no per-sample gradient can be
    formed per layer. FSDP2 (``fully_shard``) keeps each parameter and is supported."""
    names = fsdp1_names(model)
    if names:
        raise ValueError(
            f"PrivacyEngine got a model wrapped by FSDP1 ({names[:3]}): its flat parameters hide "
            "the layers' own weights, which per-sample clipping needs. Shard it with FSDP2 "
            "instead (torch.distributed.fsdp.fully_shard), which the engine supports "
            "(docs/distributed.md, \"FSDP2\").")


def _sharded(model: nn.Module, distributed: Optional[bool],
             check_replicas: bool) -> ShardedDataParallel:
    """The :class:`ShardedDataParallel` of an FSDP2 model: ``distributed`` must not be False (the
    shards are one model only together) and ``check_replicas`` must be off (no replicas)."""
    if distributed is False:
        raise ValueError(
            "PrivacyEngine got an FSDP2 (fully_shard) model with distributed=False: its "
            "parameters are shards of one model held by all the ranks; leave distributed=None.")
    if check_replicas:
        raise ValueError(
            "check_replicas=True compares replicas; under FSDP2 the ranks hold different shards "
            "of the parameters, not replicas.")
    return ShardedDataParallel(model, _noise.parameters_device(model))
