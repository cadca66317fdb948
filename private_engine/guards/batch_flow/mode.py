"""The tracker: a ``TorchDispatchMode`` open from the model's first forward of a step until the
engine takes the step's loss, tagging every tensor an aten op produces."""
from __future__ import annotations

import contextlib
import sys
import warnings
import weakref
from types import FrameType
from typing import Any, Dict, List, NamedTuple, Optional, Set, Tuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.parameter import UninitializedTensorMixin
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _get_current_dispatch_mode_stack,
)

from ...capture.fallback import replaying
from ..separability import BatchMixingError
from .rules import (
    _OPS,
    ADDMM,
    IDENTITY,
    LAYER_NORM,
    POINTWISE,
    add_matmul,
    aligned,
    flat_tensors,
    inputs_of,
    is_pointwise,
    normalised_rows,
    op_info,
    pointwise,
    summed,
    written,
)
from .tags import Iota, Mix, Mixed, Rows, Summed, join, mixed, reshape_rows, user_line

aten = torch.ops.aten
#: the tracker whose region is open in this process (one at a time: a new region closes another
#: tracker's, so no mode is left on the dispatch stack by an engine whose step never came)
_OPEN: List["BatchFlow"] = []
#: stored for an output of the batch's leading size computed from no sample, so that it is not
#: taken for per-sample data that entered from outside the step
_FREE = ("free",)
_STALE = Mixed("a value computed from an earlier batch and kept (state carried across steps by "
               "the model or the loop)")
_UNSEEN = "a differentiable value computed out of the batch flow's sight"
_Tensor = torch.Tensor
_UNREAD = object()  # not in an op's memo of its inputs' tags
_REWRITTEN = ("a view or alias of a tensor that was rewritten in place with other samples' "
              "rows")


class CompiledStepWarning(UserWarning):
    """A private step of a ``torch.compile``'d model runs eagerly (exact, not faster)."""


class _Entry(NamedTuple):
    ref: weakref.ref
    tag: Any
    epoch: int  # 0: data from outside the model's inputs; else the region that computed it
    clock: int  # when the tag was set (orders writes to a base against its views' tags)
    source: str  # "input" (a forward's argument), "guess" (outside data), "computed" (an op's)


_new_entry = tuple.__new__  # _new_entry(_Entry, fields): an _Entry without a Python frame


class _Write(NamedTuple):
    clock: int
    before: Any
    after: Any
    #: the storage written (weakly): once torch's allocator has it back, a tensor it hands out at
    #: the same address holds none of the values written (:meth:`BatchFlow._write_to`)
    storage: Optional[StorageWeakRef] = None
    #: whether torch's allocator owns that memory (else a NumPy or other outside buffer: it keeps
    #: the values written after the storage over it is gone; or unknown)
    owned: bool = False


class BatchFlow(TorchDispatchMode):
    """Tags the tensors of a step's forward and of the user's loss with the samples they depend
    on (:mod:`private_engine.guards.batch_flow`).

    ``install()`` registers a forward pre-hook on ``model`` and on each of its submodules: the
    first forward with grad enabled on a batch of two or more samples opens a *region* (the mode
    goes on the dispatch stack) and tags the forward's tensor arguments of the batch's size along
    ``batch_dim`` (the largest such size among them) as its rows — at the model's own forward, or
    at the first submodule a loop calls directly. The region ends when the engine takes the loss
    (:meth:`check_loss`: the native door's per-sample losses, the Opacus door's criterion;
    :meth:`check_root`: the start of the Opacus door's plain ``backward()``), at a model forward
    that raised or runs without grad, or at a model forward on a batch of another size (which
    starts the next region). What the region computed keeps its tags after it ends: a loss is
    checked all the same, and a value of an earlier region used in a later one mixes.
    """

    def __init__(self, model: nn.Module, batch_dim: int = 0,
                 openers: Optional[Dict[nn.Module, int]] = None):
        super().__init__()
        self.model = model
        self.batch_dim = batch_dim
        #: ``{module: batch dim of its input}``: when given, only these modules open a region, at
        #: their first call (the Opacus door's ``batch_first=False``, where the model's own inputs
        #: may hold the batch in either dimension and only the layers' convention is known)
        self.openers = openers
        #: rows of the model's batch inputs in the current or last region (None: none yet)
        self.batch: Optional[int] = None
        self.active = False
        self.pushed = False
        self.epoch = 0
        self._clock = 0
        self._tags: Dict[int, _Entry] = {}
        #: while an op's rule runs: ``{id(input): tag}`` of the op's inputs, read before it ran
        #: (reading one again gives the same tag: nothing is tagged between the two reads)
        self._memo: Optional[Dict[int, Any]] = None
        self._writes: Dict[int, _Write] = {}
        #: the expanded outputs of :meth:`broadcast_rows`: id → (tensor, the layer's name)
        self._shared: Dict[int, Tuple[weakref.ref, str]] = {}
        self._buffers: set = set()
        self._state_storages: Set[int] = set()
        self._modules = list(model.modules())
        self._handles: list = []
        self._warned_compiled = False
        #: storages (data pointers) written in place during the region: the step state guard
        #: reads them (a write through ``.data`` moves no version counter)
        self.written_storages: Set[int] = set()
        #: the last differentiable scalar the region computed, and the tensors a
        #: ``torch.autograd.backward`` started from during it (the Opacus door's loss)
        self.last_scalar: Optional[weakref.ref] = None
        self.roots: List[weakref.ref] = []
        _record_backward_roots()

    # -- installation --------------------------------------------------------------------------
    def install(self) -> "BatchFlow":
        """Register the forward pre-hooks (again after :meth:`remove`); returns the tracker."""
        if not self._handles:
            self._handles = [
                self.model.register_forward_pre_hook(self._pre_model, with_kwargs=True,
                                                     prepend=True),
                self.model.register_forward_hook(self._post, always_call=True)]
            self._handles += [m.register_forward_pre_hook(self._pre_submodule, with_kwargs=True,
                                                          prepend=True)
                              for m in self.model.modules()
                              if m is not self.model or self.openers is not None]
        return self

    def remove(self) -> None:
        """Remove the hooks and close any open region."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.end()

    # -- regions -------------------------------------------------------------------------------
    def _batch_of(self, args, kwargs) -> Tuple[int, List[torch.Tensor]]:
        bd = self.batch_dim
        tensors = [t for t in inputs_of(args, kwargs) if t.dim() > bd]
        return max((t.shape[bd] for t in tensors), default=0), tensors

    def _pre_model(self, module, args, kwargs):
        if replaying():
            return None
        if not torch.is_grad_enabled():
            self.end()  # an evaluation forward: a step's region does not span it
            return None
        _eager_for_the_rest_of_a_compiled_call()
        if self.openers is not None:
            self.end()  # a new forward: its first layer opens the next region
            return None
        n, tensors = self._batch_of(args, kwargs)
        if self.active and n != self.batch:
            self.end()
        self._open(n, tensors)
        return None

    def _pre_submodule(self, module, args, kwargs):
        if self.active or replaying() or not torch.is_grad_enabled():
            return None
        if self.openers is not None:
            if module not in self.openers:
                return None
            self.batch_dim = self.openers[module]
        n, tensors = self._batch_of(args, kwargs)  # a submodule the loop calls directly
        if n > 1 and _forward_called_directly(self.model):
            raise BatchMixingError(
                f"the model's forward was called directly (model.forward(x), or "
                f"torch.compile(model.forward)), which skips its forward hooks: the batch flow "
                f"would start at {type(module).__name__}, and whatever the forward computed "
                "before it (a mean or a sort over the batch) would pass as the batch's data. "
                "Call the model itself, model(x) (or torch.compile(model)(x)); nothing was "
                "released.")
        self._open(n, tensors)
        return None

    def _open(self, n: int, tensors: List[torch.Tensor]) -> None:
        if n <= 1:  # one sample cannot be mixed with another
            return
        if not self.active:
            self.begin(n)
        for t in tensors:
            if t.shape[self.batch_dim] != n:
                continue
            entry = self._tags.get(id(t))
            if entry is not None and entry.ref() is t and entry.epoch and (
                    entry.source == "computed" or not isinstance(entry.tag, Rows)):
                # computed by the model (this step's, or an earlier one's: state carried
                # across steps), or data already mixed: its tag stands
                continue
            self._set(t, Rows(self.batch_dim, 1, 0, n), self.epoch, "input")

    def _post(self, module, args, output):
        if sys.exc_info()[0] is not None:
            self.end()  # the forward raised: no loss of this step will come
        return None

    def begin(self, rows: int) -> None:
        """Open a region whose batch inputs have ``rows`` rows (closing another tracker's)."""
        for other in list(_OPEN):
            if other is not self:
                other.end()
        _OPEN[:] = [self]
        _tidy()
        self.batch = rows
        self.active = True
        self.epoch += 1
        self.last_scalar = None
        self.roots = []
        self.written_storages = set()
        self._writes = {}
        self._shared = {}
        self._buffers = {id(b) for m in self._modules for b in m._buffers.values()}
        #: storages of the model's parameters and buffers: a write to them is the step state
        #: guard's to refuse (it names the parameter and the fix)
        self._state_storages = {_storage(t) for m in self._modules
                                for t in (*m._parameters.values(), *m._buffers.values())
                                if t is not None}
        if not any(m is self for m in _get_current_dispatch_mode_stack()):
            with _through_compiled_call() as compiled:
                self.__enter__()
            if compiled and not self._warned_compiled:
                self._warned_compiled = True
                warnings.warn(
                    "the training forward of a torch.compile'd model runs eagerly during "
                    "private steps: the batch flow follows every op of the step, and "
                    "torch.compile compiles no code while it does (forwards under "
                    "torch.no_grad() stay compiled). The update is the uncompiled model's.",
                    CompiledStepWarning, stacklevel=2)
        self.pushed = True

    def end(self) -> None:
        """Close the region. The mode leaves the dispatch stack when it is on top and no backward
        is running (autograd restores the stack it started with, so a pop inside a backward hook
        would not last); otherwise it stays, passing every op through, until a later region's
        start or the next :meth:`end` outside a backward takes it off."""
        self.active = False
        if self in _OPEN:
            _OPEN.remove(self)
        _tidy()

    # -- checks --------------------------------------------------------------------------------
    def check_loss(self, loss: torch.Tensor) -> None:
        """Raise :class:`BatchMixingError` unless entry j of the loss vector depends on sample j
        alone (``Rows(0, per=1)`` with ``L | mod`` and ``off ≡ 0 (mod L)`` for L entries); a
        loss the region did not compute (after a forward without grad or on another batch) is
        refused too. The region ends either way."""
        try:
            if self.batch is None or loss.dim() != 1 or loss.shape[0] <= 1:
                return
            tag = self.tag(loss)
            if tag is None and loss.requires_grad:
                raise BatchMixingError(
                    "the per-sample loss was not computed while the batch flow followed the step "
                    "(a forward without grad, or on a batch of another size, ran between the "
                    "training forward and the loss): compute the loss right after the "
                    "training forward; nothing was released.")
            _refuse_unseen(tag, "per-sample loss")
            if isinstance(tag, Mixed):
                raise BatchMixingError(
                    "the per-sample loss mixes samples: entry i of the loss vector depends on "
                    f"other samples' data through {tag.why}. Per-sample clipping bounds a "
                    "sample's influence only when each loss entry is a function of that sample "
                    "alone; nothing was released. " + advice(tag.why))
            if isinstance(tag, Summed):
                raise BatchMixingError(
                    f"the loss vector is a sum over the batch ({tag.how}), not one loss per "
                    "sample: compute it with reduction=\"none\" and reduce each sample's rows "
                    "alone; nothing was released.")
            if isinstance(tag, Rows):
                self._check_loss_rows(loss.shape[0], tag)
        finally:
            self.end()

    def _check_loss_rows(self, entries: int, tag: Rows) -> None:
        if self.batch % entries:
            raise BatchMixingError(
                f"the loss vector has {entries} entries for a batch of {self.batch} rows: give "
                "one loss per sample, in batch order (reduction=\"none\", e.g. "
                "F.cross_entropy(logits, y, reduction=\"none\")); nothing was released.")
        if tag.dim != 0 or tag.per != 1 or tag.mod % entries or tag.off % entries:
            raise BatchMixingError(
                f"the loss vector's {entries} entries are not one per sample in batch order: "
                f"entry j depends on the model's input rows ≡ {tag.off} + j (mod {tag.mod})"
                + (f", {tag.per} entries per row" if tag.per != 1 else "")
                + f", while input row i is sample i mod {entries}. Give the loss of sample j "
                "at entry j (reduce each sample's rows, e.g. loss.view(B, -1).mean(1), with "
                "reduction=\"none\"); nothing was released.")

    def check_outputs(self, outputs: Any) -> None:
        """Raise :class:`BatchMixingError` (and close the region) if a tensor the model returned
        mixes samples: the rows of every non-scalar output must be the inputs' own. A scalar
        output (a loss the model computes) is checked if ``backward()`` starts from it
        (:meth:`check_root`)."""
        if not self.active:
            return
        for t in flat_tensors(outputs):
            if t.dim() == 0:
                continue
            tag = self.tag(t)
            if isinstance(tag, Rows) and (tag.mod != self.batch or tag.off % tag.mod):
                tag = Mixed("an output whose rows are not the inputs' rows in batch order")
            if isinstance(tag, Summed):
                tag = Mixed(f"an output summed over the batch ({tag.how})")
            if isinstance(tag, Mixed):
                self.end()
                _refuse_unseen(tag, "model's output")
                raise BatchMixingError(
                    f"the model's output mixes samples: it depends on other samples' data "
                    f"through {tag.why}. Per-sample clipping bounds a sample's influence "
                    "only when row i of every output is a function of sample i alone; "
                    "nothing was released. " + advice(tag.why))

    def check_root(self) -> None:
        """At the start of a plain ``backward()`` (the Opacus door's hooks): raise
        :class:`BatchMixingError` if what the backward started from — the tensors given to
        ``torch.autograd.backward`` during the region, else the region's last differentiable
        scalar — is not a sum over the batch of per-sample terms (or per-sample rows weighted by
        values of no other sample). The region ends either way."""
        try:
            if not self.active:
                return
            roots = [r() for r in self.roots] or [self.last_scalar() if self.last_scalar
                                                  else None]
            for t in roots:
                tag = None if t is None else self.tag(t)
                if isinstance(tag, Summed) and tag.mod != self.batch:
                    tag = Mixed(f"a sum over the batch of terms that each hold several input "
                                f"rows ({tag.how}; rows paired modulo {tag.mod})")
                if isinstance(tag, Rows) and (tag.mod != self.batch or tag.off % tag.mod):
                    tag = Mixed("per-sample losses whose rows are not the inputs' rows in order")
                _refuse_unseen(tag, "loss")
                if isinstance(tag, Mixed):
                    raise BatchMixingError(
                        f"the loss mixes samples beyond a sum over the batch: it depends on "
                        f"the samples' data through {tag.why}. The hooks clip each sample's "
                        "share of a sum (or a mean over the batch size) of per-sample losses; "
                        "nothing was released. " + advice(tag.why))
        finally:
            self.end()

    # -- shared rows -----------------------------------------------------------------------------
    def broadcast_rows(self, x: torch.Tensor, output: torch.Tensor,
                       name: str = "a layer") -> Optional[torch.Tensor]:
        """A clipped layer's call on one row of no sample's data during a step on ``n > 1``
        batch-first rows (``nn.Embedding`` on Hugging Face's default ``position_ids`` of shape
        ``(1, T)``): ``output.expand(n, …)``, tagged as the batch's rows ``Rows(0, mod=n)``;
        None for any other call.

        The model broadcasts the shared row against the batch later; expanding it at the layer
        gives the same values, and the tag makes every later op that would combine row i with
        another sample's row (a reduction over the batch, an index across it) a mixing this
        tracker refuses. Rows kept apart, loss entry i reaches row i alone, so the gradient
        at row i of the expanded output is sample i's, ``∂L_i/∂y``.

        The expansion is what the model's own broadcast would do only where the row meets the
        batch in an elementwise op: any other use of the expanded output (a reshape, an index, a
        reduction, an op with constants alone — where the model would see one row, not n, and
        could read the batch size from its shape) is refused before it runs
        (:meth:`_check_shared`), naming the layer ``name``."""
        if not (self.active and self.batch_dim == 0 and self.batch is not None
                and self.batch > 1):
            return None
        if x.dim() == 0 or x.shape[0] != 1 or output.dim() == 0 or output.shape[0] != 1:
            return None
        if not all(tag is None or isinstance(tag, Iota)
                   for tag in (self.tag(x), self.tag(output))):
            return None  # a row of sample data (a model looping over samples): not shared
        expanded = output.expand(self.batch, *output.shape[1:])
        self._set(expanded, Rows(0, 1, 0, self.batch), self.epoch)
        self._shared[id(expanded)] = (weakref.ref(expanded), name)
        return expanded

    def _is_shared(self, t: torch.Tensor) -> bool:
        """``t`` is an expanded shared row (:meth:`broadcast_rows`) or an alias of one."""
        entry = self._shared.get(id(t))
        return entry is not None and entry[0]() is t

    def _check_shared(self, func, inputs: List[torch.Tensor]) -> Optional[str]:
        """Raise :class:`BatchMixingError` if ``func`` uses an expanded shared row
        (:meth:`broadcast_rows`) other than in an elementwise op with the batch's own rows;
        returns the layer's name when the result is a shared row again (an alias; an elementwise
        op on shared rows alone), else None."""
        shared = [(t, self._shared[id(t)][1]) for t in inputs if self._is_shared(t)]
        if not shared:
            return None
        t, name = shared[0]
        if func.overloadpacket in (aten.detach, aten.alias) and len(inputs) == 1:
            return name
        if is_pointwise(func) and len(shared) == len(inputs) and len(inputs) > 1 and all(
                u.shape == t.shape for u, _ in shared):
            return name  # shared rows combined with each other alone: a shared row again
        batch = Rows(0, 1, 0, self.batch)
        if is_pointwise(func) and any(
                not self._is_shared(u) and u.dim() >= t.dim() and self.tag(u) == batch
                for u in inputs):
            return None
        raise BatchMixingError(
            f"the output of layer {name!r} on one row shared by every sample (Hugging Face's "
            f"default position_ids of shape (1, T)) is expanded to the batch's {self.batch} "
            f"rows so that its per-sample gradients can be taken, and {func} uses it other than "
            "by broadcasting it elementwise against the batch (at "
            f"{user_line()}): with the expansion it would see the batch's size. Pass the "
            "inputs expanded yourself (position_ids=torch.arange(T).expand(B, T)); nothing "
            "was released.")

    # -- tags ----------------------------------------------------------------------------------
    def tag(self, t: torch.Tensor):
        """The tag of ``t`` (None: untagged)."""
        memo = self._memo
        if memo is not None:  # an op's rule asking for an input's tag, read before the rule ran
            found = memo.get(id(t), _UNREAD)
            if found is not _UNREAD:
                return found
        return self._entry(t)[0]

    def _entry(self, t: torch.Tensor) -> Tuple[Any, int, str]:
        """``(tag, epoch, source)``: epoch 0 for values computed from data outside the model's
        inputs (the loss's labels), else the region that computed them — a value of an earlier
        region mixes (state kept across steps), and so does a view or alias of a tensor rewritten
        in place since. ``source``: "input", "guess", "data" (computed from those alone) or
        "computed" (through the model's parameters or its computations)."""
        entry = self._tags.get(id(t))
        if entry is not None and entry.ref() is t:
            tag, epoch, source = entry.tag, entry.epoch, entry.source
            if tag is _FREE:
                return None, 0, source
            if epoch and epoch != self.epoch and isinstance(tag, (Rows, Mixed, Summed)):
                return _STALE, self.epoch, source
            if self._writes:
                w = self._write_to(_storage(t))
                if w is not None and w.clock > entry.clock and w.after != w.before:
                    return Mixed(_REWRITTEN), self.epoch, source
            return tag, epoch, source
        if self._writes and not isinstance(t, nn.Parameter):
            ptr = _storage(t)
            w = None if ptr in self._state_storages else self._write_to(ptr)
            if w is not None and w.after is not None and w.after is not _FREE:
                # storage written with the batch's data through an alias (``z.data.copy_``,
                # ``z.detach().copy_``) while ``z`` itself was never tagged
                tag = w.after if isinstance(w.after, (Mixed, Summed)) else Mixed(_REWRITTEN)
                return tag, self.epoch, "computed"
        bd = self.batch_dim
        if (self.active and t.dim() > bd and t.shape[bd] == self.batch
                and not isinstance(t, (nn.Parameter, UninitializedTensorMixin))
                and id(t) not in self._buffers):
            if t.grad_fn is not None:  # differentiable, yet no op of the region made it
                tag = Mixed(_UNSEEN)
                self._set(t, tag, self.epoch)
                return tag, self.epoch, "computed"
            tag = Rows(bd, 1, 0, self.batch)  # per-sample data from outside the step (labels)
            self._set(t, tag, 0, "guess")
            return tag, 0, "guess"
        return None, 0, ("computed" if type(t) is nn.Parameter or isinstance(t, nn.Parameter)
                         else "data")

    def _set(self, t, tag, epoch: int, source: str = "computed") -> None:
        key = id(t)
        tags = self._tags

        def drop(ref, key=key, tags=tags):
            entry = tags.get(key)
            if entry is not None and entry.ref is ref:
                del tags[key]

        self._clock += 1
        tags[key] = _new_entry(_Entry, (weakref.ref(t, drop), tag, epoch, self._clock, source))

    # -- dispatch ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.active:
            return func(*args, **kwargs)
        op = _OPS.get(id(func))
        if op is None or op.func is not func:
            op = op_info(func)
        inputs = inputs_of(args, kwargs) if kwargs else flat_tensors(args)
        alias_of = self._check_shared(func, inputs) if self._shared else None
        out = func(*args, **kwargs)
        single = isinstance(out, _Tensor)  # one output tensor (else a tuple or list of them)
        if alias_of is not None and single:
            self._shared[id(out)] = (weakref.ref(out), alias_of)
        # the inputs' entries (``_entry``, its first case inlined), and what the rules need of
        # them: the first mixed tag, whether one is a sum, whether all are positions or none
        known, now = self._tags, self.epoch
        plain = not self._writes  # no in-place write yet: an entry's tag stands as set
        # an untagged tensor not of the batch's size is no sample's (_entry's last case)
        bd, n = self.batch_dim, (self.batch if self.active else None)
        tags: List[Any] = []
        epoch, computed, free, positions = 0, False, True, True
        found: Optional[Mixed] = None
        summed_in = False
        for t in inputs:
            entry = known.get(id(t)) if plain else None
            if entry is not None and entry.ref() is t:
                _, tag, e, _, src = entry
                if tag is _FREE:
                    tag, e = None, 0
                elif e and e != now and isinstance(tag, (Rows, Mixed, Summed)):
                    tag, e = _STALE, now
            elif plain and (t.dim() <= bd or t.shape[bd] != n):
                tag, e = None, 0
                src = ("computed" if type(t) is nn.Parameter or isinstance(t, nn.Parameter)
                       else "data")
            else:
                tag, e, src = self._entry(t)
            tags.append(tag)
            if e > epoch:
                epoch = e
            if src == "computed":
                computed = True
            if tag is not None:
                free = False
                if tag.__class__ is Rows:
                    positions = False
                elif isinstance(tag, Mixed):
                    if found is None:
                        found = tag
                    positions = False
                elif isinstance(tag, Summed):
                    summed_in = True
                    positions = False
                elif not isinstance(tag, Iota):
                    positions = False
        if free:
            self._mark_free(op, func, args, kwargs, out)
        else:
            result = _UNREAD
            fast = op.fast
            if fast and found is None and not summed_in and (single or fast == LAYER_NORM):
                # the rules of the commonest ops, on the tags read already (one output tensor,
                # or a layer norm's three)
                try:
                    if fast == POINTWISE:  # pointwise(): the operands aligned to the output
                        result = aligned(list(zip(inputs, tags)), tuple(out.shape), self)
                    elif fast == ADDMM:
                        if (len(inputs) == 3 and len(args) >= 3 and inputs[0] is args[0]
                                and inputs[1] is args[1] and inputs[2] is args[2]):
                            # the inputs are self (c), mat1/batch1 (a), mat2/batch2 (b)
                            tc, ta, tb = tags
                            result = add_matmul(
                                self, op.packet is aten.baddbmm,
                                inputs[0], tc if isinstance(tc, Rows) else None,
                                inputs[1], ta if isinstance(ta, Rows) else None,
                                inputs[2], tb if isinstance(tb, Rows) else None, out)
                    elif fast == LAYER_NORM:
                        if (len(inputs) == 3 and len(args) >= 4 and inputs[0] is args[0]
                                and inputs[1] is args[2] and inputs[2] is args[3]):
                            # the inputs are input (x), weight and bias; normalized_shape
                            tx, tw, tb = tags
                            result = normalised_rows(
                                inputs[0], tx if isinstance(tx, Rows) else None,
                                (tw if isinstance(tw, Rows) else None,
                                 tb if isinstance(tb, Rows) else None), args[1])
                    elif len(inputs) == 1:
                        if fast == IDENTITY:  # identity(): the one input's tag
                            result = tags[0]
                        elif tags[0].__class__ is Rows:  # view() on rows
                            result = reshape_rows(tuple(inputs[0].shape), tags[0],
                                                  tuple(out.shape))
                            if result is None:
                                raise Mix("reshapes the batch dimension across several "
                                          "dimensions")
                except Mix as e:
                    result = mixed(func, e.what)
                except Exception as e:  # noqa: BLE001 - as in _result: a refusal, loudly
                    result = mixed(func, f"(its batch layout could not be read: {e!r})")
            if result is _UNREAD:
                result = self._result(op, func, args, kwargs, out, inputs, tags, found,
                                      summed_in, positions)
            source = "computed" if computed else "data"
            if single and not op.mutable and not isinstance(result, list):
                # _assign's common case, _set inlined: the one output takes the result
                key = id(out)

                def drop(ref, key=key, tags=known):
                    entry = tags.get(key)
                    if entry is not None and entry.ref is ref:
                        del tags[key]

                self._clock = clock = self._clock + 1
                known[key] = _new_entry(_Entry, (weakref.ref(out, drop),
                                                 _FREE if result is None else result, epoch,
                                                 clock, source))
            else:
                self._assign(func, args, kwargs, out, result, epoch, source, op.mutable)
        if (single and out.dim() == 0 and out.is_floating_point() and torch.is_grad_enabled()
                and not op.value_free and any(t.requires_grad for t in inputs)):
            self.last_scalar = weakref.ref(out)
        return out

    def _result(self, op, func, args, kwargs, out, inputs, tags, found, summed_in: bool,
                positions: bool):
        """The tag of the op's outputs from its inputs' ``tags`` (``found``: the first mixed
        one; ``summed_in``: one is a sum over the batch; ``positions``: each is a position or
        none): a mixed input mixes (but for a value-free op), a sum goes through :func:`summed`,
        else the op's rule, the pointwise rule, or a refusal."""
        rule = op.rule
        try:
            if found is not None and not op.value_free:
                return found
            if summed_in and not op.value_free:
                return summed(self, func, args, kwargs, tags)
            if rule is not None or op.pointwise:
                self._memo = {id(t): tag for t, tag in zip(inputs, tags)}
                try:
                    return (rule or pointwise)(self, func, args, kwargs, out)
                finally:
                    self._memo = None
            if positions:
                return None  # positions only: no sample's data
            return mixed(func, "(an op whose batch layout is not followed) on the batch")
        except Mix as e:
            return mixed(func, e.what)
        except Exception as e:  # noqa: BLE001 - a rule that cannot read the op refuses, loudly
            return mixed(func, f"(its batch layout could not be read: {e!r})")

    def _mark_free(self, op, func, args, kwargs, out) -> None:
        bd, n = self.batch_dim, self.batch
        positional = op.positional
        exact = positional and op.packet is aten.arange and _plain_arange(func, args, kwargs)
        for t in (out,) if isinstance(out, torch.Tensor) else flat_tensors(out):
            if positional and t.dim() == 1:
                self._set(t, Iota(0, exact), 0)
            elif t.dim() > bd and t.shape[bd] == n:
                self._set(t, _FREE, 0)
        if op.mutable:  # an in-place write of values of no sample
            for t in written(func, args, kwargs):
                self._note_storage(t)

    def _assign(self, func, args, kwargs, out, result, epoch: int,
                source: str = "computed", mutable: Optional[bool] = None) -> None:
        """Tag the outputs (``result``: one tag, or one per output tensor) and, for an in-place
        op, the tensor it wrote and that tensor's base when it is a view; a write that changes
        what a base holds makes the views taken of it before mixed (their rows are no longer the
        ones they were tagged with). ``mutable``: whether the op's schema writes an argument
        (read from it when not given)."""
        if mutable is None:
            mutable = func._schema.is_mutable
        if not mutable:  # the common case: tag the outputs
            if isinstance(out, torch.Tensor):
                if isinstance(result, list):
                    if result:
                        self._set(out, _FREE if result[0] is None else result[0], epoch, source)
                else:
                    self._set(out, _FREE if result is None else result, epoch, source)
                return
            outs = flat_tensors(out)
            results: List[Any] = result if isinstance(result, list) else [result] * len(outs)
            for t, r in zip(outs, results):
                self._set(t, _FREE if r is None else r, epoch, source)
            return
        outs = flat_tensors(out)
        results = result if isinstance(result, list) else [result] * len(outs)
        targets = written(func, args, kwargs)
        ids = {id(t) for t in targets}
        for t, r in zip(outs, results):
            if id(t) not in ids:
                self._set(t, _FREE if r is None else r, epoch, source)
        r = results[0] if results else None
        for t in targets:
            self._note_storage(t)
            base = t if t._base is None else t._base
            before = self.tag(base)
            self._clock += 1
            clock = self._clock  # before t's and its base's new tags: older views compare to it
            self._set(t, _FREE if r is None else r, epoch, source)
            if base is not t and r is not None:
                self._write_base(base, t, r, epoch)
            ptr = _storage(t)
            if ptr:
                storage = t.untyped_storage()
                self._writes[ptr] = _Write(clock, before, self.tag(base), StorageWeakRef(storage),
                                           storage.resizable())

    def _write_to(self, ptr: int) -> Optional[_Write]:
        """The last in-place write of the region to the storage at address ``ptr``
        (:func:`_storage`); None where there was none, or where the storage written is gone and
        its memory was torch's (the allocator's block handed out again: a tensor there now was
        allocated after the write and holds none of its values)."""
        w = self._writes.get(ptr) if ptr else None
        if w is not None and w.owned and w.storage is not None and w.storage.expired():
            del self._writes[ptr]
            return None
        return w

    def _note_storage(self, t) -> None:
        """The storage an in-place op wrote (read by the step state guard: a write through
        ``.data`` moves no version counter)."""
        ptr = _storage(t)
        if ptr:
            self.written_storages.add(ptr)

    def _write_base(self, base, view, tag, epoch: int) -> None:
        """A view was written with rows ``tag``: its base holds them too."""
        old, old_epoch, _ = self._entry(base)
        epoch = max(epoch, old_epoch)
        if isinstance(tag, (Mixed, Summed)) or isinstance(old, Mixed):
            self._set(base, old if isinstance(old, Mixed) else
                      (tag if isinstance(tag, Mixed) else
                       Mixed(f"a sum over the batch written into a view (at {user_line()})")),
                      epoch)
            return
        if not isinstance(tag, Rows):
            return
        same_dim = (view.dim() == base.dim() and view.shape[tag.dim] == base.shape[tag.dim])
        try:
            if same_dim and not isinstance(old, Rows):
                self._set(base, tag, epoch)
            elif same_dim:
                self._set(base, join(old, tag), epoch)
            else:
                raise Mix("")
        except Mix:
            self._set(base, Mixed("a write of per-sample rows into a view whose rows are not "
                                  f"the batch's (at {user_line()})"), epoch)


def _forward_called_directly(model: nn.Module) -> bool:
    """Whether ``model``'s forward is running on this thread's stack without ``model(...)``
    around it (``model.forward(x)``; under ``torch.compile(model.forward)`` its frames keep the
    name ``forward``, or ``torch_dynamo_resume_in_forward…`` after a graph break), so that the
    model's forward pre-hooks did not run."""
    in_forward = False
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        if frame.f_locals.get("self") is model:
            name = frame.f_code.co_name
            if "_call_impl" in name:  # Module.__call__: the hooks ran
                return False
            if name == "forward" or name.startswith("torch_dynamo_resume_in_forward"):
                in_forward = True
        frame = frame.f_back
    return in_forward


def _refuse_unseen(tag, what: str) -> None:
    """Raise :class:`BatchMixingError` if ``tag`` marks a value computed out of the tracker's
    sight: whether it mixes samples cannot be told, so the step is refused."""
    if isinstance(tag, Mixed) and tag.why == _UNSEEN:
        raise BatchMixingError(
            f"the batch flow could not follow the step: the {what} depends on a differentiable "
            "value computed where the tracker does not see the ops (code that bypasses torch's "
            "dispatcher, or a value computed with grad before the step's forward), so whether "
            "it mixes samples cannot be checked; nothing was released. Compute everything that "
            "depends on the batch inside the step's forward and loss.")


def advice(why: str) -> str:
    """What to change, for the kind of mixing ``why`` describes."""
    if ("nll_loss" in why or "reduction" in why or "reduces over the batch" in why
            or "sum over the batch" in why):
        return ("A loss averaged over the batch (dividing by a count over all samples, as "
                "reduction=\"mean\" does, with or without ignore_index) couples samples: compute "
                "each sample's loss from its own rows, e.g. with reduction=\"none\" and "
                "(token_loss * mask).sum(1) / mask.sum(1).clamp(min=1).")
    return ("Compute every op per sample: no reduction, sort, softmax, flip, roll or index over "
            "the batch dimension, and no value kept from an earlier batch.")


def _plain_arange(func, args, kwargs) -> bool:
    """``arange(n)`` or ``arange(0, n)`` with step 1: the positions ``0, …, n−1``."""
    name = func._overloadname
    if name in ("default", "out"):
        return True
    start = args[0] if args else kwargs.get("start", 0)
    step = (args[2] if len(args) > 2 else kwargs.get("step", 1)) if name.startswith("start_step") \
        else 1
    return start == 0 and step == 1


def _storage(t: torch.Tensor) -> int:
    """The data pointer of ``t``'s storage (views and aliases share it), 0 when it has none."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tidy() -> None:
    """Take closed trackers off the top of the dispatch stack (never inside a backward)."""
    if _in_backward():
        return
    while True:
        top = _get_current_dispatch_mode()
        if not (isinstance(top, BatchFlow) and not top.active):
            return
        with _through_compiled_call():
            top.__exit__(None, None, None)
        top.pushed = False


def _eager_for_the_rest_of_a_compiled_call() -> None:
    """Inside a ``torch.compile`` call, switch Dynamo's frame callback off until the call
    returns (the call puts back the callback it found): a training forward runs eagerly.

    With the batch flow's mode on the stack Dynamo compiles nothing and runs nothing compiled,
    but would still inspect every Python frame of the forward to skip it (the cost of the whole
    step again on a small ViT); on a batch of one sample (no region, no mode) it would trace the
    engine's own capture code between the layers."""
    if "torch._dynamo" not in sys.modules:
        return
    with _through_compiled_call() as compiled:
        pass
    if compiled:
        torch._C._dynamo.eval_frame.set_eval_frame(None)


_MODE_KEYS = (torch._C.DispatchKey.Python, torch._C.DispatchKey.PythonTLSSnapshot)


@contextlib.contextmanager
def _through_compiled_call():
    """Make a push or pop of the mode outlast the ``torch.compile`` calls it happens in; yields
    whether such a call is running.

    A compiled call (``torch.compile(model)(x)``) saves the thread's dispatch keys when it starts
    and restores them when it returns. A mode pushed inside it — by the model's forward pre-hook,
    which opens the step's region — would stay on the mode stack with its dispatch key switched
    off: every op after the call (the user's loss) would run unseen. So the keys each running
    compiled call saved (one per nesting level) are taken back, the change is made, and every
    level is saved again as it was but for the mode's keys, which are set as the change left
    them."""
    restore = getattr(torch._C, "_dynamo_restore_local_dispatch_key_set", None)
    if restore is None or "torch._dynamo" not in sys.modules:  # nothing compiled in this process
        yield False
        return
    levels = []
    while True:
        now = (torch._C._dispatch_tls_local_include_set(),
               torch._C._dispatch_tls_local_exclude_set())
        try:
            restore()
        except RuntimeError:  # nothing (more) saved
            break
        levels.append((torch._C._dispatch_tls_local_include_set(),
                       torch._C._dispatch_tls_local_exclude_set()))
        if len(levels) == 1:
            current = now
    if not levels:  # no compiled call is running
        yield False
        return
    want = [torch._C._dispatch_tls_is_dispatch_key_included(k) for k in _MODE_KEYS]
    try:
        with torch._C._ForceDispatchKeyGuard(*current):
            try:
                yield True
            finally:
                want = [torch._C._dispatch_tls_is_dispatch_key_included(k) for k in _MODE_KEYS]
    finally:
        for include, exclude in [*reversed(levels), current]:  # outermost first, then ours
            with torch._C._ForceDispatchKeyGuard(include, exclude):
                for key, on in zip(_MODE_KEYS, want):
                    torch._C._dispatch_tls_set_dispatch_key_included(key, on)
                torch._C._dynamo_save_local_dispatch_key_set()
        restore()  # the thread's keys, with the mode's as the change left them


_BACKWARD = None
_GRAD = None


def _record_backward_roots() -> None:
    """Wrap ``torch.autograd.backward`` (``Tensor.backward`` calls it) and
    ``torch.autograd.grad`` once per process, so that an open region learns what a backward
    starts from, and the gradients given for it."""
    global _BACKWARD, _GRAD
    if _BACKWARD is not None:
        return
    _BACKWARD, _GRAD = torch.autograd.backward, torch.autograd.grad

    def note(outputs, grads) -> None:
        # a backward the user starts (not one run inside another: the engine's own vjps)
        if _OPEN and _OPEN[0].active and not _in_backward():
            _OPEN[0].roots = [weakref.ref(t) for t in flat_tensors((outputs, grads))]

    def backward(tensors, grad_tensors=None, *args, **kwargs):
        note(tensors, grad_tensors)
        return _BACKWARD(tensors, grad_tensors, *args, **kwargs)

    def grad(outputs, inputs=None, grad_outputs=None, *args, **kwargs):
        note(outputs, grad_outputs)
        return _GRAD(outputs, inputs, grad_outputs, *args, **kwargs)

    for wrapper, original in ((backward, _BACKWARD), (grad, _GRAD)):
        wrapper.__doc__ = original.__doc__
        wrapper.__wrapped__ = original
    torch.autograd.backward, torch.autograd.grad = backward, grad
