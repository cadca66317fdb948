"""The clipped sums of a physical batch written from what its norm pass kept.

:class:`SumBuilder` owns where the sums live (:class:`private_engine.clipping.grad_sums.FlatLayout`,
kept from step to step while the same parameters are kept the same way) and writes the kept terms
into the flat buffers: ``Gᵀ C`` per group of kept per-sample gradients (one matrix-vector product
into the group's contiguous segment) and ``gᵀ·diag(C)·a`` per kept layer (its rule's
``weighted_grads``, whose matmul writes the parameter's view), each kept tensor released as soon as
its term is formed; :class:`SumWriter` tracks which views are written. Parameters the loss does not
reach are zeroed.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..foundation.dtypes import accumulation_dtype, cast_down
from ..foundation.matmul import weighted_sum_into
from .grad_sums import FlatLayout, GradSums, LazyBuffers
from .kept import kept_pair_params, rows_kept

#: a buffer's identity for :meth:`SumBuilder.by_buffer`: ``(group key, device, dtype)``
BufferKey = Tuple[object, torch.device, torch.dtype]

#: the most elements of one flat buffer of sums (32 MiB of float32) when no ``buffer_group`` is
#: set: the sums of a step are written into buffers of about this size, each allocated when its
#: first parameter is written, while the operands kept for the layers not yet written are freed
#: layer by layer — so the sums do not all sit next to every kept operand at once (the whole
#: model's gradient size over non-private training at the peak) — and the released gradients
#: are copied out one buffer at a time (:meth:`GradSums.own_grads`)
SUM_BUFFER_ELEMENTS = 1 << 23


class SumBuilder:
    """Flat-buffer layout and writing of the clipped sums of ``params`` (in this order).

    ``buffer_group`` (optional, ``parameter -> key``): parameters of different keys get different
    flat buffers (FSDP2: the unit); None: one buffer per (device, dtype)."""

    def __init__(self, params: Sequence[nn.Parameter]):
        self.params = list(params)
        self._param_ids = {id(p) for p in self.params}
        self.buffer_group: Optional[Callable[[torch.Tensor], object]] = None
        self._layout: Optional[FlatLayout] = None
        self._layout_key: tuple = ()
        #: the buffer of each parameter of ``params`` in ``_layout``
        self._buffer_of: List[int] = []

    def layout(self, kept_groups: Sequence, kept_pairs: Sequence) -> FlatLayout:
        """The flat-buffer layout for what a norm pass kept: the parameters of the kept
        per-sample gradient groups first, in group order (each group's sums are then one
        contiguous segment), then those of the kept ``(a, g)`` pairs in the order they are
        summed (``kept_pairs`` reversed), then the rest (zeroed together). The same kinds of
        layers kept the same way at every step give the same layout object, so accumulated sums
        add buffer by buffer."""
        order = [p for params, _ in kept_groups for p in params]
        order += kept_pair_params(list(reversed(kept_pairs)))
        seen: set = set()
        unique = []
        for p in order:
            if id(p) in self._param_ids and id(p) not in seen:
                seen.add(id(p))
                unique.append(p)
        order = unique
        key = tuple(id(p) for p in order)
        if self._layout is None or key != self._layout_key:
            rest = [p for p in self.params if id(p) not in seen]
            limit = SUM_BUFFER_ELEMENTS if self.buffer_group is None else None
            self._layout = FlatLayout(order + rest, self.buffer_group, limit)
            self._layout_key = key
            self._buffer_of = self._layout.buffer_index(self.params)
        return self._layout

    def write_kept(self, layout: FlatLayout, factors: torch.Tensor,
                   keep: Optional[torch.Tensor], kept_groups: list, kept_pairs: list
                   ) -> Tuple[LazyBuffers, "SumWriter"]:
        """``(buffers, writer)``: the flat buffers of ``layout`` (:class:`LazyBuffers`: each
        allocated when first written) with every kept term written (the groups in order, the
        pairs last first), the kept lists emptied as they go, so that each kept operand is freed
        once its term is written."""
        buffers = LazyBuffers(layout)
        writer = SumWriter(buffers, factors, keep)
        while kept_groups:
            params, mat = kept_groups.pop(0)
            writer.group(params, mat, buffers.segment(params))
            del mat
        while kept_pairs:
            module, rule, pairs = kept_pairs.pop()
            writer.pair(module, rule, pairs)
            del pairs
        return buffers, writer

    def finish(self, layout: FlatLayout, buffers: LazyBuffers,
               writer: "SumWriter") -> GradSums:
        """Zero the parameters nothing was written for (the loss does not reach them) and hand
        out the sums."""
        full = buffers.all()
        unwritten = [p for p in layout.params if id(p) not in writer.written]
        for seg in layout.segments(full, unwritten):
            seg.zero_()
        buffer_of = self._buffer_of if layout is self._layout else layout.buffer_index(
            self.params)
        return GradSums(grads=[writer.view_of[id(p)] for p in self.params], buffers=full,
                        layout=layout, buffer_of=buffer_of)

    def by_buffer(self, factors: torch.Tensor, keep: Optional[torch.Tensor],
                  kept_groups: list, kept_pairs: list,
                  sink: Callable[[BufferKey, List[torch.Tensor], List[torch.Tensor]], None],
                  order: Callable[[BufferKey], Any]) -> None:
        """The kept terms written one flat buffer at a time, buffers in the order of
        ``order(key)``; ``sink(key, parameters, sums)`` called for each, the buffer then dropped
        (:meth:`private_engine.clipping.clipper.PerSampleClipper.clipped_sums_by_buffer`)."""
        layout = self.layout(kept_groups, kept_pairs)
        buffer_of = {id(p): layout.slots[id(p)][0] for p in layout.params}
        groups: Dict[int, list] = {}
        for params, mat in kept_groups:
            groups.setdefault(buffer_of[id(params[0])], []).append((params, mat))
        pairs: Dict[int, list] = {}
        for module, rule, kept in reversed(kept_pairs):
            ps = [buffer_of[id(p)] for p in rule_params(module, rule) if id(p) in buffer_of]
            if len(set(ps)) > 1:
                raise RuntimeError("internal error: a kept layer's parameters span buffers.")
            if ps:
                pairs.setdefault(ps[0], []).append((module, rule, kept))
        kept_groups.clear()
        kept_pairs.clear()
        keys = {b: order(layout.key_of(b)) for b in range(layout.num_buffers)}
        for b in sorted(keys, key=keys.__getitem__):
            buffer, views = layout.allocate_buffer(b)
            params = layout.buffer_params(b)
            writer = SumWriter(dict(zip(map(id, params), views)), factors, keep)
            only = [buffer if k == b else None for k in range(layout.num_buffers)]
            for ps, mat in groups.pop(b, []):
                writer.group(ps, mat, layout.segment(only, ps))
                del mat
            for module, rule, kept in pairs.pop(b, []):
                writer.pair(module, rule, kept)
                del kept
            for p, v in zip(params, views):
                if id(p) not in writer.written:
                    v.zero_()  # parameters the loss does not reach
            sink(layout.key_of(b), params, views)
            del buffer, views, writer

    def in_one_buffer(self, layers) -> bool:
        """Whether every recorded layer's trainable parameters fall in one flat buffer (one
        ``buffer_group`` key and accumulation dtype)."""
        for layer in layers:
            keys = {(self.buffer_group(p) if self.buffer_group else None, p.device,
                     accumulation_dtype(p))
                    for p in rule_params(layer.module, layer.rule) if id(p) in self._param_ids}
            if len(keys) > 1:
                return False
        return True


def rule_params(module: nn.Module, rule) -> List[nn.Parameter]:
    """The parameters a layer rule writes sums for (those of ``rule.param_names`` the module
    holds)."""
    return [p for p in (getattr(module, n, None) for n in rule.param_names)
            if isinstance(p, nn.Parameter)]


class SumWriter:
    """Writes clipped-sum terms into the views of a flat buffer: ``view_of`` maps id(parameter)
    to its view (a dict, or :class:`.grad_sums.LazyBuffers`); a parameter's first term is
    written (by the layer's matmul ``out=`` the view, or copied), later ones (a weight kept
    twice: tied uses) added. ``keep`` (bool ``(B,)``): rows of dropped samples are zeroed
    before any product (no ``0·inf``)."""

    def __init__(self, view_of: Any, factors: torch.Tensor,
                 keep: Optional[torch.Tensor]):
        self.view_of = view_of
        self.factors = factors
        self.keep = keep
        self.written: set = set()
        #: the factors rounded toward zero to each accumulation dtype, formed once
        self._cast: Dict[torch.dtype, torch.Tensor] = {}

    def factors_like(self, t: torch.Tensor) -> torch.Tensor:
        """The clip factors rounded toward zero (:func:`private_engine.layers.rounding.cast_down`)
        to the accumulation dtype of ``t`` (float64 stays float64, else float32), once per step and
        dtype: a rule that needs a narrower dtype rounds them again toward zero, which gives the
        same factors as one rounding (each grid is a subset of the wider one)."""
        dtype = accumulation_dtype(t)
        found = self._cast.get(dtype)
        if found is None:
            found = self._cast[dtype] = cast_down(self.factors, dtype)
        return found

    def put(self, p, g) -> None:
        """A term computed outside the buffer, written or added into ``p``'s view."""
        v = self.view_of[id(p)]
        if id(p) in self.written:
            v.add_(g.reshape(v.shape))
        else:
            v.copy_(g.reshape(v.shape))
            self.written.add(id(p))

    def group(self, params, mat, seg) -> None:
        """``Gᵀ C`` of a kept group ``(B, n)``: straight into ``seg`` (its parameters' contiguous
        segment, None when they are not one) when none was written yet, else through ``put``."""
        if self.keep is not None:
            mat = rows_kept(mat, self.keep)
        factors = self.factors_like(mat)
        if seg is not None and not any(id(p) in self.written for p in params):
            weighted_sum_into(seg, mat, factors)
            self.written.update(id(p) for p in params)
            return
        sums = weighted_sum_into(None, mat, factors)
        offset = 0
        for p in params:
            self.put(p, sums[offset:offset + p.numel()])
            offset += p.numel()

    def pair(self, module, rule, pairs) -> None:
        """``gᵀ·diag(C)·a`` of a kept layer, by its rule's ``weighted_grads``."""
        self.pair_weighted(module, rule, pairs, self.factors)

    def pair_weighted(self, module, rule, pairs, weights) -> None:
        """``gᵀ·diag(w)·a`` of a layer (the release strategy's second pass passes its own
        weights)."""
        if weights is self.factors and pairs:
            weights = self.factors_like(pairs[0][1])
        if self.keep is not None:
            pairs = [(rows_kept(a, self.keep), rows_kept(g, self.keep)) for a, g in pairs]
        targets = {}
        for name in rule.param_names:
            p = getattr(module, name, None)
            if isinstance(p, nn.Parameter) and id(p) in self.view_of and \
                    id(p) not in self.written:
                targets[name] = self.view_of[id(p)]
        for name, g in rule.weighted_grads(module, pairs, weights, out=targets).items():
            p = getattr(module, name)
            if targets.get(name) is g:
                self.written.add(id(p))
            else:
                self.put(p, g)
