"""Privatising torch optimizers: accumulation of clipped sums, Gaussian noise, scaling, step.

After ``k`` virtual steps and one step over physical batches B_1..B_{k+1} (a logical batch), the
parameters are updated by the wrapped optimizer with

    ĝ = ( Σ_{i ∈ B_1 ∪ … ∪ B_{k+1}} C_i·g_i  +  N(0, σ²R²·I) ) / B_expected,

noise drawn once per logical batch (Abadi et al. 2016, "Deep Learning with Differential Privacy";
Bu, Mao & Xu 2022, Appendix E). ``B_expected`` is the declared (expected) logical batch size.
DP-SGD, DP-Adam and DP-AdamW are the torch optimizers with this gradient.

The stages are named as in Opacus' ``DPOptimizer``: :meth:`PrivateStep.clip_and_accumulate`,
:meth:`PrivateStep.add_noise`, :meth:`PrivateStep.scale_grad`, then the wrapped optimizer's own
step, and the ``step_hook`` (the accountant) after a step that succeeded. Data-parallel
(:mod:`.distributed`): each rank accumulates its own samples' sums, and
:meth:`PrivateStep.reduce_sums` replaces ``add_noise``: the noise on rank 0 only, then one
``all_reduce(SUM)`` per flat buffer, so the union of the ranks' batches is the logical batch and
the noise is drawn once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..clipping.batch import ClippedBatch
from ..clipping.grad_sums import GradSums
from ..foundation.dtypes import cast
from .distributed import DataParallel
from .noise import add_gaussian_noise


@dataclass(frozen=True)
class BatchRecord:
    """What a physical batch leaves for the step's metrics: its certified norms (dropped samples
    at 0), its per-sample losses (detached), its dropped count and size."""

    norms: Optional[torch.Tensor]
    loss: Optional[torch.Tensor]
    dropped: int
    size: int


@dataclass
class NoiseSpec:
    """The noise of a private step: ``N(0, σ²R²I)`` once per logical batch, divided by the
    expected batch size. ``R`` is the clipper's (the clip threshold and the noise scale never
    drift apart)."""

    noise_multiplier: float
    expected_batch_size: int
    generator: Optional[torch.Generator] = None
    secure_mode: bool = False


def check_clipped_params(optimizer: torch.optim.Optimizer, clipped_ids,
                         names: Callable[[], Dict[int, str]]) -> None:
    """Refuse an optimizer that would update a trainable parameter that is not clipped (not the
    model's, or unfrozen after the engine was built): its ``.grad`` would be released without
    clipping or noise. ``clipped_ids``: ids of the clipped parameters; ``names()``:
    ``{id(param): name}`` of the model as it is now, for the message."""
    foreign = [p for g in optimizer.param_groups for p in g["params"]
               if p.requires_grad and id(p) not in clipped_ids]
    if foreign:
        known = names()
        shown = [known.get(id(p), f"a tensor of shape {tuple(p.shape)} not in the model")
                 for p in foreign]
        raise ValueError(
            f"the optimizer updates trainable parameter(s) the engine does not clip: {shown}. "
            "Their gradients would be released without privacy. Build the engine after "
            "choosing what to train (parameters unfrozen later are not clipped), and the "
            "optimizer from model.parameters(). Nothing was updated.")


class PrivateStep:
    """A privatised optimizer's state and stages: the clipped-gradient sums of the current logical
    batch, the noise, the scaling and the step.

    Args:
        optimizer: the torch optimizer whose ``step`` is replaced.
        params: the clipped parameters, in the order of the clipped sums.
        clip: clips one physical batch of per-sample losses
            (:func:`private_engine.clipping.batch.clip_batch` bound to a clipper).
        max_grad_norm: the current R (the clipper's).
        noise: σ, the expected batch size, the generator.
        names: returns ``{id(param): name}`` of the model as it is now, for messages.
        step_hook: called with the logical batch's sample count after each successful step
            (accounting).
        pre_step: called before anything else in a step (the budget guard); raising refuses the
            step.
        pre_release: called with the logical batch's sample count once it is clipped, before the
            noise (the sampling-rate check); raising refuses the step, nothing changed.
        reducer: data-parallel training (:class:`.distributed.DataParallel`): the sample counts
            (``pre_release``, ``step_hook``) and the released sums are the ranks' totals, the
            noise is drawn on rank 0 only (:meth:`reduce_sums`); on an FSDP2 model
            (:class:`.sharded.ShardedDataParallel`, ``params`` its ``DTensor`` shards), each rank
            noises the rows it owns. None: one process.
        post_step: called after a step succeeded and was accounted (the replica check).
        on_step: called after ``step_hook`` with the :class:`~private_engine.step_metrics.
            BatchRecord` of each physical batch of the logical batch just released (the step's
            metrics).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter],
                 clip: Callable[[torch.Tensor], ClippedBatch], max_grad_norm: Callable[[], float],
                 noise: NoiseSpec, names: Callable[[], Dict[int, str]],
                 step_hook: Optional[Callable[[int], None]] = None,
                 pre_step: Optional[Callable[[], None]] = None,
                 pre_release: Optional[Callable[[int], None]] = None,
                 reducer: Optional[DataParallel] = None,
                 post_step: Optional[Callable[[], None]] = None,
                 on_step: Optional[Callable[[List[BatchRecord]], None]] = None):
        self.optimizer = optimizer
        self.params = list(params)
        self._param_ids = frozenset(id(p) for p in self.params)
        self.clip = clip
        self.max_grad_norm = max_grad_norm
        self.noise = noise
        self.names = names
        self.step_hook = step_hook
        self.pre_step = pre_step
        self.pre_release = pre_release
        self.reducer = reducer
        self.post_step = post_step
        self.on_step = on_step
        self.original_step = optimizer.step
        self.grad_sums: Optional[GradSums] = None
        self.samples = 0
        #: the physical batches of the logical batch being accumulated
        self.records: List[BatchRecord] = []
        self.attached = True

    @property
    def accumulating(self) -> bool:
        """True while a logical batch is in progress (``virtual_step`` accumulated clipped sums
        that are not yet noised)."""
        return self.grad_sums is not None or bool(self.samples)

    # -- stages ------------------------------------------------------------------------------
    def check_params(self) -> None:
        """:func:`check_clipped_params` for this optimizer."""
        check_clipped_params(self.optimizer, self._param_ids, self.names)

    def clip_and_accumulate(self, loss) -> None:
        """Clip this physical batch and add ``Σ_i C_i g_i`` to the running sums (no parameter
        change)."""
        batch = self.clip(loss)
        if self.grad_sums is None:
            self.grad_sums = batch.sums
        else:
            self.grad_sums.add_(batch.sums)
        self.samples += batch.size
        self.records.append(_record(batch))

    def add_noise(self, sums: GradSums) -> None:
        """``sums ← sums + σR·ξ``, ξ ~ N(0, I) over every coordinate, drawn once per logical
        batch."""
        if self.reducer is not None and not self.reducer.adds_noise:
            raise RuntimeError("only rank 0 draws the noise of a data-parallel step.")
        std = self.noise.noise_multiplier * self.max_grad_norm()
        if std > 0:
            add_gaussian_noise(sums.buffers, std, self.noise.generator, self.noise.secure_mode)

    def reduce_sums(self, sums: GradSums, same_layout: bool = False) -> GradSums:
        """Data-parallel release of the ranks' local sums ``s_r = Σ_{i ∈ S_r} C_i g_i``: rank 0
        adds ``σR·ξ`` (:meth:`add_noise`) to its local sums, then every buffer is all-reduced, so
        every rank returns ``Σ_r s_r + σR·ξ`` — one Gaussian draw in total, before any sum leaves
        a rank.

        Private as one process is: the result is the deterministic, sensitivity-R function
        ``Σ_r s_r`` of the clipped gradients (one sample lies on one rank and moves its ``s_r`` by
        at most R) plus one draw of N(0, σ²R²I); the other ranks see rank 0's contribution only
        inside that noisy sum. The buffers are ``sums``' own when every rank holds the same flat
        layout (``same_layout``), else a canonical copy
        (:meth:`.distributed.DataParallel.reduction_sums`), so the collectives match."""
        target = self.reducer.reduction_sums(sums, self.params, same_layout)
        if self.reducer.adds_noise:
            self.add_noise(target)
        self.reducer.all_reduce_(target.buffers)
        return target

    def scale_grad(self, sums: GradSums) -> List[torch.Tensor]:
        """``sums / B_expected`` per parameter, each a tensor of its own in the parameter's
        dtype (one multi-tensor division out of the flat buffers)."""
        grads = sums.own_grads(float(self.noise.expected_batch_size))
        return [cast(g, p.dtype) for p, g in zip(self.params, grads)]

    def noisy_gradients(self, loss) -> Tuple[List[torch.Tensor], int, BatchRecord]:
        """``((Σ_{logical batch} C_i g_i + σR·ξ) / B_expected per parameter, samples)``, with this
        physical batch's clipped sum included, ``samples`` the logical batch's count, and this
        batch's :class:`BatchRecord`. Built in place in this batch's fresh sums, so the running sums
        and the state stay untouched until the step succeeds; ``pre_release`` sees the count before
        the noise is drawn.
        Data-parallel: :meth:`_distributed_noisy_gradients`."""
        if self.reducer is not None:
            return self._distributed_noisy_gradients(loss)
        batch = self.clip(loss)  # validates and clips; raises before anything changes
        samples = self.samples + batch.size
        if self.pre_release is not None:
            self.pre_release(samples)
        sums = batch.sums
        if self.grad_sums is not None:
            sums.add_(self.grad_sums)
        self.add_noise(sums)
        return self.scale_grad(sums), samples, _record(batch)

    def _distributed_noisy_gradients(self, loss
                                     ) -> Tuple[List[torch.Tensor], int, BatchRecord]:
        """:meth:`noisy_gradients` over the ranks: clip the local batch, add the local running
        sums, exchange the counts (the global count ``Σ_r samples_r`` goes to ``pre_release``;
        a rank whose clipping raised makes every rank raise), then :meth:`reduce_sums` and the
        division by the global expected batch size B. On an FSDP2 model
        (:class:`.sharded.ShardedDataParallel`) the sums are reduce-scattered instead, each rank
        noises the rows it owns and the gradients are the parameters' ``DTensor`` shards."""
        try:
            batch = self.clip(loss)
        except Exception:
            self.reducer.exchange(0, 0, failed=True)  # the other ranks raise instead of waiting
            raise
        sums = batch.sums
        if self.grad_sums is not None:
            sums.add_(self.grad_sums)
        counts = self.reducer.exchange(self.samples + batch.size,
                                       self.reducer.layout_code(sums, self.params))
        if counts.failed:
            raise RuntimeError(
                f"rank(s) {counts.failed} could not clip their batch (see their error): this "
                "data-parallel step is refused on every rank; nothing was updated.")
        if self.pre_release is not None:
            self.pre_release(counts.samples)
        if getattr(self.reducer, "sharded", False):  # FSDP2: reduce-scatter, noise per shard
            std = self.noise.noise_multiplier * self.max_grad_norm()
            grads = self.reducer.release(sums, self.params, std, self.noise.expected_batch_size,
                                         self.noise.generator, self.noise.secure_mode)
            return grads, counts.samples, _record(batch)
        return (self.scale_grad(self.reduce_sums(sums, counts.same_layout)), counts.samples,
                _record(batch))

    def step(self, loss):
        """Clip ``loss`` (per-sample), add noise once, average, and update the parameters with
        the wrapped optimizer; then the step hook. A parameter frozen since the engine was built
        (``requires_grad=False``) is left alone: its gradient is not formed by the norm pass, its
        share of the noisy sum is not released and its ``.grad`` is None for the step."""
        self.check_params()  # every parameter it updates must be clipped
        if self.pre_step is not None:
            self.pre_step()
        noisy, samples, last = self.noisy_gradients(loss)  # state untouched on error
        # a frozen parameter gets no gradient (a stale .grad would move it again)
        released = [(p, g if p.requires_grad else None) for p, g in zip(self.params, noisy)]
        saved = [p.grad for p in self.params]
        for p, g in released:
            p.grad = g
        try:
            result = self.original_step()
        except Exception:
            for p, g in zip(self.params, saved):
                p.grad = g
            raise
        records = self.records + [last]
        self.reset()  # the accumulation is spent, whatever the hooks do
        if self.step_hook is not None:
            self.step_hook(samples)
        if self.post_step is not None:
            self.post_step()
        if self.on_step is not None:
            self.on_step(records)
        return result

    def reset(self) -> None:
        self.grad_sums = None
        self.samples = 0
        self.records = []


def _record(batch: ClippedBatch) -> BatchRecord:
    """What the step's metrics keep of a clipped physical batch (no gradient sums)."""
    return BatchRecord(batch.norms, batch.loss, batch.dropped, batch.size)


def attach(state: PrivateStep) -> PrivateStep:
    """Replace ``state.optimizer.step`` by the private step and add ``virtual_step``."""

    def virtual_step(loss=None):
        """Clip the per-sample ``loss`` of this physical batch and accumulate (gradient
        accumulation)."""
        if not state.attached:
            raise RuntimeError(_DETACHED)
        if loss is None:
            raise ValueError("virtual_step needs loss=<per-sample losses, shape (B,)>.")
        state.clip_and_accumulate(loss)

    def step(loss=None, closure=None):
        """Clip ``loss`` (per-sample), add noise once, average, and update the parameters."""
        if not state.attached:
            raise RuntimeError(_DETACHED)
        if closure is not None:
            raise ValueError("closures are not supported by private steps; pass "
                             "loss=<per-sample losses>.")
        if loss is None:
            raise ValueError(
                "optimizer.step() needs loss=<per-sample losses, shape (B,)> (reduction='none'): "
                "the engine clips each sample's gradient from it. Use "
                "optimizer.virtual_step(loss=...) to accumulate."
            )
        return state.step(loss)

    state.optimizer.step = step
    state.optimizer.virtual_step = virtual_step
    return state


_DETACHED = ("the privacy engine was detached from this optimizer; call engine.attach(optimizer) "
             "again.")


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
    def __init__(self, params, *args, privacy_engine, **kwargs):
        base.__init__(self, params, *args, **kwargs)
        privacy_engine.attach(self)

    doc = (
        f"{base.__name__} on the private gradient ĝ = (Σ_i C_i g_i + N(0, σ²R²I)) / B "
        "(Abadi et al. 2016); "
        f"{formula}\n\nConstruct with the same arguments as ``torch.optim.{base.__name__}`` plus "
        "``privacy_engine=``; then call ``step(loss=per_sample_losses)`` / "
        "``virtual_step(loss=...)``."
    )
    return type("DP" + base.__name__, (base,), {"__init__": __init__, "__doc__": doc})


DPSGD = _dp_optimizer(torch.optim.SGD, "update θ ← θ − η·ĝ (with the SGD options given).")
DPAdam = _dp_optimizer(torch.optim.Adam, "Adam moments m, v of ĝ; θ ← θ − η·m̂/(√v̂ + ε).")
DPAdamW = _dp_optimizer(torch.optim.AdamW, "Adam on ĝ with decoupled weight decay θ ← θ − ηλθ.")

__all__ = [
    "DPSGD",
    "DPAdam",
    "DPAdamW",
    "NoiseSpec",
    "PrivateStep",
    "add_gaussian_noise",
    "attach",
    "detach",
]
