"""The tracker: a ``TorchDispatchMode`` open from the model's first forward of a step until the
engine takes the step's loss, tagging every tensor an aten op produces."""
from __future__ import annotations

import sys
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.parameter import UninitializedTensorMixin
from torch.utils._python_dispatch import (TorchDispatchMode, _get_current_dispatch_mode,
                                          _get_current_dispatch_mode_stack)

from ...capture.fallback import replaying
from ..separability import BatchMixingError
from .rules import RULES, VALUE_FREE, flat_tensors, is_pointwise, pointwise, summed, written
from .tags import Iota, Mix, Mixed, Rows, Summed, first_mixed, join, mixed, user_line

aten = torch.ops.aten
#: the tracker whose region is open in this process (one at a time: a new region closes another
#: tracker's, so no mode is left on the dispatch stack by an engine whose step never came)
_OPEN: List["BatchFlow"] = []
#: stored for an output of the batch's leading size computed from no sample, so that it is not
#: taken for per-sample data that entered from outside the step
_FREE = ("free",)


class BatchFlow(TorchDispatchMode):
    """Tags the tensors of a step's forward and of the user's loss with the samples they depend
    on (:mod:`private_engine.guards.batch_flow`).

    ``install()`` registers a forward pre-hook on ``model``: a forward with grad enabled on a batch
    of two or more samples opens a *region* (the mode goes on the dispatch stack) and tags the
    model's tensor arguments of the batch's size along ``batch_dim`` as its rows. The region ends
    when the engine takes the loss (:meth:`check_loss`: the native door's per-sample losses, the
    Opacus door's criterion; :meth:`check_root`: the start of the Opacus door's plain
    ``backward()``), at a forward that raised or runs without grad, or at a forward on a batch of
    another size (which starts the next region).
    """

    def __init__(self, model: nn.Module, batch_dim: int = 0):
        super().__init__()
        self.model = model
        self.batch_dim = batch_dim
        #: rows of the model's batch inputs in the open region (None: no region)
        self.batch: Optional[int] = None
        self.active = False
        self.pushed = False
        self.epoch = 0
        self._tags: Dict[int, Tuple[weakref.ref, Any, int]] = {}
        self._buffers: set = set()
        self._handles: list = []
        #: the last differentiable scalar the region computed (the loss a plain ``backward()`` of
        #: the Opacus door starts from)
        self.last_scalar: Optional[weakref.ref] = None

    # -- installation --------------------------------------------------------------------------
    def install(self) -> "BatchFlow":
        """Register the forward pre-hook (again after :meth:`remove`); returns the tracker."""
        if not self._handles:
            self._handles = [
                self.model.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True),
                self.model.register_forward_hook(self._post, always_call=True)]
        return self

    def remove(self) -> None:
        """Remove the hook and close any open region."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.end()

    # -- regions -------------------------------------------------------------------------------
    def _pre(self, module, args, kwargs):
        if replaying():
            return None
        if not torch.is_grad_enabled():
            self.end()  # an evaluation forward: a step's region does not span it
            return None
        bd = self.batch_dim
        tensors = flat_tensors((args, kwargs))
        first = next((t for t in tensors if t.dim() > bd), None)
        if first is None:
            return None
        n = first.shape[bd]
        if self.active and n != self.batch:
            self.end()
        if n <= 1:  # one sample cannot be mixed with another
            return None
        if not self.active:
            self.begin(n)
        for t in tensors:
            if t.dim() > bd and t.shape[bd] == n:
                self._set(t, Rows(bd, 1, 0, n), self.epoch)
        return None

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
        self._buffers = {id(b) for b in self.model.buffers()}
        if not any(m is self for m in _get_current_dispatch_mode_stack()):
            self.__enter__()
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
        alone (``Rows(0, per=1)`` with ``L | mod`` and ``off ≡ 0 (mod L)`` for L entries, or no
        sample at all); the region ends either way."""
        try:
            if not self.active or loss.dim() != 1 or loss.shape[0] <= 1:
                return
            tag = self.tag(loss)
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
                raise BatchMixingError(
                    f"the model's output mixes samples: it depends on other samples' data "
                    f"through {tag.why}. Per-sample clipping bounds a sample's influence "
                    "only when row i of every output is a function of sample i alone; "
                    "nothing was released. " + advice(tag.why))

    def check_root(self) -> None:
        """At the start of a plain ``loss.backward()`` (the Opacus door's hooks): raise
        :class:`BatchMixingError` if the last differentiable scalar of the region — the loss — is
        not a sum over the batch of per-sample terms; the region ends either way."""
        try:
            if not self.active or self.last_scalar is None:
                return
            loss = self.last_scalar()
            tag = None if loss is None else self.tag(loss)
            if isinstance(tag, Mixed):
                raise BatchMixingError(
                    f"the loss mixes samples beyond a sum over the batch: it depends on the "
                    f"samples' data through {tag.why}. The hooks clip each sample's share of a "
                    "sum (or mean over the batch size) of per-sample losses; nothing was "
                    "released. " + advice(tag.why))
        finally:
            self.end()

    # -- tags ----------------------------------------------------------------------------------
    def tag(self, t: torch.Tensor):
        """The tag of ``t`` in the open region (None: untagged)."""
        return self._entry(t)[0]

    def _entry(self, t: torch.Tensor) -> Tuple[Any, int]:
        """``(tag, epoch)``: epoch 0 for values computed from data outside the model's inputs (the
        loss's labels), else the region that computed them — a value of an earlier region mixes
        (state kept across steps)."""
        entry = self._tags.get(id(t))
        if entry is not None and entry[0]() is t:
            tag, epoch = entry[1], entry[2]
            if tag is _FREE:
                return None, 0
            if epoch and epoch != self.epoch and isinstance(tag, (Rows, Mixed)):
                return Mixed("a value computed from an earlier batch and kept (state carried "
                             "across steps by the model or the loop)"), self.epoch
            return tag, epoch
        bd = self.batch_dim
        if (not isinstance(t, (nn.Parameter, UninitializedTensorMixin)) and t.dim() > bd
                and t.shape[bd] == self.batch and id(t) not in self._buffers):
            tag = Rows(bd, 1, 0, self.batch)  # per-sample data from outside the step (labels)
            self._set(t, tag, 0)
            return tag, 0
        return None, 0

    def _set(self, t, tag, epoch: int) -> None:
        key = id(t)
        tags = self._tags

        def drop(ref, key=key, tags=tags):
            entry = tags.get(key)
            if entry is not None and entry[0] is ref:
                del tags[key]

        tags[key] = (weakref.ref(t, drop), tag, epoch)

    # -- dispatch ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.active:
            return out
        entries = [self._entry(t) for t in flat_tensors((args, kwargs))]
        tags = [tag for tag, _ in entries]
        if all(tag is None for tag in tags):
            self._mark_free(func, out)
            return out
        epoch = max(e for _, e in entries)
        rule = RULES.get(func.overloadpacket)
        found = first_mixed(tags)
        try:
            if found is not None and rule not in VALUE_FREE:
                result = found
            elif rule not in VALUE_FREE and any(isinstance(t, Summed) for t in tags):
                result = summed(self, func, args, kwargs, tags)
            elif rule is not None:
                result = rule(self, func, args, kwargs, out)
            elif is_pointwise(func):
                result = pointwise(self, func, args, kwargs, out)
            elif all(tag is None or isinstance(tag, Iota) for tag in tags):
                result = None  # positions only: no sample's data
            else:
                result = mixed(func, "(an op whose batch layout is not followed) on the batch")
        except Mix as e:
            result = mixed(func, e.what)
        except Exception as e:  # noqa: BLE001 - a rule that cannot read the op refuses, loudly
            result = mixed(func, f"(its batch layout could not be read: {e!r})")
        self._assign(func, args, kwargs, out, result, epoch)
        if isinstance(out, torch.Tensor) and out.dim() == 0 and out.requires_grad:
            self.last_scalar = weakref.ref(out)
        return out

    def _mark_free(self, func, out) -> None:
        bd, n = self.batch_dim, self.batch
        arange = func.overloadpacket is aten.arange
        for t in flat_tensors(out):
            if arange and t.dim() == 1:
                self._set(t, Iota(0), 0)
            elif t.dim() > bd and t.shape[bd] == n:
                self._set(t, _FREE, 0)

    def _assign(self, func, args, kwargs, out, result, epoch: int) -> None:
        """Tag the outputs (``result``: one tag, or one per output tensor) and, for an in-place
        op, the tensor it wrote and that tensor's base when it is a view."""
        outs = flat_tensors(out)
        results: List[Any] = result if isinstance(result, list) else [result] * len(outs)
        for t, r in zip(outs, results):
            self._set(t, _FREE if r is None else r, epoch)
        if func._schema.is_mutable:
            r = results[0] if results else None
            for t in written(func, args, kwargs):
                self._set(t, _FREE if r is None else r, epoch)
                if t._base is not None and r is not None:
                    self._write_base(t._base, t, r, epoch)

    def _write_base(self, base, view, tag, epoch: int) -> None:
        """A view was written with rows ``tag``: its base holds them too."""
        old, old_epoch = self._entry(base)
        epoch = max(epoch, old_epoch)
        if isinstance(tag, Mixed) or isinstance(old, Mixed):
            self._set(base, tag if isinstance(tag, Mixed) else old, epoch)
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
        top.__exit__(None, None, None)
        top.pushed = False
