"""What each private step did, for monitoring: ε so far, the batch's loss, its clip fraction and
its dropped samples, sent to TensorBoard, to any callable, or to :mod:`logging`.

::

    from torch.utils.tensorboard import SummaryWriter
    engine.add_step_logger(SummaryWriter("runs/dp"))      # or any callable(StepMetrics)

After every logical step the engine records one :class:`StepMetrics`:

* ``epsilon``: ε spent so far at the engine's δ. With the RDP accountant (the default) it is
  exact at every step and cheap: the RDP curve of one step of a (σ, q) Gaussian mechanism is
  computed once and scaled by the step count (RDP composes additively; Mironov 2017, "Rényi
  Differential Privacy", Prop. 1), then converted to (ε, δ) as the accountant does. Other
  accountants cost tens to hundreds of milliseconds per call, so ε is computed every
  ``epsilon_every`` steps (and None in between).
* ``loss``: the mean of the logical batch's finite per-sample losses;
* ``clip_fraction``: the fraction of the logical batch's samples whose certified gradient norm
  exceeded R (``‖g_i‖ > R``, so ``C_i < 1`` with Abadi clipping);
* ``dropped_samples``: samples dropped (``C_i = 0``) because their loss or gradient norm was not
  finite;
* ``samples``: the size of the logical batch.

The loss, the clip fraction, the dropped samples and the batch size are NOT private: they are
exact statistics of the private batch, outside the DP guarantee of the noisy update (Opacus and
TensorFlow Privacy warn alike). Log them for debugging; do not publish them. Under data-parallel
training they are each rank's own (ε is the run's).
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

import torch

if TYPE_CHECKING:
    from .optim.private_step import BatchRecord

log = logging.getLogger(__name__)

#: a per-step sink: a ``SummaryWriter`` (anything with ``add_scalar``) or ``callable(StepMetrics)``
StepLogger = Any


@dataclass(frozen=True)
class StepMetrics:
    """One logical step: see the module docstring for each field (loss, clip fraction, dropped
    samples and samples are non-private statistics of the batch)."""

    step: int
    epsilon: Optional[float]
    delta: float
    loss: Optional[float]
    clip_fraction: Optional[float]
    dropped_samples: int
    samples: int

    def as_dict(self) -> Dict[str, Any]:
        """The fields as a dict (e.g. for ``wandb.log(m.as_dict(), step=m.step)``)."""
        return asdict(self)


class EpsilonTracker:
    """ε after each step at ``delta``, cheap enough for every step.

    The engine's RDP accountant: ``ε = conv(Σ_(σ,q,n) n·ρ_{σ,q}(α), δ)`` with ``ρ_{σ,q}`` the RDP
    of one step (Mironov, Talwar & Zhang 2019, "Rényi Differential Privacy of the Sampled Gaussian
    Mechanism"), which the accountant keeps per ``(σ, q)``: its ``get_epsilon`` at every step. Any
    other accountant: its ``get_epsilon`` every ``every`` steps (and at the first), None at the
    others.
    """

    def __init__(self, accountant: Callable[[], Any], delta: float, every: int = 10):
        self.accountant = accountant
        self.delta = float(delta)
        self.every = every

    def __call__(self, step: int) -> Optional[float]:
        """ε after step ``step`` (1-based) at :attr:`delta`, or None at a step it is not
        computed."""
        accountant = self.accountant()
        eps = self.exact(self.delta)
        if eps is not None:
            return eps
        if not accountant.history:
            return 0.0
        if step == 1 or step % self.every == 0:
            return float(accountant.get_epsilon(delta=self.delta))
        return None

    def exact(self, delta: float) -> Optional[float]:
        """ε at ``delta`` when the accountant is the engine's RDP accountant (cheap at every step:
        it keeps each one-step RDP curve, :class:`private_engine.accounting.opacus_bridge.
        RDPAccountant`), else None."""
        from .accounting.opacus_bridge import RDPAccountant

        accountant = self.accountant()
        if not isinstance(accountant, RDPAccountant):
            return None
        return float(accountant.get_epsilon(delta=delta))


class StepMetricsRecorder:
    """The engine's step metrics: the sinks, the ε tracker, and the metrics of a finished step.

    ``record(step, records, R)`` is called once per logical step, after the update and the
    accounting, with the :class:`~private_engine.optim.private_step.BatchRecord` of each of its
    physical batches; with no sink attached (and ``logging`` below DEBUG for this module) it does
    nothing, so a run that logs nothing pays nothing (no host synchronisation).
    """

    def __init__(self, epsilon: EpsilonTracker):
        self.epsilon = epsilon
        self.sinks: List[Callable[[StepMetrics], None]] = []

    def add(self, sink: StepLogger) -> Callable[[StepMetrics], None]:
        """Add a sink: an object with ``add_scalar(tag, value, step)`` (TensorBoard's
        ``SummaryWriter``) gets the scalars ``privacy/epsilon``, ``train/loss``,
        ``train/clip_fraction``, ``train/dropped_samples`` and ``train/samples``; any other
        callable is called with the :class:`StepMetrics`. Returns the callable registered (for
        :meth:`remove`)."""
        if hasattr(sink, "add_scalar"):
            fn = TensorBoardSink(sink)
        elif callable(sink):
            fn = sink
        else:
            raise TypeError(
                "a step logger must be a TensorBoard SummaryWriter (anything with add_scalar) "
                f"or a callable taking StepMetrics, got {type(sink).__name__}.")
        self.sinks.append(fn)
        return fn

    def remove(self, fn: Callable[[StepMetrics], None]) -> None:
        """Remove a sink returned by :meth:`add`."""
        self.sinks.remove(fn)

    @property
    def active(self) -> bool:
        """Whether a step's metrics are wanted (a sink, or DEBUG logging of this module)."""
        return bool(self.sinks) or log.isEnabledFor(logging.DEBUG)

    def record(self, step: int, records: Sequence[BatchRecord],
               max_grad_norm: float) -> Optional[StepMetrics]:
        """The :class:`StepMetrics` of logical step ``step`` (1-based), sent to every sink and
        logged at DEBUG; None (nothing computed) when :attr:`active` is false."""
        if not self.active:
            return None
        metrics = summarise(step, records, max_grad_norm, self.epsilon(step),
                            self.epsilon.delta)
        log.debug("step %d: ε=%s at δ=%.3g, loss=%s, clip fraction=%s, dropped=%d, samples=%d",
                  metrics.step, _fmt(metrics.epsilon), metrics.delta, _fmt(metrics.loss),
                  _fmt(metrics.clip_fraction), metrics.dropped_samples, metrics.samples)
        for sink in list(self.sinks):
            sink(metrics)
        return metrics


def summarise(step: int, records: Sequence[BatchRecord], max_grad_norm: float,
              epsilon: Optional[float], delta: float) -> StepMetrics:
    """The step's metrics from its physical batches: ``loss = Σ_finite L_i / #finite``,
    ``clip_fraction = #{i: ‖g_i‖ > R} / B`` over the logical batch (one host synchronisation)."""
    samples = sum(r.size for r in records)
    dropped = sum(r.dropped for r in records)
    parts = []
    for r in records:
        if r.size == 0 or r.norms is None:
            continue
        finite = torch.isfinite(r.loss)
        parts.append(torch.stack([
            (r.norms > max_grad_norm).sum().to(torch.float64),
            torch.where(finite, r.loss, torch.zeros_like(r.loss)).sum().to(torch.float64),
            finite.sum().to(torch.float64)]).cpu())
    if not parts:
        return StepMetrics(step, epsilon, delta, None, None, dropped, samples)
    clipped, loss_sum, finite = torch.stack(parts).sum(0).tolist()
    return StepMetrics(step, epsilon, delta, loss_sum / finite if finite else None,
                       clipped / samples, dropped, samples)


class TensorBoardSink:
    """Writes a :class:`StepMetrics` as scalars of a TensorBoard ``SummaryWriter`` at
    ``global_step = step`` (a field that is None is skipped)."""

    TAGS = {"epsilon": "privacy/epsilon", "loss": "train/loss",
            "clip_fraction": "train/clip_fraction", "dropped_samples": "train/dropped_samples",
            "samples": "train/samples"}

    def __init__(self, writer):
        self.writer = writer

    def __call__(self, metrics: StepMetrics) -> None:
        values = metrics.as_dict()
        for field, tag in self.TAGS.items():
            if values[field] is not None:
                self.writer.add_scalar(tag, values[field], metrics.step)


def _fmt(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.4g}"


__all__ = ["EpsilonTracker", "StepMetrics", "StepMetricsRecorder", "TensorBoardSink", "summarise"]
