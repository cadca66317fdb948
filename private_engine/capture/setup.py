"""Assembly of the capture stage for one model: the layer recorder, and — when some parameters
are used outside a ruled layer or some modules need ``torch.func`` — the parameter-entry tracer
and the fallback modules, wired to the recorder."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

from torch import nn

from ..layers.ruled import RuledLayer
from .fallback import FallbackModule, warn_fallback
from .recorder import LayerRecorder, RecordedLayer
from .tracer import ParamTracer


def build_capture(layers: Sequence[RuledLayer],
                  model: Optional[nn.Module] = None,
                  traced: Sequence[Tuple[str, nn.Parameter]] = (),
                  fallbacks: Sequence[Tuple[str, nn.Module]] = (),
                  on_layer_ready: Optional[Callable[[RecordedLayer], None]] = None
                  ) -> LayerRecorder:
    """A :class:`LayerRecorder` on ``layers``; with traced parameters or fallback modules, its
    ``tracer`` (:class:`ParamTracer`, which also tells the fallbacks the batch size and which
    inputs are batched) and the :class:`FallbackModule` s among its ``extras``. Each module on
    the fallback path is named in one warning."""
    recorder = LayerRecorder(layers, on_layer_ready=on_layer_ready)
    if model is None or not (traced or fallbacks):
        return recorder
    tracer = ParamTracer(model, traced, opaque=[m for _, m in fallbacks])
    tracer.attach(recorder)
    recorder.tracer = tracer
    recorder.extras = [tracer, *(FallbackModule(n, m, tracer) for n, m in fallbacks)]
    warn_fallback([f"{n or '(the model)'} ({type(m).__name__})" for n, m in fallbacks])
    return recorder
