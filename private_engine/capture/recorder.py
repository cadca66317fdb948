"""The layer recorder: each clipped layer's calls — input activations and output gradients — and
the hooks and queries around these records.

A forward hook on every clipped module keeps, for **each call**, the (detached) input
activation and the layer dimensions; a tensor hook on the call's output catches the gradient
of the loss w.r.t. that output during the engine's norm pass. The tensor hook sits on the
output's *root* (its base when the output is a reshaped view, as ``F.linear`` returns for 3-D
inputs), so subsequent in-place ops on the output (``ReLU(inplace=True)``) do not hide the
gradient: hooks registered before an in-place op receive the gradient of the value before it.

When all calls of a layer have their gradient, ``on_layer_ready(layer)`` is called (the engine's
callback, which uses the calls and then releases the layer's recorded tensors). A call on a
batch-free constant is handed to the parameter-entry tracer (:mod:`.tracer`), which follows its
parameters instead. The recorder also installs, resets and removes the other capture hooks
(``extras``: the tracer and the fallback modules) together with its own, re-arms its calls for a
second backward, and walks the loss's autograd graph over its calls (:mod:`.graph_walk`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from ..layers import LayerDims, LayerRule
from ..layers.ruled import RuledLayer
from .graph_walk import GraphWalk, walk_graph

if TYPE_CHECKING:
    from ..guards.batch_flow import BatchFlow
    from .tracer import ParamTracer


@dataclass
class RecordedCall:
    """One forward call of a clipped layer."""

    activation: Optional[torch.Tensor]
    output_shape: torch.Size
    dims: LayerDims
    edge: object  # autograd GradientEdge of the output's root
    input_requires_grad: bool
    input_node: object = None  # autograd node of the input (None when it needs no gradient)
    grad: Optional[torch.Tensor] = None
    fired: bool = False
    #: the tracer's view of the input: True when its rows are sample-major in dim 0 (needed for k·B
    #: rows)
    rows_ok: Optional[bool] = None
    #: the tracer's batch dimension of the input (-1: unknown; None: not known to the tracer)
    batch_dim: Optional[int] = None


@dataclass
class RecordedLayer:
    """A clipped module and its calls in the current forward pass(es)."""

    name: str
    module: nn.Module
    rule: LayerRule
    calls: List[RecordedCall] = field(default_factory=list)
    #: ``{(input shape, output shape): LayerDims}``: a call's dimensions depend on shapes only
    dims_cache: Dict[tuple, LayerDims] = field(default_factory=dict)

    def rows_ok(self) -> bool:
        """True when every fired call's input is known to be sample-major (k·B rows may be
        grouped)."""
        return all(c.rows_ok is True for c in self.calls if c.fired and c.grad is not None)

    def batch_moved(self) -> bool:
        """True when a fired call's input is known to have its batch dimension elsewhere than
        dim 0."""
        return any(c.batch_dim is not None and c.batch_dim > 0
                   for c in self.calls if c.fired and c.grad is not None)

    def pairs(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``[(activation, output_grad)]`` of the calls whose gradient reached the layer."""
        # a call's activation is cleared with its gradient: one holding a gradient has both
        return [(c.activation, c.grad)  # type: ignore[misc]
                for c in self.calls if c.fired and c.grad is not None]

    def clear_grads(self) -> None:
        """Forget the calls' output gradients but keep the calls (activations, edges) for a second
        backward through the same graph (two-pass clipping; :meth:`LayerRecorder.rearm`)."""
        for c in self.calls:
            c.grad = None

    def release(self) -> None:
        """Drop the calls and break their references: each call's tensor hook (owned by an
        autograd node) refers to the call, and the call to graph nodes, a cycle through C++
        that Python's garbage collector cannot see — left intact it would keep every graph
        and activation alive."""
        for c in self.calls:
            c.activation = c.grad = c.edge = c.input_node = None
        self.calls = []


#: grad_fn attributes under which Linear/Conv backward nodes save their input (addmm, mm,
#: convolution)
_SAVED_INPUT_ATTRS = ("_saved_mat1", "_saved_self", "_saved_input")
#: nodes that only reshape between a layer's output and the matmul/convolution node below it
_VIEW_NODES = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")


def autocast_operand(x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """The layer input as the layer's kernel consumed it, detached.

    Under autocast a Linear/Conv casts a float32 input to the autocast dtype before its matmul,
    and autograd saves that cast copy for the weight gradient. Recording the float32 original
    instead would keep a second, twice-as-large copy alive until the clipped sum (book-keeping
    keeps it to the end of the backward) — the whole memory overhead of DP training of a ViT under
    bf16 — and every rule would cast it again. So when the output came out in the autocast dtype
    and the input did not, the saved operand is reused (same storage, no copy); if autograd saved
    none (frozen weight), the input is cast once here. The per-sample gradients are then exactly
    the ones autograd forms, ``g_iᵀ·cast(a_i)``.
    """
    a = x.detach()
    device = x.device.type
    if not (x.is_floating_point() and torch.is_autocast_enabled(device)):
        return a
    dtype = torch.get_autocast_dtype(device)
    if x.dtype == dtype or output.dtype != dtype:
        return a
    node = output.grad_fn
    for _ in range(3):  # the matmul node, possibly under a view or two
        if node is None:
            break
        for attr in _SAVED_INPUT_ATTRS:
            try:
                saved = getattr(node, attr, None)
            except RuntimeError:  # saved tensor already freed or not saved
                saved = None
            if (isinstance(saved, torch.Tensor) and saved.dtype == dtype
                    and saved.numel() == x.numel() and saved.shape[-1] == x.shape[-1]
                    and saved.device == x.device):
                return saved.detach().reshape(x.shape)
        if type(node).__name__ not in _VIEW_NODES or not node.next_functions:
            break
        node = node.next_functions[0][0]
    return a.to(dtype)


def _with_io_size(dims: LayerDims, activation: torch.Tensor, output: torch.Tensor) -> LayerDims:
    """``dims`` with the per-sample element count of the call's input and output."""
    rows = max(activation.shape[0], 1) if activation.dim() else 1
    return replace(dims, io_size=(activation.numel() + output.numel()) // rows)


class LayerRecorder:
    """Installs the hooks on ``layers = [(name, module, rule)]`` and holds their records."""

    def __init__(self, layers: Sequence[RuledLayer],
                 on_layer_ready: Optional[Callable[[RecordedLayer], None]] = None):
        self.layers = [RecordedLayer(name, module, rule) for name, module, rule in layers]
        self.on_layer_ready = on_layer_ready
        self.capturing = False
        self._handles: list = []
        #: other recorders (parameter-entry tracer, fallback modules): objects with
        #: install/remove/reset and jumps() -> {output node: [input nodes]}; installed, reset and
        #: removed with this one
        self.extras: list = []
        #: the batch flow of the steps (:class:`private_engine.guards.batch_flow.BatchFlow`; set
        #: by its owner): calls on one shared row are recorded per sample through it
        self.batch_flow: Optional["BatchFlow"] = None
        #: the parameter-entry tracer among ``extras``
        #: (:class:`private_engine.capture.tracer.ParamTracer`), or None: it takes over calls on
        #: batch-free constants and tells where each call's input has its batch
        self.tracer: Optional["ParamTracer"] = None
        self.install()

    def install(self) -> None:
        """(Re-)register the forward hooks; a no-op while they are installed."""
        if not self._handles:
            # prepended: the call is recorded with the layer's own output, before any forward
            # hook the user registered can replace it (such a hook is then part of the rest of
            # the network, and a parameter it uses is caught by the graph walk)
            self._handles = [layer.module.register_forward_hook(self._make_forward_hook(layer),
                                                                prepend=True)
                             for layer in self.layers]
        for extra in self.extras:
            extra.install()

    # -- forward ---------------------------------------------------------------------------
    def _make_forward_hook(self, layer: RecordedLayer):
        def hook(module, inputs, output):
            if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor)
                    and output.requires_grad):
                return None
            if not inputs or not isinstance(inputs[0], torch.Tensor):
                raise TypeError(
                    f"{layer.name} ({type(module).__name__}) was called without a positional "
                    "tensor input; call clipped layers as module(x)."
                )
            tracer = self.tracer
            if tracer is None or not tracer.active:
                return self._record_call(layer, module, inputs[0], output)
            # the engine's own book-keeping does not go through the tracer's TorchFunctionMode
            # (speed only: the tracer ignores it anyway; it reads its own maps, never the mode)
            with torch._C.DisableTorchFunction():
                # a call on a batch-free constant: the tracer follows its parameters
                if tracer.handover(layer.name, module, layer.rule, inputs, output):
                    return None
                return self._record_call(layer, module, inputs[0], output)

        return hook

    def _record_call(self, layer: RecordedLayer, module: nn.Module, x: torch.Tensor,
                     output: torch.Tensor) -> Optional[torch.Tensor]:
        """Record a call from the layer's forward hook. A call on one row of no sample's data
        (Hugging Face's default ``position_ids`` of shape ``(1, T)``) while the step's batch has
        ``n > 1`` rows is recorded as the same call on the input expanded to ``n`` rows: its
        output is replaced by ``output.expand(n, …)``, tagged by the batch flow as the batch's
        rows (:meth:`BatchFlow.broadcast_rows`, which refuses any use of it other than an
        elementwise op with the batch's rows, where the model would broadcast it anyway: forward
        values are unchanged, the broadcast is done here instead). The output gradient arrives
        one row per sample, ``g_i = ∂L_i/∂y_i``, before any broadcast sums it; the per-sample
        gradient is the layer's vjp at row i, ``∂L_i/∂θ = (∂y/∂θ)ᵀ g_i`` with the shared input
        row. Returns the replaced output (None: unchanged)."""
        flow = self.batch_flow
        expanded = flow.broadcast_rows(x, output, layer.name) if flow is not None else None
        if expanded is None:
            self.record(layer, module, x, output)
            return None
        activation = autocast_operand(x, output)
        self.record(layer, module, x, expanded,
                    activation=activation.expand(expanded.shape[0], *activation.shape[1:]))
        return expanded

    def record(self, layer: RecordedLayer, module: nn.Module, x: torch.Tensor,
               output: torch.Tensor, covered: bool = False,
               activation: Optional[torch.Tensor] = None) -> None:
        """Record one call of ``layer`` with input ``x`` and output ``output`` (also used by the
        tracer for a Linear whose weight its parent passes to ``F.linear`` directly, as timm BEiT's
        attention does). ``covered``: the input's path is a tracer entry, so the graph walk stops at
        this call. ``activation``: the input as the clipping rules read it (default: ``x`` as
        the layer's kernel consumed it, :func:`autocast_operand`)."""
        if activation is None:
            activation = autocast_operand(x, output)
        root = output
        base = output._base
        if (base is not None and base.numel() == output.numel() and output.is_contiguous()
                and base.is_contiguous()):
            root = base
        tracer = self.tracer
        call = RecordedCall(
            activation=activation,
            output_shape=output.shape,
            dims=self._dims(layer, module, activation, output),
            edge=get_gradient_edge(root),
            input_requires_grad=x.requires_grad,
            # an input the tracer follows (a batch-expanded token) is covered by its entry, not by
            # this call
            input_node=(get_gradient_edge(x).node if x.requires_grad and not covered
                        and not (tracer is not None and tracer.is_tracked(x)) else None),
        )
        if tracer is not None:
            call.rows_ok, call.batch_dim = tracer.layer_input(x, covered)
        layer.calls.append(call)
        root.register_hook(self._make_grad_hook(layer, call))

    @staticmethod
    def _dims(layer: RecordedLayer, module: nn.Module, activation: torch.Tensor,
              output: torch.Tensor) -> LayerDims:
        """The call's ``LayerDims`` (with ``io_size``), computed once per pair of shapes."""
        key = (activation.shape, output.shape)
        dims = layer.dims_cache.get(key)
        if dims is None:
            # shapes that keep changing (variable sequence lengths)
            if len(layer.dims_cache) >= 256:
                layer.dims_cache.clear()
            dims = layer.dims_cache[key] = _with_io_size(
                layer.rule.dims(module, activation, output), activation, output)
        return dims

    # -- backward --------------------------------------------------------------------------
    def _make_grad_hook(self, layer: RecordedLayer, call: RecordedCall):
        def hook(grad):
            if not self.capturing or call.fired:
                return None
            if grad.requires_grad:  # only under create_graph: keep no graph
                grad = grad.detach()
            call.grad = grad if grad.shape == call.output_shape else grad.reshape(call.output_shape)
            call.fired = True
            if all(c.fired for c in layer.calls) and self.on_layer_ready is not None:
                self.on_layer_ready(layer)
            return None

        return hook

    # -- queries used by the norm pass ------------------------------------------------------
    def active_layers(self) -> List[RecordedLayer]:
        return [layer for layer in self.layers if layer.calls]

    def params_reached_outside_calls(self, loss: torch.Tensor,
                                     params: Sequence[torch.Tensor]) -> list:
        """Parameters of ``params`` that ``loss`` depends on other than through a recorded call
        (:func:`private_engine.capture.graph_walk.walk_graph`)."""
        return walk_graph(self, loss, params).outside

    def walk(self, loss: torch.Tensor, params: Sequence[torch.Tensor]) -> GraphWalk:
        """:func:`private_engine.capture.graph_walk.walk_graph` over this recorder's calls."""
        return walk_graph(self, loss, params)

    def finish_unfired(self) -> None:
        """Mark calls the loss does not depend on as done (they contribute nothing)."""
        for layer in self.layers:
            if layer.calls and not all(c.fired for c in layer.calls):
                for c in layer.calls:
                    c.fired = True
                if layer.pairs() and self.on_layer_ready is not None:
                    self.on_layer_ready(layer)

    def rearm(self) -> None:
        """Let every recorded call's gradient hook fire once more (a second backward through the
        same graph)."""
        for layer in self.layers:
            for c in layer.calls:
                c.fired = False
                c.grad = None

    def reset(self) -> None:
        """Drop every record (activations, gradients, graph edges)."""
        for layer in self.layers:
            layer.release()
        for extra in self.extras:
            extra.reset()

    def remove(self) -> None:
        """Remove all hooks and records."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for extra in self.extras:
            extra.remove()
        self.reset()
