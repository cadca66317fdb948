"""Parameter entries: exact per-sample gradients of parameters used outside Linear/Conv/norm layers.

timm ViTs own parameters that enter the computation by a few elementwise ops: ``cls_token``
(``cat(cls.expand(B, -1, -1), x)``), ``pos_embed`` (``x + pos_embed``), LayerScale gammas
(``x * gamma``), XCiT's ``temperature``, ConViT's ``sigmoid(gating_param)``, relative position
bias tables (``table[index].view(N, N, H).permute(2, 0, 1)`` added to the attention logits or
passed as ``attn_mask`` to ``F.scaled_dot_product_attention``).

While the model runs its forward, a ``TorchFunctionMode`` follows two kinds of tensors:

* *derived* tensors ``D``: computed from the tracked parameters and constants only (a batch-free
  chain: index, view, permute, expand, sigmoid, …);
* *batched* tensors: computed from the model's inputs.

At the op where a derived ``D`` meets batched data (an *entry*: add/sub/mul/div/where with
broadcasting, cat/stack of a batch-expanded token, the ``attn_mask`` of SDPA), ``D`` is replaced
by the batch-expanded view ``D_b = D.expand(n, …)`` (n = leading size of the batched operand, a
multiple k·B of the batch size, sample-major). Forward values are unchanged. The gradient of the
loss w.r.t. ``D_b`` holds one cotangent per row; summing the k rows of each sample gives the
per-sample cotangent ``c_i``, and the per-sample gradient of each parameter P follows by a
batched vjp through the small batch-free chain::

    ∂L_i/∂P = (∂D/∂P)ᵀ c_i      (torch.autograd.grad(D, P, c, is_grads_batched=True))

(direct reshape when D is P itself). Such gradients are at most one activation in size, so they are
always instantiated (``ghost_capable=False``); their squared norms add into the same ``‖g_i‖²`` as
the layer rules, and their clipped sum is ``Σ_i C_i·∂L_i/∂P`` of these very per-sample gradients
(kept until the clip factors are known, in every mode). A tracked parameter reaching batched data
through any other op raises an error naming it (never silently unclipped), and each entry is
registered as a call for the engine's graph walk (``params_reached_outside_calls``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.overrides import TorchFunctionMode

from ..layers.base import accumulation_dtype
from .plain_modules import PlainModules, plain_candidates
from .tensor_map import TensorMap

#: elementwise ops with broadcasting at which a derived tensor may meet batched data
_ELEMENTWISE_NAMES = ("add", "sub", "mul", "div", "true_divide", "rsub", "where", "addcmul")
ELEMENTWISE = set()
for _n in _ELEMENTWISE_NAMES:
    for _owner in (torch, torch.Tensor):
        for _v in (_n, _n + "_", f"__{_n}__", f"__r{_n}__", f"__i{_n}__"):
            _f = getattr(_owner, _v, None)
            if _f is not None:
                ELEMENTWISE.add(_f)
ELEMENTWISE |= {torch.Tensor.__truediv__, torch.Tensor.__rtruediv__, torch.Tensor.__itruediv__}
CONCAT = {torch.cat, torch.concat, torch.concatenate, torch.stack}
#: ``x @ W`` with a tracked 2-D ``W`` and batched ``x``: a per-sample weight (instantiated)
MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}
EXPANDS = {torch.Tensor.expand, torch.Tensor.expand_as}
#: shape ops through which a row-expanded tensor stays row-expanded (each use is verified)
ROWWISE = {torch.Tensor.reshape, torch.Tensor.view, torch.Tensor.permute, torch.Tensor.transpose,
           torch.transpose, torch.Tensor.flatten, torch.flatten, torch.Tensor.contiguous,
           torch.Tensor.unsqueeze, torch.Tensor.to, torch.Tensor.clone, torch.Tensor.float,
           torch.Tensor.double, torch.Tensor.type_as, torch.Tensor.repeat, torch.reshape,
           torch.permute}
#: attribute reads and metadata queries: never an entry (property reads arrive as their getters)
_PASSIVE = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__len__,
            torch.Tensor.is_contiguous, torch.Tensor.is_floating_point, torch.Tensor.data_ptr,
            torch.Tensor.storage_offset, torch.Tensor.stride}
for _attr in ("shape", "grad_fn", "requires_grad", "dtype", "device", "is_leaf", "_base", "ndim",
              "is_cuda", "layout"):
    _getter = getattr(getattr(torch.Tensor, _attr, None), "__get__", None)
    if _getter is not None:
        _PASSIVE.add(_getter)


@dataclass
class Derived:
    """What the tracer knows about a batch-free tensor computed from tracked parameters."""

    params: Tuple[int, ...]  # ids of the tracked parameters it depends on
    #: T when this tensor is T.expand(n, …) with T.shape[0] == 1
    row_base: Optional[torch.Tensor] = None
    #: entries already substituted row by row inside this tensor (a one-row tensor combined
    #: elementwise with an n-row constant, e.g. Swin's bias + shifted-window mask); it must meet n
    #: batched rows
    pending: Tuple["Entry", ...] = ()


@dataclass
class Entry:
    """One op where derived data met batched data."""

    name: str  # names of the parameters, for messages and the plan
    base: torch.Tensor  # the batch-free tensor D (leading dim 1) that D_b expands
    params: List[nn.Parameter]
    edge: object  # gradient edge of D_b (asked for in the norm pass)
    out_node: object  # autograd node of the op's output
    batched_nodes: List[object]  # autograd nodes of its batched operands
    fired: bool = False


def _tensors(args, kwargs):
    out = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def _outputs(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def reparametrization_message(names) -> Optional[str]:
    """The refusal for parameters that are a module's reparametrization — ``torch.nn.utils.
    parametrize`` (``parametrizations.weight.original*``, e.g. ``parametrizations.weight_norm``)
    or the older hook-based ``torch.nn.utils.weight_norm`` (``weight_g``, ``weight_v``) — naming
    the module and the fix; ``None`` for other parameters."""
    owners = {}
    for n in names:
        if ".parametrizations." in f".{n}":
            head, _, rest = f".{n}".partition(".parametrizations.")
            owners.setdefault(head[1:], ("parametrize", rest.split(".")[0]))
        elif n.endswith(("weight_g", "weight_v")) and "." in n:
            owners.setdefault(n.rsplit(".", 1)[0], ("weight_norm", "weight"))
    if not owners:
        return None
    kind = {k for k, _ in owners.values()}
    mods = ", ".join(f"the {a} of module {m!r}" for m, (_, a) in sorted(owners.items()))
    fixes = ("fold it into a plain parameter before training "
             "(torch.nn.utils.parametrize.remove_parametrizations(module, name)), or clip the "
             "module by the torch.func fallback: private_engine.layers.register_fallback("
             "type(module)) before building the engine (a parametrized module has its own class, "
             "e.g. ParametrizedLinear)" if kind == {"parametrize"} else
             "fold it into a plain weight before training (torch.nn.utils.remove_weight_norm("
             "module)), or use torch.nn.utils.parametrizations.weight_norm and clip the module by "
             "the torch.func fallback: private_engine.layers.register_fallback(type(module))")
    return (f"parameter(s) {names} reparametrize {mods}: the module computes that tensor from "
            "them in its forward (torch.nn.utils.parametrize / weight_norm), so its "
            "layer rule, which clips a weight that is itself a parameter, does not apply, and the "
            f"parameter-entry tracer cannot follow the computed weight into the layer. Fix: "
            f"{fixes}; or freeze them (requires_grad_(False)).")


class UnsupportedEntryError(ValueError):
    """A tracked parameter reaches the batch through an op the tracer cannot clip per sample."""


class ParamTracer(TorchFunctionMode):
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
        self.entries: List[Entry] = []
        #: ``{id(weight): RecordedLayer}`` of recorded Linears and their recorder (set by the
        #: clipper)
        self.linear_layers: Dict[int, object] = {}
        self.recorder = None
        self.recorded = TensorMap()  # outputs of Linear calls recorded by the tracer itself
        self.batch_size: Optional[int] = None
        self.capturing = False
        self.active = False
        #: True while a per-sample vjp through a batch-free chain runs (a nested backward)
        self.in_vjp = False
        #: per-sample gradients ``{id(P): (B, *P.shape)}`` accumulated in the norm pass
        self.grads: Dict[int, torch.Tensor] = {}
        #: counts what the tracer did beyond following batched data (ops on tracked or derived
        #: tensors, hand-overs, layer calls without B sample-major rows): a submodule's forward
        #: during which it stays put is plain
        self.events = 0
        #: > 0 while a verified plain submodule runs (the mode is then off the stack, or passes ops
        #: through)
        self.skipping = 0
        self._popped = False
        self.plain = PlainModules(self, plain_candidates(model, set(self.tracked), opaque))
        self._handles = []
        self.install()

    # -- installation ----------------------------------------------------------------------
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
        from .fallback import replaying

        if self.active or replaying() or not torch.is_grad_enabled():
            return None  # (inputs are batch-first by contract: marked sample-major below)
        first = next((t for t in _tensors(args, kwargs) if t.dim() > 0), None)
        if first is None:
            return None
        self.batch_size = first.shape[0]
        self.grads = {}
        if self.batch_size == 0:  # an empty (Poisson) batch: nothing to follow or clip
            return None
        for t in _tensors(args, kwargs):
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
        if func in _PASSIVE or self.skipping:
            return func(*args, **kwargs)
        tensors = _tensors(args, kwargs)
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
                self._mark_batched(func, args, kwargs, src, bdims_in, _outputs(out))
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
            self._mark_batched(func, args, kwargs, src, bdims_in, _outputs(out))
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
        outs = _outputs(out)
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
            batched[t] = _out_bdim(func, args, kwargs, src, bdim, t, self.batch_size)

    def _pending_rows(self, func, args, kwargs, tracked, tensors):
        """An elementwise op that spreads a one-row derived tensor over the n rows of a constant:
        substitute the row-expanded ``D_b`` now (rows stay aligned through elementwise ops) and
        finish the entry when the result meets n batched rows. Returns the op's output, or None when
        the op is not such a case."""
        has_pending = any(self._info(t).pending for t in tracked)
        if func not in ELEMENTWISE:
            if has_pending:
                self._fail(func, tracked, "a tensor whose rows are already aligned with the batch "
                                          "went through an op other than an elementwise one")
            return None
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        if not shape or shape[0] <= 1:
            return None
        aligned = lambda t: (1,) * (len(shape) - t.dim()) + tuple(t.shape)
        if not has_pending and not any(aligned(t)[0] == 1 for t in tracked):
            return None  # nothing is spread over rows
        n = shape[0]
        entries = []

        def sub(t):
            if not (isinstance(t, torch.Tensor) and self.is_tracked(t)):
                return t
            info = self._info(t)
            if info.pending and aligned(t)[0] == n:
                entries.extend(info.pending)
                return t
            d_b, e = self._substitute(t, shape, func, check_batch=False)
            entries.append(e)
            return d_b

        args = tuple(sub(a) for a in args)
        kwargs = {k: sub(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        ids = tuple(sorted({i for t in tracked for i in self._param_ids(t)}))
        for t in _outputs(out):
            if t.requires_grad and t.is_floating_point():
                self.derived[t] = Derived(ids, None, tuple(entries))
        return out

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

    def _row_base(self, func, args, kwargs, tracked, out):
        """``T`` (one row) when ``out`` is ``n`` identical rows ``T.expand(n, …)``, else None.

        Recognised: ``expand``/``repeat`` of a one-row tensor, and shape ops (reshape, permute, …)
        of such a tensor that keep the rows, verified by recomputing the op on the row and
        comparing.
        """
        # (0 rows: an empty Poisson batch)
        if len(tracked) != 1 or out.dim() == 0 or out.shape[0] == 1:
            return None
        src = tracked[0]
        n = out.shape[0]
        if func in EXPANDS:
            return src if src.dim() == out.dim() and src.shape[0] == 1 else None
        info = self.derived.get(src) if id(src) not in self.tracked else None
        if func is torch.Tensor.repeat and src.dim() == out.dim() and src.shape[0] == 1:
            row_src = src
        elif (func in ROWWISE and info is not None and info.row_base is not None
              and src.shape[0] == n):
            row_src = info.row_base
        else:
            return None

        def one(a):
            if a is src:
                return row_src
            if isinstance(a, (tuple, list, torch.Size)) and a and a[0] == n:
                return (1,) + tuple(a[1:])
            return a

        new_args = [one(a) for a in args]
        if len(new_args) > 1 and isinstance(new_args[1], int) and new_args[1] == n and \
                func in (torch.Tensor.reshape, torch.Tensor.view, torch.Tensor.repeat):
            new_args[1] = 1
        try:
            cand = func(*new_args, **kwargs)
        except Exception:
            return None
        if not isinstance(cand, torch.Tensor) or tuple(cand.shape) != (1, *out.shape[1:]):
            return None
        with torch.no_grad():
            if not torch.equal(cand.expand_as(out), out):
                return None
        return cand

    def _param_ids(self, t):
        if id(t) in self.tracked:
            return (id(t),)
        return self.derived[t].params

    def _fail(self, func, tracked, why):
        names = sorted({self.names[i] for t in tracked for i in self._param_ids(t)})
        reparametrized = reparametrization_message(names)
        if reparametrized:
            raise UnsupportedEntryError(reparametrized)
        raise UnsupportedEntryError(
            f"parameter(s) {names} meet the batch in {getattr(func, '__name__', func)!r}: {why}. "
            "The parameter-entry tracer clips parameters that reach the batch by elementwise ops "
            "(add/sub/mul/div/where), cat/stack of a batch-expanded token, or "
            "F.scaled_dot_product_attention(attn_mask=...). Clip the module that owns them with "
            "the torch.func fallback instead: private_engine.layers.register_fallback(ModuleClass) "
            "before building the engine, or freeze them (requires_grad_(False))."
        )

    def _substitute(self, t, shape, func, check_batch=True, rows_ok=True, moved=False):
        """``D_b``: ``t`` (aligned to the broadcast ``shape``) expanded to ``shape[0]`` rows, and
        its entry. ``rows_ok``: the batched operands are known sample-major in dim 0 (needed for k·B
        rows); ``moved``: one is known to have its batch in another dimension (refused even with B
        rows: a sequence-first layout)."""
        B = self.batch_size
        n = shape[0]
        if check_batch and moved:
            self._fail(func, [t], f"the batched operand has {n} rows but its batch dimension was "
                                  "moved from dim 0 (e.g. a sequence-first layout), so rows cannot "
                                  "be assigned to samples")
        if check_batch and not rows_ok:
            self._fail(func, [t], "the tracer could not follow the batch dimension of the batched "
                                  "operand through the ops before this one (it follows "
                                  "elementwise and shape ops, permute/transpose, basic indexing, "
                                  "reductions over other dims, cat/stack along other dims, "
                                  "embedding), so its rows cannot be assigned to samples")
        if check_batch and (n % B if B else n):  # an empty batch has 0 rows: nothing to assign
            self._fail(func, [t], f"the batched operand has {n} rows, not a multiple of the batch "
                                  f"size {B} (inputs must be batch-first)")
        if t.dim() < len(shape):
            base = t.reshape((1,) * (len(shape) - t.dim()) + tuple(t.shape))
        elif t.shape[0] == 1:
            base = t
        else:
            info = self.derived.get(t)
            if info is None or info.row_base is None or t.shape[0] != n:
                self._fail(func, [t], f"a batch-free tensor of shape {tuple(t.shape)} is aligned "
                                      "with the batch dimension but is not an expand of a one-row "
                                      "tensor")
            base = info.row_base
        if base.shape[0] != 1:
            self._fail(func, [t], f"cannot align shape {tuple(t.shape)} with the batch dimension")
        d_b = base.expand(n, *base.shape[1:])
        ids = self._param_ids(t)
        entry = Entry(name=", ".join(self.names[i] for i in ids), base=base,
                      params=[self.tracked[i][1] for i in ids], edge=get_gradient_edge(d_b),
                      out_node=None, batched_nodes=[])
        d_b.register_hook(self._make_hook(entry, n))
        return d_b, entry

    def _entry(self, func, args, kwargs, tracked):
        tensors = _tensors(args, kwargs)
        batched_nodes = [get_gradient_edge(t).node for t in tensors
                         if not self.is_tracked(t) and t.requires_grad]
        new_entries = []
        rows_ok = self._rows_ok(tensors)
        moved = self._moved(tensors)

        def sub(t, shape):
            if self.is_tracked(t) and self._info(t).pending:
                if (t.dim() != len(shape) or t.shape[0] != shape[0] or shape[0] % self.batch_size
                        or not rows_ok):
                    self._fail(func, [t], f"its {t.shape[0]} rows do not line up with the "
                                          f"{shape[0]} batched rows")
                new_entries.extend(self._info(t).pending)
                return t
            if self.is_tracked(t):
                d_b, e = self._substitute(t, shape, func, rows_ok=rows_ok, moved=moved)
                new_entries.append(e)
                return d_b
            return t

        if func in ELEMENTWISE:
            shape = torch.broadcast_shapes(*(t.shape for t in tensors))
            args = tuple(sub(a, shape) if isinstance(a, torch.Tensor) else a for a in args)
            kwargs = {k: sub(v, shape) if isinstance(v, torch.Tensor) else v
                      for k, v in kwargs.items()}
        elif func in CONCAT:
            seq = args[0] if args else kwargs.get("tensors")
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            ref = next(t for t in seq if not self.is_tracked(t))
            if func is not torch.stack and dim % ref.dim() == 0:
                self._fail(func, tracked, "concatenation along the batch dimension")
            shape = ref.shape
            seq = [sub(t, (shape[0],) + tuple(t.shape[1:])) if t.dim() == ref.dim() else t
                   for t in seq]
            if any(self.is_tracked(t) for t in seq):
                self._fail(func, tracked,
                           "a tracked tensor with another rank than the batched ones")
            args = (seq,) + tuple(args[1:]) if args else args
            if not args:
                kwargs = dict(kwargs, tensors=seq)
        elif func is F.scaled_dot_product_attention:
            q = args[0]
            k = args[1]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if not (isinstance(mask, torch.Tensor) and self.is_tracked(mask)) or \
                    any(self.is_tracked(t) for t in args[:3]):
                self._fail(func, tracked, "only attn_mask may be a tracked tensor")
            shape = tuple(q.shape[:-1]) + (k.shape[-2],)
            d_b = sub(mask, shape)
            if len(args) > 3:
                args = tuple(args[:3]) + (d_b,) + tuple(args[4:])
            else:
                kwargs = dict(kwargs, attn_mask=d_b)
        elif func in MATMULS:
            x = args[0] if args else kwargs.get("input")
            W = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
            if not (isinstance(W, torch.Tensor) and self.is_tracked(W) and W.dim() == 2) or \
                    self.is_tracked(x) or x.dim() < 2:
                self._fail(func, tracked, "only x @ W with a batched x and a tracked 2-D W is "
                                          "supported")
            out = self._weight_entry(func, x, W, False, new_entries, rows_ok, moved)
        elif func is F.linear:
            out, is_entry = self._linear_entry(args, kwargs, tracked, new_entries)
            if not is_entry:  # F.linear on a batch-free input: a chain op after all
                return out
            # bias entry: its data is F.linear(x, W); input entry: the recorded call covers W, b
            if new_entries:
                batched_nodes = new_entries[-1].batched_nodes
        else:
            self._fail(func, tracked, "this op is not a supported entry")
        if func is not F.linear and func not in MATMULS:
            out = func(*args, **kwargs)
        for t in _outputs(out):
            self.batched[t] = 0 if rows_ok else -1
        first = _outputs(out)[0]
        node = first.grad_fn
        for e in new_entries:
            e.out_node = node
            e.batched_nodes = list(batched_nodes)
        self.entries.extend(new_entries)
        return out

    def _linear_entry(self, args, kwargs, tracked, new_entries):
        """``F.linear(x, W, b)`` with a tracked ``x`` or ``b``; returns ``(output, is_entry)``.

        * ``b`` derived from tracked parameters (timm BEiT/EVA/SwinV2 attention:
          ``F.linear(x, self.qkv.weight, cat(q_bias, zeros, v_bias))``): computed as
          ``F.linear(x, W) + b_b``, an entry for ``b``; when ``W`` is the weight of a recorded
          Linear whose forward is never called, the call ``(x, F.linear(x, W))`` is recorded for
          that Linear, so its weight is clipped by the Linear rule (ghost or instantiated) at rule
          speed.
        * ``x`` a row-expanded tracked tensor with B rows (timm's attention-pool
          ``latent.expand(B, …)`` fed to a Linear): its rows are the samples; ``x`` becomes an entry
          and the output is batched.
        """
        names = ("input", "weight", "bias")
        vals = list(args) + [None] * (3 - len(args))
        for k, n in enumerate(names):
            if n in kwargs:
                vals[k] = kwargs[n]
        x, W, b = vals
        tr = [isinstance(t, torch.Tensor) and self.is_tracked(t) for t in (x, W, b)]
        if tr[1]:
            if tr[0] or W.dim() != 2 or x.dim() < 2 or id(W) in self.linear_layers:
                self._fail(F.linear, tracked, "a tracked tensor used as the weight of a "
                                              "batch-free input or of a recorded Linear")
            tensors = [t for t in (x, W, b) if isinstance(t, torch.Tensor)]
            y = self._weight_entry(F.linear, x, W, True, new_entries, self._rows_ok(tensors),
                                   self._moved(tensors))
            if b is None:
                return y, True
            if tr[2]:
                b_b, e = self._substitute(b, tuple(y.shape), F.linear)
                new_entries.append(e)
                return y + b_b.to(y.dtype), True
            if isinstance(b, nn.Parameter) and b.requires_grad:
                self._fail(F.linear, tracked, "the bias is a trainable parameter of no recorded "
                                              "Linear")
            return y + b.to(y.dtype), True
        if tr[0]:
            info = self._info(x)
            layer = self.linear_layers.get(id(W))
            if (x.dim() >= 2 and x.shape[0] == self.batch_size and info.row_base is not None
                    and not tr[2]):
                # rows are the samples: an entry for x; the Linear's own call is recorded here
                if layer is not None and not (b is None or b is layer.module.bias):
                    self._fail(F.linear, tracked,
                               f"the bias is not the own bias of the Linear {layer.name} owning "
                               "the weight (the recorded call would clip the wrong bias)")
                own = (layer.module.weight, layer.module.bias) if layer is not None else ()
                x, e = self._substitute(x, tuple(x.shape), F.linear)
                # W/b that are not the Linear's own parameters: the graph walk must look behind them
                e.batched_nodes = [get_gradient_edge(t).node for t in (W, b)
                                   if isinstance(t, torch.Tensor) and t.requires_grad
                                   and not any(t is o for o in own)]
                new_entries.append(e)
                y = F.linear(x, W, b)
                if layer is not None:
                    self.recorder.record(layer, layer.module, x, y, covered=True)
                    self.recorded[y] = True
                elif any(isinstance(t, nn.Parameter) and t.requires_grad for t in (W, b)):
                    self._fail(F.linear, tracked,
                               "the weight is a trainable parameter of no recorded Linear")
                return y, True
            # a batch-free input (SwinV2's continuous position bias MLP on a fixed grid): a chain
            # op; the Linear's parameters are followed by the tracer (the recorder hands the call
            # over)
            y = F.linear(x, W, b)
            ids = set(self._param_ids(x)) | (set(self._param_ids(b)) if tr[2] else set())
            for t in (W, b):
                if isinstance(t, nn.Parameter) and t.requires_grad and id(t) not in self.tracked:
                    if layer is None:
                        self._fail(F.linear, tracked,
                                   "the weight is a trainable parameter of no recorded Linear")
                    n = f"{layer.name}.{'weight' if t is W else 'bias'}"
                    self.tracked[id(t)] = (n, t)
                    self.names[id(t)] = n
                if isinstance(t, nn.Parameter) and t.requires_grad:
                    ids.add(id(t))
            self.derived[y] = Derived(tuple(sorted(ids)))
            return y, False
        if not tr[2]:
            return F.linear(x, W, b), True
        y = F.linear(x, W, None)
        layer = self.linear_layers.get(id(W))
        if layer is not None:
            from ..layers.base import trainable

            if trainable(layer.module, "bias"):
                self._fail(F.linear, tracked, f"the Linear {layer.name} owning the weight has a "
                                              "trainable bias that this call does not use")
            self.recorder.record(layer, layer.module, x, y)
        elif isinstance(W, nn.Parameter) and W.requires_grad:
            self._fail(F.linear, tracked,
                       "the weight is a trainable parameter of no recorded Linear")
        b_b, e = self._substitute(b, tuple(y.shape), F.linear)
        e.batched_nodes = [get_gradient_edge(y).node] if y.requires_grad else []
        new_entries.append(e)
        return y + b_b.to(y.dtype), True  # F.linear's dtype under autocast (its bias is cast too)

    def _weight_entry(self, func, x, W, transposed: bool, new_entries, rows_ok, moved):
        """``x @ W`` (``transposed``: ``x @ Wᵀ``, F.linear) for a batched ``x: (n, …, d)`` and a
        tracked 2-D ``W``: computed as ``x_i @ W_b[i]`` with ``W_b`` the weight expanded to one
        copy per sample, so that the gradient reaching ``W_b`` is the per-sample gradient
        ``∂L_i/∂W = Σ_t x_{i,t}ᵀ g_{i,t}`` (instantiated, as every traced parameter's). The rows of
        ``x`` must be the samples (or k consecutive rows per sample)."""
        B, n, d = self.batch_size, x.shape[0], x.shape[-1]
        if (n % B if B else n):
            self._fail(func, [W], f"the batched operand has {n} rows, not a multiple of the "
                                  f"batch size {B} (inputs must be batch-first)")
        W_b, e = self._substitute(W, (B,) + tuple(W.shape), func, rows_ok=rows_ok, moved=moved)
        new_entries.append(e)
        inner = math.prod(x.shape[1:-1])
        per_sample = (n // B) * inner if B else inner
        Wm = W_b.transpose(1, 2) if transposed else W_b
        y = torch.matmul(x.reshape(B, per_sample, d), Wm)
        return y.reshape(*x.shape[:-1], Wm.shape[-1])

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
    def _make_hook(self, entry: Entry, n: int):
        def hook(grad):
            if not self.capturing or entry.fired:
                return None
            entry.fired = True
            self._accumulate(entry, grad.detach(), n)
            return None

        return hook

    def _accumulate(self, entry: Entry, cot: torch.Tensor, n: int) -> None:
        B = self.batch_size
        # (B, *base.shape[1:]): per-sample cotangent
        cot = cot.reshape(B, n // B, *cot.shape[1:]).sum(1)
        base = entry.base
        if len(entry.params) == 1 and _is_reshape_of(base, entry.params[0]):
            P = entry.params[0]
            grads = [cot.reshape(B, *P.shape)]
        else:
            self.in_vjp = True  # parameter hooks (the Opacus door's) must leave this vjp alone
            try:
                with torch.enable_grad():
                    grads = torch.autograd.grad(base, entry.params,
                                                grad_outputs=cot.reshape(B, *base.shape),
                                                is_grads_batched=True, retain_graph=True,
                                                allow_unused=True)
            finally:
                self.in_vjp = False
        for P, g in zip(entry.params, grads):
            if g is None:
                continue
            g = g.to(accumulation_dtype(g))
            prev = self.grads.get(id(P))
            self.grads[id(P)] = g if prev is None else prev + g

    def entry_edges(self) -> list:
        return [e.edge for e in self.entries]

    def jumps(self) -> Dict[object, list]:
        """``{output node: [batched input nodes]}`` of every entry, for the graph walk."""
        out: Dict[object, list] = {}
        for e in self.entries:
            if e.out_node is not None:
                out.setdefault(e.out_node, []).extend(e.batched_nodes)
        return out

    def per_sample_grads(self) -> Dict[str, torch.Tensor]:
        """``{param name: (B, *P.shape)}`` accumulated in the last norm pass."""
        return {self.names[i]: g for i, g in self.grads.items()}

    def reset(self) -> None:
        for e in self.entries:
            e.base = e.edge = e.out_node = None
            e.batched_nodes = []
        self.entries = []
        self.grads = {}


_TRANSPOSES = {torch.Tensor.transpose, torch.transpose, torch.Tensor.swapaxes, torch.swapaxes,
               torch.Tensor.swapdims, torch.swapdims}
_PERMUTES = {torch.Tensor.permute, torch.permute}
_MOVEDIMS = {torch.Tensor.movedim, torch.movedim, torch.Tensor.moveaxis, torch.moveaxis}


def _out_bdim(func, args, kwargs, src, bdim, out, B) -> int:
    """Position of the batch dimension in ``out`` (-1: unknown), given it is ``bdim`` in the batched
    input ``src``.

    Followed through permute/transpose/movedim/.T/.mT, unbind/select, basic indexing, unsqueeze,
    stack, reductions over other dims, embedding, reshapes that keep the dims up to it, and reshapes
    that merge or split dim 0 sample-major (Swin's window partition and reverse,
    ``flatten(0, 1)``); any other op keeps it when the rank and the batch dimension's size are
    unchanged (cat/repeat along it stack rows, not samples). An entry needs the batch known in
    dim 0; a layer may see k·B rows only then, and is refused when its batch is known elsewhere.
    """
    if bdim < 0 or not isinstance(src, torch.Tensor):
        return -1
    try:
        nd = src.dim()
        # same rank, no dimension moved: the batch stays in place
        if func not in _MOVES_BATCH and out.dim() == nd:
            # only when its size is unchanged (cat/repeat along it stack rows, not samples); every
            # op of _MOVES_BATCH returns from its own branch below
            return bdim if out.shape[bdim] == src.shape[bdim] else -1
        if func in _TRANSPOSES:
            d0 = (args[1] if len(args) > 1 else kwargs.get("dim0")) % nd
            d1 = (args[2] if len(args) > 2 else kwargs.get("dim1")) % nd
            return d1 if bdim == d0 else d0 if bdim == d1 else bdim
        if func in _PERMUTES:
            dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
            dims = [d % nd for d in (dims or kwargs.get("dims"))]
            return dims.index(bdim)
        if func in _MOVEDIMS:
            perm = torch.movedim(torch.arange(nd),
                                 args[1] if len(args) > 1 else kwargs.get("source"),
                                 args[2] if len(args) > 2 else kwargs.get("destination"))
            return perm.tolist().index(bdim)
        if func in _UNBINDS:
            d = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % nd
            return -1 if d == bdim else bdim - (d < bdim)
        if func is torch.Tensor.__getitem__:
            r = _getitem_bdim(args[1], nd, bdim)
            return r if 0 <= r < out.dim() and out.shape[r] == src.shape[bdim] else -1
        if func in _UNSQUEEZES:
            d = (args[1] if len(args) > 1 else kwargs.get("dim")) % (nd + 1)
            r = bdim + (d <= bdim)
            return r if out.dim() == nd + 1 and out.shape[r] == src.shape[bdim] else -1
        if func in _RESHAPES:
            if (bdim > 0 and out.dim() > bdim
                    and tuple(out.shape[:bdim + 1]) == tuple(src.shape[:bdim + 1])):
                return bdim  # the dims up to the batch are kept (e.g. (T, B, H·D) -> (T, B, H, D))
            if bdim != 0 or out.dim() == 0:
                return -1
            n_in, n_out = src.shape[0], out.shape[0]
            if n_out % B == 0 and (n_out % n_in == 0 or n_in % n_out == 0):
                return 0  # dim 0 merged with following dims, or split: rows stay sample-major
            return -1
        # .t(), .T, .H reverse dims; .mT, .mH swap
        if func in (torch.Tensor.t, torch.t) or func in _T_GETTERS:
            if func not in _MT_GETTERS:
                r = nd - 1 - bdim
            else:
                r = {nd - 2: nd - 1, nd - 1: nd - 2}.get(bdim, bdim)
            return r if out.dim() == nd and out.shape[r] == src.shape[bdim] else -1
        if func in _EMBEDDINGS:  # (B, T) ids -> (B, T, d): the indices' dims come first
            return bdim if out.dim() == nd + 1 and out.shape[bdim] == src.shape[bdim] else -1
        if func is torch.stack:  # stacking batched tensors along another dim
            d = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % (nd + 1)
            r = bdim + (d <= bdim)
            return r if out.dim() == nd + 1 and out.shape[r] == src.shape[bdim] else -1
        # x.mean(1), x.amax(dim=(-2, -1)), …
        if out.dim() < nd and getattr(func, "__name__", "") in _REDUCTIONS:
            d = args[1] if len(args) > 1 else kwargs.get("dim")
            ds = [d] if isinstance(d, int) else list(d) if isinstance(d, (tuple, list)) else []
            ds = {k % nd for k in ds if isinstance(k, int) and not isinstance(k, bool)}
            if ds and bdim not in ds and out.dim() == nd - len(ds):
                r = bdim - sum(k < bdim for k in ds)
                return r if out.shape[r] == src.shape[bdim] else -1
    except Exception:  # an unexpected signature: unknown
        return -1
    return -1


_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "std", "var", "logsumexp",
               "squeeze", "argmax", "argmin", "all", "any", "nansum", "nanmean", "median",
               "count_nonzero"}
#: ``x.T`` etc. arrive in ``__torch_function__`` as the property getters
_T_GETTERS, _MT_GETTERS = set(), set()
for _attr in ("T", "mT", "H", "mH"):
    _getter = getattr(getattr(torch.Tensor, _attr, None), "__get__", None)
    if _getter is not None:
        _T_GETTERS.add(_getter)
        if _attr.startswith("m"):
            _MT_GETTERS.add(_getter)


def _getitem_bdim(index, nd: int, bdim: int) -> int:
    """Position of the batch dimension after basic indexing (ints, slices, None, ``...``); -1 when
    the batch is indexed (anything but a full slice) or for advanced indexing."""
    index = index if isinstance(index, tuple) else (index,)
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) or isinstance(i, bool)
           for i in index):
        return -1
    consumed = sum(1 for i in index if i is not None and i is not Ellipsis)
    if consumed > nd or sum(1 for i in index if i is Ellipsis) > 1:
        return -1
    d = o = 0  # input and output positions
    for i in index:
        if i is None:
            o += 1
        elif i is Ellipsis:
            k = nd - consumed
            if d <= bdim < d + k:
                return o + bdim - d
            d += k
            o += k
        else:
            if d == bdim:
                return o if isinstance(i, slice) and i == slice(None) else -1
            d += 1
            o += isinstance(i, slice)
    return o + bdim - d  # after the index: dims kept in order


_EMBEDDINGS = {F.embedding, torch.embedding, F.one_hot}
_UNSQUEEZES = {torch.Tensor.unsqueeze, torch.unsqueeze}
_UNBINDS = {torch.Tensor.unbind, torch.unbind, torch.Tensor.select, torch.select}
_RESHAPES = {torch.Tensor.reshape, torch.reshape, torch.Tensor.view, torch.Tensor.flatten,
             torch.flatten, torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.unflatten}


def _is_reshape_of(t: torch.Tensor, p: torch.Tensor) -> bool:
    """True when ``t`` holds ``p``'s elements in ``p``'s order (p itself or a contiguous view of
    it)."""
    if t is p:
        return True
    return (t._base is p and t.numel() == p.numel() and t.is_contiguous() and p.is_contiguous()
            and t.storage_offset() == p.storage_offset())


#: ops that ``_out_bdim`` handles before its same-rank rule (they can move the batch dimension
#: without changing the rank); any other op of the same rank keeps the batch where it was when its
#: size is unchanged
_MOVES_BATCH = (_TRANSPOSES | _PERMUTES | _MOVEDIMS | _UNBINDS | _UNSQUEEZES | _RESHAPES
                | _T_GETTERS | {torch.Tensor.__getitem__, torch.Tensor.t, torch.t})
