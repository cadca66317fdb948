"""Clipped-gradient sums of all parameters, held as views of a few flat buffers.

A private step releases, for every trainable parameter θ, ``(Σ_i C_i ∂L_i/∂θ + σR·ξ_θ) / B`` (Abadi
et al. 2016; Bu, Mao & Xu 2022, Alg. 1). Held parameter by parameter, each of its stages
(accumulation over physical batches, the noise, the division by B) costs one operation — one kernel
launch on a GPU — per parameter tensor: 150–300 per stage for a ViT. Held as views of a few flat
buffers per (device, dtype), each stage is one operation per buffer, and book-keeping writes each
layer's clipped sum straight into its parameter's view (``out=`` of the layer's matmul), with no
per-parameter copies. Buffers of bounded size (``max_elements``), allocated as they are first
written (:class:`LazyBuffers`) and dropped one by one as the released gradients are copied out,
keep the sums from sitting next to every operand kept for them, or twice in memory.

:class:`FlatLayout` fixes where each parameter's sum lives; :class:`GradSums` is one physical
batch's sums: ``grads`` (one tensor per parameter, in the engine's order) and ``buffers``, disjoint
tensors that cover every element of ``grads`` exactly once (the flat buffers, or the ``grads``
themselves when the sums came from autograd). Two sums of the same layout add buffer by buffer. What
leaves the engine (``.grad``, ``clipped_grad_sum``) are tensors of their own
(:meth:`GradSums.own_grads`): the division by the batch size writes them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch

from ..foundation.dtypes import accumulation_dtype


@dataclass
class GradSums:
    """Clipped-gradient sums of one (or more, accumulated) physical batches.

    ``grads[k]`` is parameter k's sum (views into ``buffers`` or tensors of their own); ``buffers``
    cover the elements of ``grads`` exactly once, so an elementwise operation on every buffer
    (noise, scaling) acts on every parameter's sum exactly once; ``layout`` identifies how ``grads``
    sit in ``buffers``.
    """

    grads: List[torch.Tensor]
    buffers: List[torch.Tensor]
    layout: object = None
    #: ``buffer_of[k]``: the index in ``buffers`` of the buffer ``grads[k]`` is a view of (None:
    #: not known; :meth:`own_grads` then copies every gradient before any buffer is dropped)
    buffer_of: Optional[List[int]] = None

    @classmethod
    def separate(cls, grads: Sequence[torch.Tensor]) -> "GradSums":
        """Sums held in tensors of their own (autograd's result, zeros): each one is its own
        buffer."""
        grads = list(grads)
        return cls(grads=grads, buffers=grads, layout=None)

    def own_grads(self, divisor: float = 1.0) -> List[torch.Tensor]:
        """``grads / divisor`` as tensors of their own (storage of exactly their size), by one
        multi-tensor operation per buffer. Views of a flat buffer must not be handed out as
        ``.grad``: code that copies a gradient (``copy.deepcopy(p.grad)``, as Opacus' optimizer
        does, or ``torch.save``) would copy the whole buffer.

        The sums are consumed: afterwards they hold the returned tensors (as separate sums).
        With several flat buffers and ``buffer_of`` known, each buffer is dropped as soon as its
        gradients are copied out, so the copies and the buffers together never exceed the sums'
        size by more than one buffer."""
        if self.layout is None:  # already tensors of their own: divided in place
            if divisor != 1.0:
                torch._foreach_div_(self.grads, divisor)
            return self.grads
        if self.buffer_of is None or len(self.buffers) == 1:
            out = list(torch._foreach_div(self.grads, divisor))
        else:
            out = list(self.grads)
            members: Dict[int, List[int]] = {}
            for k, b in enumerate(self.buffer_of):
                members.setdefault(b, []).append(k)
            for b in range(len(self.buffers)):
                idx = members.get(b, [])
                for k, g in zip(idx, torch._foreach_div([self.grads[k] for k in idx], divisor)):
                    out[k] = self.grads[k] = g
                self.buffers[b] = None  # type: ignore[call-overload]  # its views replaced
        self.grads, self.buffers, self.layout, self.buffer_of = out, out, None, None
        return out

    def add_(self, other: "GradSums") -> "GradSums":
        """``self += other`` in place: one operation per buffer when both share a layout, else per
        parameter."""
        if self.layout is not None and self.layout is other.layout:
            torch._foreach_add_(self.buffers, other.buffers)
        else:
            torch._foreach_add_(self.grads, other.grads)
        return self


class FlatLayout:
    """Offsets of parameters in flat buffers: one buffer per (device, accumulation dtype),
    parameters in the given order, so consecutive parameters of one buffer form one contiguous
    segment.

    The buffer of a parameter has its accumulation dtype (float32 for float32/bfloat16/float16
    parameters, float64 for float64): clipped sums are accumulated in at least float32 and cast to
    the parameter's dtype only when written to ``.grad``. ``group`` (optional): a key per
    parameter; parameters of different keys get different buffers (FSDP2: one buffer per unit,
    so that each unit's sums can be freed once reduce-scattered). ``max_elements`` (optional):
    a buffer that would grow past this many elements is closed and the next parameters of its
    key start another one (a parameter is never split; one larger than that has a buffer of its
    own): buffers that :class:`LazyBuffers` allocates as they are first written, and
    :meth:`GradSums.own_grads` drops one by one.
    """

    def __init__(self, params: Sequence[torch.Tensor],
                 group: Optional[Callable[[torch.Tensor], object]] = None,
                 max_elements: Optional[int] = None):
        self.params = list(params)
        self._keys: List[Tuple[object, torch.device, torch.dtype]] = []
        self._sizes: List[int] = []
        #: the buffer of each key that parameters are still added to
        open_buffer: Dict[Tuple[object, torch.device, torch.dtype], int] = {}
        #: id(param) -> (buffer index, offset, numel, shape)
        self.slots: Dict[int, Tuple[int, int, int, torch.Size]] = {}
        for p in self.params:
            key = (group(p) if group is not None else None, p.device, accumulation_dtype(p))
            b = open_buffer.get(key)
            if b is None or (max_elements is not None and self._sizes[b]
                             and self._sizes[b] + p.numel() > max_elements):
                b = open_buffer[key] = len(self._keys)
                self._keys.append(key)
                self._sizes.append(0)
            if id(p) in self.slots:
                raise ValueError("a parameter appears twice in a FlatLayout.")
            self.slots[id(p)] = (b, self._sizes[b], p.numel(), p.shape)
            self._sizes[b] += p.numel()

    def allocate(
        self, order: Sequence[torch.Tensor]
    ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """``(buffers, views)``: uninitialised flat buffers and one view per parameter of ``order``
        (a permutation of this layout's parameters or a subset of it)."""
        buffers = [self.new_buffer(b) for b in range(self.num_buffers)]
        views = []
        for p in order:
            b, off, n, shape = self.slots[id(p)]
            views.append(buffers[b][off : off + n].view(shape))
        return buffers, views

    def new_buffer(self, b: int) -> torch.Tensor:
        """Buffer ``b``, uninitialised."""
        _, d, t = self._keys[b]
        return torch.empty(self._sizes[b], device=d, dtype=t)

    def buffer_index(self, params: Sequence[torch.Tensor]) -> List[int]:
        """The buffer of each parameter of ``params``."""
        return [self.slots[id(p)][0] for p in params]

    @property
    def num_buffers(self) -> int:
        return len(self._keys)

    def key_of(self, b: int) -> Tuple[object, torch.device, torch.dtype]:
        """``(group key, device, dtype)`` of buffer ``b`` (group key None without ``group``)."""
        return self._keys[b]

    def buffer_params(self, b: int) -> List[torch.Tensor]:
        """The parameters of buffer ``b``, in their order in it."""
        return [p for p in self.params if self.slots[id(p)][0] == b]

    def allocate_buffer(self, b: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """``(buffer, views)``: buffer ``b`` alone (uninitialised) and the views of its
        parameters (:meth:`buffer_params` order)."""
        buffer = self.new_buffer(b)
        views = []
        for p in self.buffer_params(b):
            _, off, n, shape = self.slots[id(p)]
            views.append(buffer[off:off + n].view(shape))
        return buffer, views

    def segment(
        self, buffers: Sequence[Optional[torch.Tensor]], params: Sequence[torch.Tensor]
    ) -> Optional[torch.Tensor]:  # buffers not holding ``params`` may be None
        """The 1-D view of ``buffers`` holding ``params``' sums back to back, or None when they are
        not consecutive in one buffer."""
        if not params or any(id(p) not in self.slots for p in params):
            return None
        views = self.segments(cast(Sequence[torch.Tensor], buffers), params)  # params' are set
        return views[0] if len(views) == 1 else None

    def segments(
        self, buffers: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
    ) -> List[torch.Tensor]:
        """1-D views covering ``params`` in as few contiguous segments as their slots allow (one
        pass)."""
        out: List[torch.Tensor] = []
        run = None  # (buffer, start, end) of the current segment
        for p in params:
            b, off, n, _ = self.slots[id(p)]
            if run is not None and run[0] == b and run[2] == off:
                run = (b, run[1], off + n)
                continue
            if run is not None:
                out.append(buffers[run[0]][run[1] : run[2]])
            run = (b, off, off + n)
        if run is not None:
            out.append(buffers[run[0]][run[1] : run[2]])
        return out


class LazyBuffers:
    """The flat buffers of a :class:`FlatLayout`, each allocated when a view into it is first
    asked for: sums written layer by layer occupy memory only as their buffers are reached (the
    operands kept for the layers not yet written are freed as they go). A mapping
    ``id(parameter) -> view`` for :class:`private_engine.clipping.sums.SumWriter`."""

    def __init__(self, layout: FlatLayout):
        self.layout = layout
        self.buffers: List[Optional[torch.Tensor]] = [None] * layout.num_buffers
        self._views: Dict[int, torch.Tensor] = {}

    def _buffer(self, b: int) -> torch.Tensor:
        found = self.buffers[b]
        if found is None:
            found = self.buffers[b] = self.layout.new_buffer(b)
        return found

    def __contains__(self, pid: int) -> bool:
        return pid in self.layout.slots

    def __getitem__(self, pid: int) -> torch.Tensor:
        view = self._views.get(pid)
        if view is None:
            b, off, n, shape = self.layout.slots[pid]
            view = self._views[pid] = self._buffer(b)[off:off + n].view(shape)
        return view

    def segment(self, params: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
        """:meth:`FlatLayout.segment` of ``params`` (their buffer allocated if they lie in one)."""
        slots = self.layout.slots
        if not params or any(id(p) not in slots for p in params):
            return None
        b = slots[id(params[0])][0]
        if any(slots[id(p)][0] != b for p in params):
            return None
        self._buffer(b)
        return self.layout.segment(self.buffers, params)

    def all(self) -> List[torch.Tensor]:
        """Every buffer (those not yet allocated, now)."""
        return [self._buffer(b) for b in range(len(self.buffers))]
