"""One assembly of the clipping core for both doors (the native engine and the Opacus door).

The core of one model is: the capture of its ruled layers (the layer recorder, with the
parameter-entry tracer and the ``torch.func`` fallback modules when the rules do not cover every
parameter), the layer-ready route the recorder hands each finished layer to, the
:class:`~private_engine.clipping.clipper.PerSampleClipper`, and the guards of a step: the buffer
guard, the separability probe, the batch flow, the secret randomness of training forwards and the
step state guard. :func:`assemble_clipping_core` builds and installs them in one order; what the
doors do differently is an explicit option:

* who runs the separability probe and the batch flow: the clipper (at the norm pass on the
  per-sample losses; the native engine) or the door (from the forward's outputs and at the start
  of its backward; the Opacus door);
* how the model's inputs hold the batch: batch-first, or only the recorded layers know (Opacus'
  ``batch_first=False``: the probe compares each float argument along dim 0 or 1, and the layers
  open the batch flow's region, each with its own batch dimension);
* where finished layers go: the clipper's norm pass, or the door's own flow (connected once).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..capture.fallback import FallbackModule
from ..capture.recorder import LayerRecorder, RecordedLayer
from ..capture.setup import LayerHandler, LayerRoute, build_capture
from ..capture.tracer import ParamTracer
from ..foundation.randomness import SecretModelRandomness
from ..guards.batch_flow import BatchFlow
from ..guards.buffers import BufferGuard
from ..guards.separability import SeparabilityProbe
from ..guards.state import StepStateGuard
from ..layers.ruled import RuledLayer
from .clipper import PerSampleClipper
from .functions import ClipFn
from .plan import DEFAULT_CLIPPING_MODE


@dataclass
class ClippingCore:
    """The clipping core of one model and the guards of its steps (:func:`assemble_clipping_core`).

    Attributes:
        recorder: the layer recorder (its ``on_layer_ready`` is ``route``).
        route: where finished layers go (:class:`private_engine.capture.setup.LayerRoute`).
        clipper: certified per-sample norms, clip factors and clipped sums.
        tracer / fallbacks: the parameter-entry tracer (None when the rules cover every
            parameter) and the ``torch.func`` fallback modules.
        buffer_guard: refuses a training forward that changes a buffer from the data.
        probe: checks that the model is sample-separable at the first step of each input
            signature.
        batch_flow: follows the batch through every op of each step's forward and loss.
        model_randomness: the randomness of training forwards (dropout) from a secret generator.
        state_guard: refuses a step during which a parameter or buffer changed outside the
            optimizer.
        clipper_runs_checks: whether the clipper runs ``probe`` and ``batch_flow`` (it holds
            them) or the door does.
    """

    recorder: LayerRecorder
    route: LayerRoute
    clipper: PerSampleClipper
    tracer: Optional[ParamTracer]
    fallbacks: List[FallbackModule]
    buffer_guard: BufferGuard
    probe: SeparabilityProbe
    batch_flow: BatchFlow
    model_randomness: SecretModelRandomness
    state_guard: StepStateGuard
    clipper_runs_checks: bool = True

    def install(self) -> None:
        """(Re-)install every hook, in the assembly's order."""
        self.buffer_guard.install()
        self.clipper.install()
        self.probe.install()
        self.batch_flow.install()
        self.model_randomness.install()
        self.state_guard.install()

    def remove(self) -> None:
        """Remove every hook: the model runs as before the assembly."""
        self.clipper.remove()
        if not self.clipper_runs_checks:
            self.probe.remove()
            self.batch_flow.remove()
        self.buffer_guard.remove()
        self.state_guard.remove()
        self.model_randomness.remove()


def assemble_clipping_core(
        model: nn.Module, layers: Sequence[RuledLayer], params: Sequence[nn.Parameter], *,
        traced: Sequence[Tuple[str, nn.Parameter]] = (),
        fallbacks: Sequence[Tuple[str, nn.Module]] = (),
        mode: str = DEFAULT_CLIPPING_MODE, clipping_fn: Union[str, ClipFn] = "abadi",
        max_grad_norm: float = 1.0,
        clipper_runs_checks: bool = True,
        layer_batch_dim: Optional[Callable[[RecordedLayer], int]] = None,
        on_layer_ready: Optional[LayerHandler] = None,
        data_free_buffers: Sequence[str] = (),
        compare_identity: bool = True,
        randomness_generator: Optional[torch.Generator] = None) -> ClippingCore:
    """Build and install the clipping core of ``model`` and the guards of its steps; when a piece
    refuses (a bad argument, a model it cannot follow), the hooks already installed are removed
    before the error propagates.

    The hooks go on in this order: buffer guard, capture (recorder, tracer, fallbacks),
    separability probe, batch flow, secret randomness, step state guard (each guard's forward
    pre-hooks are prepended, so they run in the reverse order).

    Args:
        model: the model whose forwards are followed.
        layers: ``[(name, module, rule)]`` covering the ruled parameters
            (:func:`private_engine.guards.model_check.clipped_layers`).
        params: every parameter whose clipped sum is formed (in this order).
        traced / fallbacks: parameters clipped by the parameter-entry tracer and modules clipped
            by ``torch.func`` (:func:`private_engine.guards.model_check.scan_model`).
        mode / clipping_fn / max_grad_norm: the clipper's (:class:`PerSampleClipper`).
        clipper_runs_checks: True: the clipper runs the probe on the per-sample losses at its
            norm pass and the batch flow on the loss (``clipper.probe``, ``clipper.batch_flow``).
            False: the door runs them (the clipper holds neither).
        layer_batch_dim: None: the model's inputs are batch-first. Else the batch dimension of
            each recorded layer's tensors, when only the layers know it (the probe then compares
            each float argument along dim 0 or 1, and only the recorded layers open a step's
            batch-flow region, each with its own batch dimension).
        on_layer_ready: where finished layers go outside a diversion; None: the clipper's
            :meth:`PerSampleClipper.on_layer_ready`.
        data_free_buffers: buffer name patterns the forward may write
            (:class:`private_engine.guards.buffers.BufferGuard`, and the state guard).
        compare_identity: whether the state guard also refuses a parameter or buffer replaced by
            another tensor (False for FSDP2, which swaps them within a step).
        randomness_generator: the generator the secret randomness of training forwards is drawn
            from (None: one seeded from OS entropy).
    """
    installed: list = []  # removed again if a later piece refuses the model or an argument
    try:
        buffer_guard = BufferGuard(model, allow=data_free_buffers).install()
        installed.append(buffer_guard)
        route = LayerRoute()
        recorder = build_capture(layers, model, traced, fallbacks, on_layer_ready=route)
        installed.append(recorder)
        probe = SeparabilityProbe(model, batch_dim=0 if layer_batch_dim is None else None)
        probe.install()
        installed.append(probe)
        openers = None if layer_batch_dim is None else {
            layer.module: layer_batch_dim(layer) for layer in recorder.layers}
        batch_flow = BatchFlow(model, openers=openers).install()
        installed.append(batch_flow)
        recorder.batch_flow = batch_flow
        clipper = PerSampleClipper(layers, params, mode=mode, clipping_fn=clipping_fn,
                                   max_grad_norm=max_grad_norm, recorder=recorder, route=route,
                                   probe=probe if clipper_runs_checks else None,
                                   batch_flow=batch_flow if clipper_runs_checks else None)
        route.connect(on_layer_ready if on_layer_ready is not None else
                      lambda layer: clipper.on_layer_ready(layer))
        model_randomness = SecretModelRandomness(model, generator=randomness_generator).install()
        installed.append(model_randomness)
        state_guard = StepStateGuard(model, allow=data_free_buffers,
                                     compare_identity=compare_identity).install()
        installed.append(state_guard)
    except BaseException:
        for piece in reversed(installed):
            piece.remove()
        raise
    return ClippingCore(recorder=recorder, route=route, clipper=clipper, tracer=clipper.tracer,
                        fallbacks=clipper.fallbacks, buffer_guard=buffer_guard, probe=probe,
                        batch_flow=batch_flow, model_randomness=model_randomness,
                        state_guard=state_guard, clipper_runs_checks=clipper_runs_checks)
