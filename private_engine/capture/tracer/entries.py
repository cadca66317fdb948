"""What the parameter-entry tracer knows about derived tensors and entries, and the ledger of one
step's entries: the switch of the norm pass (``capturing``), the per-sample gradients that the
entries' hooks accumulate there, and the edges and jumps the graph walk asks for."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ...foundation.dtypes import accumulation_dtype


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


def is_reshape_of(t: torch.Tensor, p: torch.Tensor) -> bool:
    """True when ``t`` holds ``p``'s elements in ``p``'s order (p itself or a contiguous view of
    it)."""
    if t is p:
        return True
    return (t._base is p and t.numel() == p.numel() and t.is_contiguous() and p.is_contiguous()
            and t.storage_offset() == p.storage_offset())


class EntryLedger:
    """The entries of the current step and what the norm pass computes from them.

    ``capturing`` is the norm pass's switch (set by the clipper through the tracer, as for every
    recorder of the capture stage); ``in_vjp`` is True while a per-sample vjp through a
    batch-free chain runs (a nested backward, which parameter hooks must leave alone).
    """

    def __init__(self):
        self.entries: List[Entry] = []
        #: per-sample gradients ``{id(P): (B, *P.shape)}`` accumulated in the norm pass
        self.grads: Dict[int, torch.Tensor] = {}
        self.capturing = False
        self.in_vjp = False

    def on_grad(self, entry: Entry, grad: torch.Tensor, n: int, B: int) -> None:
        """The hook of ``D_b`` (``n`` rows, batch size ``B``): the first gradient of a capturing
        pass adds the entry's per-sample gradients."""
        if not self.capturing or entry.fired:
            return
        entry.fired = True
        self.accumulate(entry, grad.detach(), n, B)

    def accumulate(self, entry: Entry, cot: torch.Tensor, n: int, B: int) -> None:
        """Add ``∂L_i/∂P = (∂D/∂P)ᵀ c_i`` for every parameter P of ``entry``, with ``c_i`` the sum
        of sample i's k = n / B rows of the cotangent ``cot`` at ``D_b`` (a batched vjp through
        the batch-free chain; a reshape when D is P itself)."""
        # (B, *base.shape[1:]): per-sample cotangent
        cot = cot.reshape(B, n // B, *cot.shape[1:]).sum(1)
        base = entry.base
        if len(entry.params) == 1 and is_reshape_of(base, entry.params[0]):
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

    def edges(self) -> list:
        """Gradient edges of every entry's ``D_b``."""
        return [e.edge for e in self.entries]

    def jumps(self) -> Dict[object, list]:
        """``{output node: [batched input nodes]}`` of every entry, for the graph walk."""
        out: Dict[object, list] = {}
        for e in self.entries:
            if e.out_node is not None:
                out.setdefault(e.out_node, []).extend(e.batched_nodes)
        return out

    def per_sample_grads(self, names: Dict[int, str]) -> Dict[str, torch.Tensor]:
        """``{param name: (B, *P.shape)}`` accumulated in the last norm pass."""
        return {names[i]: g for i, g in self.grads.items()}

    def drop_from(self, mark: int) -> None:
        """Forget the entries from index ``mark`` on (those of a forward that is not trained on),
        releasing what they hold."""
        for e in self.entries[mark:]:
            e.base = e.edge = e.out_node = None
            e.batched_nodes = []
        del self.entries[mark:]

    def reset(self) -> None:
        """Forget every entry and the accumulated gradients."""
        for e in self.entries:
            e.base = e.edge = e.out_node = None
            e.batched_nodes = []
        self.entries = []
        self.grads = {}
