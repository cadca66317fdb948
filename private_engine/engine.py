"""The native privacy engine: assembles capture, clipping, the private optimizer and accounting.

::

    engine = PrivacyEngine(model, batch_size=1000, sample_size=50_000, epochs=3,
                           max_grad_norm=0.1, target_epsilon=3.0)
    engine.attach(optimizer)
    optimizer.step(loss=per_sample_losses)       # or virtual_step(loss=...) to accumulate
    engine.get_epsilon()

The Opacus API (``make_private``) is :class:`private_engine.opacus_compat.PrivacyEngine`
(docs/migrating-from-opacus.md). Under an initialised ``torch.distributed`` process group the
engine trains data-parallel or on FSDP2 shards (:mod:`private_engine.optim.topology`,
docs/distributed.md). The arguments are checked by :class:`private_engine.engine_config.
EngineConfig`; a step's path is :class:`private_engine.optim.PrivateStep` (docs/architecture.md,
"One step's path").
"""
from __future__ import annotations

import logging
import warnings
from typing import Callable, List, Optional, Sequence, Union

import torch
from torch import nn

from . import optim as _optim
from .accounting import PrivacyReport, StepAccountant, check_loader
from .clipping.assembly import assemble_clipping_core
from .clipping.batch import ClippedBatch, clip_batch
from .clipping.functions import ClipFn
from .clipping.loss_scaling import LossScaling
from .clipping.plan import DEFAULT_CLIPPING_MODE, LayerDecision
from .engine_config import EngineConfig, check_max_grad_norm
from .foundation.randomness import keyed_by_state
from .guards.model_check import check_no_batchnorm, clipped_layers, scan_model
from .guards.state import StepStateGuard
from .optim import noise as _noise
from .optim.private_step import check_clipped_params
from .optim.topology import Topology, check_model_wrappers, choose_topology
from .step_metrics import EpsilonTracker, StepLogger, StepMetrics, StepMetricsRecorder

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
            (``private_engine.foundation.randomness.entropy_seeded_generator``), never from torch's
            global one, so ``torch.manual_seed`` does not make it reproducible. A generator given
            here is used as is and warns once (``ReproducibleNoiseWarning``): anyone who knows its
            seed can subtract the noise.
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
        sharded = check_model_wrappers(model)
        #: the checked arguments (:class:`private_engine.engine_config.EngineConfig`)
        self.config = c = EngineConfig(
            batch_size=batch_size, sample_size=sample_size, max_grad_norm=max_grad_norm,
            epochs=epochs, steps=steps, noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon, target_delta=target_delta,
            clipping_mode=clipping_mode, clipping_fn=clipping_fn, accountant=accountant,
            noise_generator=noise_generator, secure_mode=secure_mode,
            data_free_buffers=data_free_buffers, grad_scaler=grad_scaler,
            dynamic_loss_scale=dynamic_loss_scale, allow_overrun=allow_overrun,
            distributed=distributed, check_replicas=check_replicas,
            check_sampling=check_sampling, data_loader=data_loader, step_logger=step_logger)
        if data_loader is not None:
            check_loader(data_loader, batch_size, sample_size, poisson=bool(check_sampling))
        if not check_sampling:
            warnings.warn(
                "check_sampling=False: logical batches are not checked against Poisson sampling "
                f"at q={c.sample_rate:.4g}, and the ε reported assumes it; it is not a "
                "privacy guarantee for fixed-size or shuffled batches.", UserWarning,
                stacklevel=2)
        self.loss_scaling = LossScaling(grad_scaler, dynamic=dynamic_loss_scale)
        self.model = model
        self.sample_size = sample_size
        self.sample_rate = c.sample_rate
        self.target_delta = c.delta
        self.target_epsilon = target_epsilon
        self.accountant_name = accountant
        self.clipping_mode = clipping_mode
        #: where the steps run: one process, data-parallel replicas or FSDP2 shards
        #: (:mod:`private_engine.optim.topology`), chosen once here
        self.topology: Topology = choose_topology(model, distributed, check_replicas,
                                                  _noise.parameters_device(model), sharded)
        self.check_replicas = bool(check_replicas)
        generator = _noise.engine_noise_generator(model, noise_generator, secure_mode,
                                                  draws=self.draws_noise)
        self.topology.check_generator(generator)
        sigma, self.steps = c.noise()
        #: σ, the expected batch size and the generator of the private steps' noise
        self.noise = _optim.NoiseSpec(sigma, batch_size, generator, bool(secure_mode))
        #: whether the user gave the noise generator (reproducible: checkpoints keep its state)
        self.noise_generator_given = noise_generator is not None
        #: the accountant, the budget guard, the sampling-rate check, the step ledger and the
        #: step metrics: what every private step asks before and after its release
        self.accounting = StepAccountant.build(
            accountant, noise_multiplier=sigma, batch_size=batch_size, sample_size=sample_size,
            delta=self.target_delta, planned_steps=self.steps, target_epsilon=target_epsilon,
            allow_overrun=allow_overrun, check_sampling=check_sampling)
        self.accounting.step_metrics = StepMetricsRecorder(
            EpsilonTracker(lambda: self.accounting.accountant, self.target_delta))

        check_no_batchnorm(model)
        #: the trainable parameters the optimizer updates (FSDP2: the DTensor shards)
        self.params: List[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters (requires_grad=True).")
        # FSDP2: the clipping core is built on the unsharded parameters, the tensors the modules
        # hold while they compute (the modules hold them inside unsharded())
        with self.topology.unsharded():
            scan = scan_model(model)
            layers = clipped_layers(model, strict=True, scan=scan)
            clip_params = self.topology.clip_params(self.params)
            self.topology.check_scan(scan)
            self._names = self.parameter_names()
            self.topology.prepare_model(model)  # the replicas start identical
            #: the capture, the clipper and the guards of a step (the clipper runs the
            #: separability probe and the batch flow on the per-sample losses)
            self.core = assemble_clipping_core(
                model, layers, clip_params, traced=scan.traced, fallbacks=scan.fallbacks,
                mode=clipping_mode, clipping_fn=clipping_fn, max_grad_norm=max_grad_norm,
                data_free_buffers=data_free_buffers, compare_identity=not sharded,
                # dropout keyed from the user's noise_generator when one is given
                randomness_generator=None if noise_generator is None else
                keyed_by_state(noise_generator))
        self.topology.bind(self.clipper)  # FSDP2: one buffer per unit; streamed or gathered
        self._attached: List[_optim.PrivateStep] = []
        #: certified per-sample gradient norms ‖g_i‖ of the last clipped physical batch (None before
        #: the first)
        self.last_norms: Optional[torch.Tensor] = None
        #: samples dropped (clip factor 0) because their loss or gradient norm was not finite, since
        #: construction (a diagnostic for the analyst: it depends on the data and is not part of the
        #: private release)
        self.dropped_samples = 0
        if step_logger is not None:
            self.add_step_logger(step_logger)
        log.info("PrivacyEngine: σ=%.4g, q=%.4g (B=%d, n=%d), R=%.4g, δ=%.3g, mode=%s, "
                 "accountant=%s, %s trainable parameters%s", sigma, self.sample_rate, batch_size,
                 sample_size, max_grad_norm, self.target_delta, clipping_mode, accountant,
                 sum(p.numel() for p in self.params),
                 "" if target_epsilon is None else
                 f", σ calibrated for ε={target_epsilon} over {self.steps} steps")

    @property
    def clipper(self):
        """The per-sample clipper of the assembled core
        (:class:`private_engine.clipping.assembly.ClippingCore`)."""
        return self.core.clipper

    @property
    def buffer_guard(self):
        """Refuses a training forward that changes a buffer from the data (a release without
        noise)."""
        return self.core.buffer_guard

    @property
    def model_randomness(self):
        """The randomness of training forwards (dropout) from a secret generator, not torch's
        publicly seeded global one."""
        return self.core.model_randomness

    @property
    def state_guard(self):
        """Refuses a step during which a parameter or buffer changed outside the optimizer (in the
        forward, the loss or a backward hook): checked before every release."""
        return self.core.state_guard

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
        return self.topology.adds_noise

    @property
    def distributed(self) -> Optional[_optim.DataParallel]:
        """The collectives of data-parallel or FSDP2 training (None: one process)."""
        return self.topology.collectives

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded by FSDP2 (:mod:`private_engine.optim.sharded`)."""
        return self.topology.sharded

    @property
    def secure_mode(self) -> bool:
        """Whether the noise comes from the OS cryptographic generator (fixed at construction)."""
        return self.noise.secure_mode

    @property
    def batch_size(self) -> int:
        """B, the expected logical batch size: the divisor of the noisy sum (fixed at
        construction, as the sampling rate the accountant uses is)."""
        return self.noise.expected_batch_size

    # -- the accounting's parts, by their names ------------------------------------------------
    accountant = property(lambda self: self.accounting.accountant,
                          lambda self, value: setattr(self.accounting, "accountant", value),
                          doc="The accountant of the private steps.")
    budget = property(lambda self: self.accounting.budget,
                      doc="The target (ε, δ) and the guard that refuses a step beyond it.")
    sampling_check = property(lambda self: self.accounting.sampling_check,
                              doc="The samples of released logical batches against batch_size.")
    step_metrics = property(lambda self: self.accounting.step_metrics,
                            doc="The metrics of every logical step, sent to the step loggers.")
    ledger = property(lambda self: self.accounting.ledger,
                      lambda self, value: setattr(self.accounting, "ledger", value),
                      doc="The step ledger every step is recorded in before its release "
                          "(set by save_checkpoint or use_ledger), or None.")

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
        self.core.install()  # hooks removed by detach() come back, in the assembly's order
        self.topology.attach()
        self.state_guard.arm()
        state = _optim.PrivateStep(optimizer, self.params, self, self.noise,
                                   topology=self.topology, accounting=self.accounting)
        # after the update: the next step's state starts here
        state.register_step_post_hook(_ArmGuard(self.state_guard))
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
        self.core.remove()
        self.topology.detach()

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
        (:func:`private_engine.clipping.batch.clip_batch`) as the topology runs it
        (:meth:`private_engine.optim.topology.Topology.clip`; FSDP2: reduce-scattered into this
        rank's shard sums), with this engine's loss scaling; checked by the state guard before
        anything is released; the norms and dropped samples are recorded for
        :attr:`last_norms` / :attr:`dropped_samples`."""
        self.topology.check_ready()
        self.model_randomness.end()  # the step's forward and loss are over
        try:
            batch = self.topology.clip(loss, clipper=self.clipper, clip=self._clip,
                                       check=self._check_state, names=self._names,
                                       params=self.params)
        except BaseException:
            self.state_guard.disarm()
            raise
        if batch.norms is not None:
            self.last_norms = batch.norms
        self.dropped_samples += batch.dropped
        return batch

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

    @property
    def max_grad_norm(self) -> float:
        """R: the clipping threshold and the noise's scale (one value, the clipper's: the two never
        drift apart)."""
        return self.clipper.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        check_max_grad_norm(value)
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

    def privacy_report(self) -> PrivacyReport:
        """ε spent, steps, σ, q, δ, the budget and what remains of it, and the mean logical batch
        actually clipped (:class:`private_engine.accounting.PrivacyReport`; ``str()`` gives one
        line)."""
        return self.accounting.privacy_report(self.batch_size)

    def parameter_names(self) -> dict:
        """``{id(parameter): qualified name}`` of the model as it is now (FSDP2: of its
        ``DTensor`` shards and of the unsharded parameters the clipper holds)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return self.topology.parameter_names(names, self.params)

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
        return self.accounting.steps_taken

    def get_epsilon(self, delta: Optional[float] = None) -> float:
        """ε spent so far at ``delta`` (default ``target_delta``) by the engine's accountant (with
        the RDP accountant, from one-step RDP curves cached per (σ, q): the accountant's value, in
        a fraction of a millisecond, :class:`private_engine.step_metrics.EpsilonTracker`)."""
        return self.accounting.get_epsilon(delta)

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

        return engine_state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`: the accountant takes the history of the state's step ledger
        (steps released after the state count); a state written under other privacy parameters,
        or whose ledger is missing, raises ``ValueError``, with nothing changed
        (:func:`private_engine.checkpoint.load_engine_state_dict`; FSDP2: only on the rank that
        wrote it)."""
        from .checkpoint import load_engine_state_dict

        self.topology.check_state_tag(state)
        load_engine_state_dict(self, state)
        self.state_guard.arm()  # the loaded state is where the next step starts


class _ArmGuard:
    """The step post hook that records the model's state after each update
    (:class:`private_engine.guards.state.StepStateGuard`): the next step is watched from there."""

    def __init__(self, guard: StepStateGuard):
        self.guard = guard

    def __call__(self, step, samples: int) -> None:
        self.guard.arm()
