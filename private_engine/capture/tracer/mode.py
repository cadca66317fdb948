"""The parameter-entry tracer: a ``TorchFunctionMode`` over the model's forward that follows the
tracked parameters and the tensors derived from them (batch-free), and the batched tensors with
their batch dimension; the ops where the two meet are rewritten by the entry rules
(:mod:`.rewrite`), whose entries and per-sample gradients the :class:`~.entries.EntryLedger`
keeps. The method is described in :mod:`private_engine.capture.tracer`."""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ...layers.base import trainable
from ...layers.linear import LinearRule
from ..plain_modules import PlainModules, plain_candidates
from ..tensor_map import TensorMap
from .batch_dim import out_batch_dim
from .entries import Derived, Entry, EntryLedger
from .ops import PASSIVE, output_tensors, tensor_args
from .rewrite import EntryRewriting


class ParamTracer(EntryRewriting, TorchFunctionMode):
    """Tracks ``params = [(name, P)]`` through the forward of ``model`` and clips them per sample.

    ``opaque``: modules whose forwards must always be traced (torch.func fallback modules read the
    tracer); the forwards of other submodules that own no tracked parameter run without the mode
    once verified to need nothing from it (:mod:`private_engine.capture.plain_modules`; class
    attribute ``skip_plain_modules``).
    """

    #: run verified plain submodules without the mode (host time); False traces every op of the
    #: forward
    skip_plain_modules = True

    def __init__(self, model: nn.Module, params: Sequence[Tuple[str, nn.Parameter]],
                 opaque: Sequence[nn.Module] = ()):
        super().__init__()
        self.model = model
        self.tracked: Dict[int, Tuple[str, nn.Parameter]] = {id(p): (n, p) for n, p in params}
        self.names = {id(p): n for n, p in params}
        self.derived = TensorMap()
        self.batched = TensorMap()
        #: the entries of the step and the per-sample gradients of the norm pass
        self.ledger = EntryLedger()
        #: ``{id(weight): RecordedLayer}`` of the recorded Linears and the layer recorder that
        #: records their calls made through ``F.linear`` (set by :meth:`attach`)
        self.linear_layers: Dict[int, object] = {}
        self.recorder = None
        self.recorded = TensorMap()  # outputs of Linear calls recorded by the tracer itself
        self.batch_size: Optional[int] = None
        self.active = False
        #: counts what the tracer did beyond following batched data (ops on tracked or derived
        #: tensors, hand-overs, layer calls without B sample-major rows): a submodule's forward
        #: during which it stays put is plain
        self.events = 0
        #: > 0 while a verified plain submodule runs (the mode is then off the stack, or passes ops
        #: through)
        self.skipping = 0
        self._popped = False
        self.plain = PlainModules(self, plain_candidates(model, set(self.tracked), opaque))
        self._handles: list = []
        self.install()

    # -- installation ----------------------------------------------------------------------
    def attach(self, recorder) -> None:
        """Work with the layer recorder ``recorder``: a recorded Linear (not transposed, with a
        trainable weight) whose weight reaches ``F.linear`` outside its own forward has that call
        recorded for it (:meth:`_linear_entry`), and calls on batch-free constants are handed
        over here (:meth:`handover`)."""
        self.recorder = recorder
        self.linear_layers = {id(rec.module.weight): rec for rec in recorder.layers
                              if isinstance(rec.rule, LinearRule) and not rec.rule.transposed
                              and trainable(rec.module, "weight")}

    def install(self) -> None:
        if not self._handles:
            self._handles = [
                self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
                self.model.register_forward_hook(self._post, always_call=True),
            ]
        self.plain.install()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.plain.remove()
        self.reset()

    def _pre(self, module, args, kwargs):
        from ..fallback import replaying

        if self.active or replaying() or not torch.is_grad_enabled():
            return None  # (inputs are batch-first by contract: marked sample-major below)
        first = next((t for t in tensor_args(args, kwargs) if t.dim() > 0), None)
        if first is None:
            return None
        self.batch_size = first.shape[0]
        self.ledger.grads = {}
        if self.batch_size == 0:  # an empty (Poisson) batch: nothing to follow or clip
            return None
        for t in tensor_args(args, kwargs):
            if t.dim() > 0 and t.shape[0] == self.batch_size:
                self.batched[t] = 0  # the batch dimension (inputs are batch-first)
        self.active = True
        self.skipping, self._popped = 0, False
        self.plain.reset()
        self.__enter__()
        return None

    def _post(self, module, args, output):
        if self.active:
            self.active = False
            if self._popped:  # an error inside a skipped submodule left the mode off the stack
                self.skipping, self._popped = 0, False
            else:
                self.__exit__(None, None, None)
        return None

    def pause(self) -> None:
        """Stop following ops (a verified plain submodule runs): the mode leaves the stack when it
        is on top (no Python call per op), else it passes ops through."""
        self.skipping += 1
        if self.skipping == 1 and torch.overrides._get_current_function_mode() is self:
            torch.overrides._pop_mode()
            self._popped = True

    def resume(self) -> None:
        """Follow ops again after :meth:`pause`."""
        self.skipping -= 1
        if self.skipping == 0 and self._popped:
            torch.overrides._push_mode(self)
            self._popped = False

    # -- the mode -------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in PASSIVE or self.skipping:
            return func(*args, **kwargs)
        tensors = tensor_args(args, kwargs)
        # one look-up per tensor: its batch dimension when it is batched data, else None
        lookup = self.batched.get
        bdims_in = [lookup(t) for t in tensors]
        src = None
        for t, d in zip(tensors, bdims_in):
            if d is not None:
                src = t
                break
        # no entries, no derived tensors; but per-sample data stays batched
        if not torch.is_grad_enabled():
            out = func(*args, **kwargs)
            if src is not None:
                self._mark_batched(func, args, kwargs, src, bdims_in, output_tensors(out))
            return out
        # tracked: a tracked parameter, or derived from one (the derived map is empty for most of a
        # forward)
        params, derived = self.tracked, self.derived
        if derived.empty():
            is_tracked = [id(t) in params for t in tensors]
        else:
            is_tracked = [id(t) in params or t in derived for t in tensors]
        batched = src is not None
        if batched and not any(is_tracked):  # the common case: an op on batched data only
            out = func(*args, **kwargs)
            self._mark_batched(func, args, kwargs, src, bdims_in, output_tensors(out))
            return out
        tracked = [t for t, k in zip(tensors, is_tracked) if k]
        if tracked:
            self.events += 1
        # data: batched, or computed from parameters the tracer does not follow (e.g. a layer's
        # output)
        data = batched or any(t.requires_grad and not k for t, k in zip(tensors, is_tracked))
        if tracked and data:
            return self._entry(func, args, kwargs, tracked)
        if tracked and not batched:
            pending = self._pending_rows(func, args, kwargs, tracked, tensors)
            if pending is not None:
                return pending
        out = func(*args, **kwargs)
        outs = output_tensors(out)
        if batched:
            self._mark_batched(func, args, kwargs, src, bdims_in, outs)
        elif tracked:
            ids = tuple(sorted({i for t in tracked for i in self._param_ids(t)}))
            row_base = self._row_base(func, args, kwargs, tracked, outs[0]) if outs else None
            for t in outs:
                if t.requires_grad and t.is_floating_point():
                    self.derived[t] = Derived(ids, row_base if t is outs[0] else None)
        return out

    def _mark_batched(self, func, args, kwargs, src, bdims_in, outs) -> None:
        """Mark the outputs of an op on batched data as batched, with their batch dimension (-1:
        unknown)."""
        bdim = None
        for d in bdims_in:
            if d is not None:
                if bdim is None:
                    bdim = d
                elif d != bdim:
                    bdim = -1
                    break
        batched = self.batched
        for t in outs:
            batched[t] = out_batch_dim(func, args, kwargs, src, bdim, t, self.batch_size)


    def _info(self, t) -> Derived:
        if id(t) in self.tracked:
            return Derived((id(t),))
        return self.derived[t]

    def _moved(self, tensors) -> bool:
        """True when a batched tensor among ``tensors`` is known to have its batch elsewhere than
        dim 0."""
        return any(self.batched[t] > 0 for t in tensors if t in self.batched)

    def _rows_ok(self, tensors) -> bool:
        """True when every batched tensor among ``tensors`` has its batch in dim 0, sample-major."""
        return all(self.batched[t] == 0 for t in tensors if t in self.batched)

    def layer_input(self, x, covered: bool = False) -> Tuple[Optional[bool], Optional[int]]:
        """``(rows_ok, batch_dim)`` of a recorded layer call's input ``x``: whether its rows are
        sample-major in dim 0 and where its batch dimension is (-1: unknown; both None when ``x`` is
        not batched data seen here, or the call runs inside a skipped plain submodule). ``covered``:
        the input is a tracer entry (rows are samples). A call without exactly B sample-major rows
        counts as an event (its submodule is not plain)."""
        if covered:
            return True, None
        if not self.active or self.skipping:
            return None, None
        bdim = self.batched.get(x)
        if bdim != 0 or x.dim() == 0 or x.shape[0] != self.batch_size:
            self.events += 1
        return (None if bdim is None else bdim == 0), bdim

    def sample_major(self, t) -> Optional[bool]:
        """Whether batched ``t`` has its rows sample-major in dim 0 (None: not a batched tensor seen
        here)."""
        if not self.active or t not in self.batched:
            return None
        return self.batched[t] == 0

    def is_tracked(self, t) -> bool:
        return id(t) in self.tracked or t in self.derived


    def _param_ids(self, t):
        if id(t) in self.tracked:
            return (id(t),)
        return self.derived[t].params


    def handover(self, name: str, module: nn.Module, rule, inputs, output) -> bool:
        """Take over a layer call whose input is a batch-free constant (XCiT's Fourier position
        encoding projects a fixed grid): its trainable parameters are followed like tracked ones
        from its output. Returns True when the recorder must not record the call."""
        if (not self.active or self.skipping or not inputs
                or not isinstance(inputs[0], torch.Tensor)):
            return False
        a = inputs[0]
        if output in self.recorded:  # recorded by the tracer's F.linear entry already
            return True
        # a layer on a batch-free tracked input: already followed by the tracer
        if self.is_tracked(a):
            return output in self.derived
        # its parameters were handed over in an earlier step: a chain op already
        if output in self.derived:
            return True
        if a in self.batched or a.requires_grad or (a.dim() > 0 and a.shape[0] == self.batch_size):
            return False
        params = [(f"{name}.{pn}" if name else pn, getattr(module, pn)) for pn in rule.param_names
                  if isinstance(getattr(module, pn, None), nn.Parameter)
                  and getattr(module, pn).requires_grad]
        for qn, p in params:
            self.tracked[id(p)] = (qn, p)
            self.names[id(p)] = qn
        prev = self.derived[output].params if output in self.derived else ()
        self.derived[output] = Derived(tuple(sorted(set(prev) | {id(p) for _, p in params})))
        self.events += 1
        return True


    # -- norm pass ------------------------------------------------------------------------
    @property
    def capturing(self) -> bool:
        """The norm pass's switch of the entries' hooks (set by the clipper, as on every recorder
        of the capture stage)."""
        return self.ledger.capturing

    @capturing.setter
    def capturing(self, on: bool) -> None:
        self.ledger.capturing = on

    @property
    def in_vjp(self) -> bool:
        """True while a per-sample vjp through a batch-free chain runs (a nested backward)."""
        return self.ledger.in_vjp

    @property
    def entries(self) -> list:
        """The entries of the current step (:class:`~.entries.Entry`)."""
        return self.ledger.entries

    def _make_hook(self, entry: Entry, n: int):
        def hook(grad):
            self.ledger.on_grad(entry, grad, n, self.batch_size)
            return None

        return hook

    def entry_edges(self) -> list:
        return self.ledger.edges()

    def jumps(self) -> Dict[object, list]:
        """``{output node: [batched input nodes]}`` of every entry, for the graph walk."""
        return self.ledger.jumps()

    def per_sample_grads(self) -> Dict[str, torch.Tensor]:
        """``{param name: (B, *P.shape)}`` accumulated in the last norm pass."""
        return self.ledger.per_sample_grads(self.names)

    def drop_entries(self, mark: int) -> None:
        """Forget the entries from index ``mark`` on (a forward that is not trained on)."""
        self.ledger.drop_from(mark)

    def reset(self) -> None:
        self.ledger.reset()
