"""Privatising torch optimizers: accumulation of clipped sums, Gaussian noise, scaling, step.

After ``k`` virtual steps and one step over physical batches B_1..B_{k+1} (a logical batch), the
parameters are updated by the wrapped optimizer with

    ĝ = ( Σ_{i ∈ B_1 ∪ … ∪ B_{k+1}} C_i·g_i  +  N(0, σ²R²·I) ) / B_expected,

noise drawn once per logical batch (Abadi et al. 2016, "Deep Learning with Differential Privacy";
Bu, Mao & Xu 2022, Appendix E). ``B_expected`` is the declared (expected) logical batch size.
DP-SGD, DP-Adam and DP-AdamW are the torch optimizers with this gradient.

The data path is one function, :func:`release_gradient` (noise, reduction over the ranks and
scaling, by the step's :class:`.topology.Topology`), in the spirit of torch.optim's functional
``sgd()``; :class:`PrivateStep` is the thin stateful part: the sums accumulated by
``virtual_step``, the clipping of each physical batch (:meth:`PrivateStep.clip_and_accumulate`),
the accounting object asked before and after each release (:class:`StepAccounting`), the wrapped
optimizer's own step, and hooks registered with removable handles
(:meth:`PrivateStep.register_step_post_hook`).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..clipping.batch import ClippedBatch
from ..clipping.grad_sums import GradSums
from .noise import NoiseSpec, add_gaussian_noise
from .topology import SingleProcess, Topology


@dataclass(frozen=True)
class BatchRecord:
    """What a physical batch leaves for the step's metrics: its certified norms (dropped samples
    at 0), its per-sample losses (detached), its dropped count and size."""

    norms: Optional[torch.Tensor]
    loss: Optional[torch.Tensor]
    dropped: int
    size: int


class BatchClipping(Protocol):
    """What a private step asks of the clipping side (the engine)."""

    max_grad_norm: float

    def clip_batch(self, loss: torch.Tensor) -> ClippedBatch:
        """Clip one physical batch of per-sample losses."""

    def parameter_names(self) -> Dict[int, str]:
        """``{id(param): name}`` of the model as it is now, for messages."""


class StepAccounting(Protocol):
    """What a private step asks of the accounting side
    (:class:`private_engine.accounting.StepAccountant`)."""

    def check_step(self) -> None:
        """Before anything else in a step (the budget guard); raising refuses the step."""

    def check_release(self, samples: int) -> None:
        """Once the logical batch of ``samples`` samples is clipped, before the noise (the
        sampling-rate check, the ledger line); raising refuses the step, nothing changed."""

    def commit(self, samples: int) -> None:
        """After the update: the release is accounted."""

    def report(self, records: List[BatchRecord], max_grad_norm: float) -> None:
        """After the step and its hooks: the step's metrics."""


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


def release_gradient(sums: GradSums, params: Sequence[nn.Parameter], noise: NoiseSpec,
                     max_grad_norm: float, topology: Topology,
                     same_layout: bool = True) -> List[torch.Tensor]:
    """The private gradient of a logical batch from this rank's clipped sums
    ``s_r = Σ_{i ∈ S_r} C_i g_i``:

        ĝ = (Σ_r s_r + σR·ξ) / B,    ξ ~ N(0, I), drawn once over the ranks,

    one tensor per parameter of ``params`` (σ, B and the generator from ``noise``, R =
    ``max_grad_norm``). The topology adds the noise (one process: locally; replicas: on rank 0
    before the all-reduce; FSDP2 shards: each rank on the rows it owns) and divides by B
    (:meth:`.topology.Topology.release`). ``sums`` is consumed. ``same_layout``: every rank holds
    its sums in the same flat layout (:meth:`.topology.Topology.exchange`)."""
    std = noise.noise_multiplier * max_grad_norm
    return topology.release(sums, params, std, noise, same_layout)


class _NoAccounting:
    """Accounting of a step that nothing accounts (a bare :class:`PrivateStep`)."""

    def check_step(self) -> None:
        pass

    def check_release(self, samples: int) -> None:
        pass

    def commit(self, samples: int) -> None:
        pass

    def report(self, records: List[BatchRecord], max_grad_norm: float) -> None:
        pass


class PrivateStep:
    """A privatised optimizer's state and stages: the clipped-gradient sums of the current logical
    batch, the release (:func:`release_gradient`) and the step.

    Args:
        optimizer: the torch optimizer whose ``step`` is replaced.
        params: the clipped parameters, in the order of the clipped sums (FSDP2: the ``DTensor``
            shards the optimizer updates).
        clipping: clips each physical batch and holds the current R (:class:`BatchClipping`).
        noise: σ, the expected batch size, the generator.
        topology: where the step runs (:mod:`.topology`): the sample counts the accounting sees
            and the released sums are the ranks' totals.
        accounting: asked before and after each release (:class:`StepAccounting`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter],
                 clipping: BatchClipping, noise: NoiseSpec, topology: Optional[Topology] = None,
                 accounting: Optional[StepAccounting] = None):
        self.optimizer = optimizer
        self.params = list(params)
        self._param_ids = frozenset(id(p) for p in self.params)
        self.clipping = clipping
        self.noise = noise
        self.topology = topology if topology is not None else SingleProcess()
        self.accounting = accounting if accounting is not None else _NoAccounting()
        self._post_hooks: Dict[int, Callable[["PrivateStep", int], None]] = OrderedDict()
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

    def register_step_post_hook(self, hook: Callable[["PrivateStep", int], None]
                                ) -> RemovableHandle:
        """Call ``hook(step, samples)`` after every step that succeeded and was accounted, before
        the topology's check and the step's metrics; ``handle.remove()`` removes it."""
        handle = RemovableHandle(self._post_hooks)
        self._post_hooks[handle.id] = hook
        return handle

    # -- stages ------------------------------------------------------------------------------
    def check_params(self) -> None:
        """:func:`check_clipped_params` for this optimizer."""
        check_clipped_params(self.optimizer, self._param_ids, self.clipping.parameter_names)

    def clip_and_accumulate(self, loss) -> None:
        """Clip this physical batch and add ``Σ_i C_i g_i`` to the running sums (no parameter
        change)."""
        batch = self.clipping.clip_batch(loss)
        if self.grad_sums is None:
            self.grad_sums = batch.sums
        else:
            self.grad_sums.add_(batch.sums)
        self.samples += batch.size
        self.records.append(_record(batch))

    def noisy_gradients(self, loss) -> Tuple[List[torch.Tensor], int, BatchRecord]:
        """``((Σ_{logical batch} C_i g_i + σR·ξ) / B_expected per parameter, samples)``, with this
        physical batch's clipped sum included, ``samples`` the logical batch's count over the
        ranks, and this batch's :class:`~private_engine.step_metrics.BatchRecord`. Built in
        place in this batch's fresh sums, so the running sums and the state stay untouched until
        the step succeeds; the accounting sees the count before the noise is drawn. Over ranks,
        a rank whose clipping raised makes every rank raise."""
        try:
            batch = self.clipping.clip_batch(loss)  # validates and clips; raises before changes
        except Exception:
            self.topology.clip_failed()
            raise
        sums = batch.sums
        if self.grad_sums is not None:
            sums.add_(self.grad_sums)
        counts = self.topology.exchange(self.samples + batch.size, sums, self.params)
        if counts.failed:
            raise RuntimeError(
                f"rank(s) {counts.failed} could not clip their batch (see their error): this "
                "data-parallel step is refused on every rank; nothing was updated.")
        self.accounting.check_release(counts.samples)
        grads = release_gradient(sums, self.params, self.noise, self.clipping.max_grad_norm,
                                 self.topology, counts.same_layout)
        return grads, counts.samples, _record(batch)

    def step(self, loss):
        """Clip ``loss`` (per-sample), add noise once, average, and update the parameters with
        the wrapped optimizer; then the accounting, the hooks, the topology's check and the
        step's metrics. A parameter frozen since the engine was built (``requires_grad=False``)
        is left alone: its gradient is not formed by the norm pass, its share of the noisy sum
        is not released and its ``.grad`` is None for the step."""
        self.check_params()  # every parameter it updates must be clipped
        self.accounting.check_step()
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
        self.accounting.commit(samples)
        for hook in list(self._post_hooks.values()):
            hook(self, samples)
        self.topology.after_step(self.params)
        self.accounting.report(records, self.clipping.max_grad_norm)
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
    "BatchClipping",
    "DPSGD",
    "DPAdam",
    "DPAdamW",
    "NoiseSpec",
    "PrivateStep",
    "StepAccounting",
    "add_gaussian_noise",
    "attach",
    "check_clipped_params",
    "detach",
    "release_gradient",
]
