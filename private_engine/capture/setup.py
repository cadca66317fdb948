"""Assembly of the capture stage for one model: the layer recorder, and — when some parameters
are used outside a ruled layer or some modules need ``torch.func`` — the parameter-entry tracer
and the fallback modules, wired to the recorder; and :class:`LayerRoute`, the one handler of the
recorder's layer-ready slot."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence, Tuple

from torch import nn

from ..layers.ruled import RuledLayer
from .fallback import FallbackModule, warn_fallback
from .recorder import LayerRecorder, RecordedLayer
from .tracer import ParamTracer

#: what receives a recorded layer once all its calls have their output gradient
LayerHandler = Callable[[RecordedLayer], None]


class LayerRoute:
    """Where the recorder sends each layer whose output gradients have all arrived.

    It is the recorder's ``on_layer_ready``, set once when the clipping core is assembled
    (:func:`private_engine.clipping.assembly.assemble_clipping_core`); nothing else writes that
    slot. Its handler is connected once (:meth:`connect`: the clipper's norm pass, or the door's
    own flow); a pass that must see the layers differently (the second backward of the two-pass
    modes, the Opacus door's criterion flow) diverts them for its duration only
    (:meth:`diverted`), and the route goes back to its handler however that pass ends.
    """

    def __init__(self) -> None:
        self._handler: Optional[LayerHandler] = None
        self._connected = False

    def connect(self, handler: LayerHandler) -> None:
        """Set the handler the layers go to outside a diversion (once)."""
        if self._connected:
            raise RuntimeError("internal error: the layer route is already connected.")
        self._handler = handler
        self._connected = True

    @property
    def handler(self) -> Optional[LayerHandler]:
        """Where a layer goes now (the connected handler, or a diversion's)."""
        return self._handler

    @contextlib.contextmanager
    def diverted(self, handler: LayerHandler) -> Iterator[None]:
        """Send the layers to ``handler`` inside the ``with`` block, to the previous handler
        after it."""
        saved, self._handler = self._handler, handler
        try:
            yield
        finally:
            self._handler = saved

    def __call__(self, layer: RecordedLayer) -> None:
        if self._handler is None:
            raise RuntimeError("internal error: a layer was recorded before the clipping core "
                               "was connected to the recorder.")
        self._handler(layer)


def build_capture(layers: Sequence[RuledLayer],
                  model: Optional[nn.Module] = None,
                  traced: Sequence[Tuple[str, nn.Parameter]] = (),
                  fallbacks: Sequence[Tuple[str, nn.Module]] = (),
                  on_layer_ready: Optional[LayerHandler] = None) -> LayerRecorder:
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
