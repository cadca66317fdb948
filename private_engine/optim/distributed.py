"""Data-parallel private steps on ``torch.distributed``: the ranks' clipped sums summed by one
collective per flat buffer, the Gaussian noise drawn once in total (on rank 0), replicas checked.

W processes (ranks) train one model on disjoint parts of each logical batch. Rank r clips its own
samples S_r (any clipping mode: norms, factors and sums come from each sample's own activations and
output gradients) and accumulates ``s_r = Σ_{i ∈ S_r} C_i g_i`` over its physical batches. At the
step,

    rank 0:      s_0 ← s_0 + σR·ξ,   ξ ~ N(0, I)         (the only Gaussian draw)
    every rank:  s ← all_reduce_SUM(s_0, …, s_{W−1}) = Σ_{i ∈ S_0 ∪ … ∪ S_{W−1}} C_i g_i + σR·ξ
    every rank:  θ ← optimizer step on ĝ = s / B          (B: the global expected batch size)

so every rank holds the same ĝ, bit for bit (a ring or tree all-reduce computes each element's sum
once and copies it to every rank), the same function of the clipped per-sample gradients as one
process stepping on the union of the batches, and the parameters stay identical across ranks.

Why this is as private as the single-process release (Abadi et al. 2016): the released value is
``F(D) + σR·ξ`` with ``F(D) = Σ_r s_r`` a deterministic function of the data whose sensitivity is
R (one sample sits on one rank and changes its ``s_r`` by at most R — the clip factor bounds its
whole gradient), plus one Gaussian draw of standard deviation σR: the Gaussian mechanism at
noise multiplier σ, Poisson-subsampled at the global rate q = B/n when each rank samples its
shard at rate q (:func:`private_engine.data.poisson_loader`). The other ranks receive only the
released noisy sum, never rank 0's noise or its un-noised sum. (Noise on every rank would add
√W times too much; shares ``N(0, σ²R²/W)`` per rank would be private only against an observer
who knows none of the shares — each rank knows its own.) Rank 0 is the only rank that needs a
noise generator; the others draw nothing.

The sums are reduced in the flat buffers they were clipped into
(:mod:`private_engine.clipping.grad_sums`), one asynchronous ``all_reduce`` per buffer, all issued
before the first wait so that they overlap. Collectives must match across ranks, and a rank's
layout depends on what its clipping kept (an empty Poisson batch gives per-parameter zeros), so a
tiny ``all_gather`` first exchanges, per rank, its logical batch's sample count (summed: the global
count of the sampling-rate check), a code of its buffers' layout and an error flag; when the
layouts differ, the sums are first copied into one canonical layout (the parameters in the engine's
order) on every rank. A rank whose clipping raised still joins that ``all_gather`` with its flag
set, so every rank raises instead of waiting for it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..clipping.grad_sums import FlatLayout, GradSums
from ..process_group import process_group_ready


class ReplicaMismatchError(RuntimeError):
    """The ranks' parameters differ after a private step (``check_replicas=True``)."""


@dataclass
class StepCounts:
    """What the ranks told each other before a release."""

    #: Σ_r (samples of rank r's logical batch): the global logical batch's size
    samples: int
    #: whether every rank holds its sums in the same flat-buffer layout
    same_layout: bool
    #: ranks whose clipping of this step raised
    failed: List[int]


class DataParallel:
    """The collectives of data-parallel private training over the default process group.

    Args:
        device: where the small tensors of the collectives live (the parameters' device: NCCL
            needs CUDA tensors, gloo takes CPU ones).
    """

    def __init__(self, device: torch.device = torch.device("cpu")):
        if not process_group_ready():
            raise ValueError("data-parallel training needs an initialised default process group "
                             "(torch.distributed.init_process_group).")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device(device)
        self._layouts: Dict[Tuple[int, ...], FlatLayout] = {}

    @property
    def adds_noise(self) -> bool:
        """True on rank 0, the only rank that draws the noise σR·ξ."""
        return self.rank == 0

    # -- before the release --------------------------------------------------------------------
    @staticmethod
    def layout_code(sums: GradSums, params: Sequence[torch.Tensor]) -> int:
        """A code of how ``sums`` sit in their buffers: 0 for per-parameter tensors, else a 56-bit
        hash (+1) of the positions in ``params`` of the layout's parameters, which fix its buffers
        (:class:`FlatLayout` is a function of its parameter order). Equal codes on every rank ⇒
        buffers of the same shapes and dtypes, holding the same parameters."""
        layout = sums.layout
        if not isinstance(layout, FlatLayout):
            return 0
        index = {id(p): k for k, p in enumerate(params)}
        order = [index.get(id(p), -1) for p in layout.params]
        digest = hashlib.blake2b(repr(order).encode(), digest_size=7).digest()
        return int.from_bytes(digest, "little") + 1

    def exchange(self, samples: int, layout_code: int = 0, failed: bool = False) -> StepCounts:
        """One ``all_gather`` of ``(samples, layout_code, failed)`` from every rank (int64):
        the global count ``Σ_r samples_r``, whether all layout codes agree, the failed ranks."""
        mine = torch.tensor([int(samples), int(layout_code), int(bool(failed))],
                            dtype=torch.int64, device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine)
        table = torch.stack(everyone).cpu().tolist()
        return StepCounts(samples=sum(row[0] for row in table),
                          same_layout=len({row[1] for row in table}) == 1,
                          failed=[r for r, row in enumerate(table) if row[2]])

    # -- the release -----------------------------------------------------------------------------
    def reduction_sums(self, sums: GradSums, params: Sequence[torch.Tensor],
                       same_layout: bool) -> GradSums:
        """The sums in buffers that match across ranks: ``sums`` itself when every rank holds a
        flat layout with the same code (``same_layout``), else a copy in the canonical layout
        ``FlatLayout(params)`` (one buffer per device and accumulation dtype, the parameters in
        the engine's order): ``canonical[k] = sums.grads[k]`` cast to the buffer's dtype."""
        if same_layout and isinstance(sums.layout, FlatLayout):
            return sums
        key = tuple(id(p) for p in params)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = FlatLayout(list(params))
        buffers, views = layout.allocate(params)
        for view, g in zip(views, sums.grads):
            view.copy_(g)
        return GradSums(grads=views, buffers=buffers, layout=layout)

    def all_reduce_(self, buffers: Sequence[torch.Tensor]) -> None:
        """``b ← Σ_ranks b`` in place for every buffer: one ``all_reduce(SUM, async_op=True)`` per
        buffer, all issued before the first wait (they overlap on the transport)."""
        works = []
        for b in buffers:
            if not b.is_contiguous():
                raise ValueError("all_reduce_ needs contiguous buffers.")
            works.append(dist.all_reduce(b, op=dist.ReduceOp.SUM, async_op=True))
        for w in works:
            w.wait()

    # -- replicas --------------------------------------------------------------------------------
    @torch.no_grad()
    def broadcast_module(self, model: nn.Module) -> None:
        """``t ← t of rank 0`` for every parameter and buffer of ``model`` (as
        ``DistributedDataParallel`` does at construction): the replicas start identical, so that
        identical updates keep them identical."""
        for t in list(model.parameters()) + list(model.buffers()):
            data = t.data
            if data.is_contiguous():
                dist.broadcast(data, src=0)
            else:
                tmp = data.contiguous()
                dist.broadcast(tmp, src=0)
                data.copy_(tmp)

    @torch.no_grad()
    def check_replicas(self, params: Sequence[torch.Tensor]) -> None:
        """Raise :class:`ReplicaMismatchError` on every rank if the ranks' parameters differ:
        one ``all_gather`` of the float64 checksum ``(Σ_k Σ_j θ_kj, Σ_k Σ_j θ_kj²)`` of each rank,
        compared exactly (every rank steps on the same all-reduced ĝ, so replicas are equal bit
        for bit)."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for p in params:
            d = p.detach().to(device=self.device, dtype=torch.float64)
            total[0] += d.sum()
            total[1] += d.square().sum()
        everyone = [torch.empty_like(total) for _ in range(self.world_size)]
        dist.all_gather(everyone, total)
        sums = [tuple(t.cpu().tolist()) for t in everyone]
        if any(s != sums[0] for s in sums[1:]):
            shown = ", ".join(f"rank {r}: Σθ={s[0]!r}, Σθ²={s[1]!r}" for r, s in enumerate(sums))
            raise ReplicaMismatchError(
                f"the ranks' parameters differ after the private step ({shown}). Every rank must "
                "build the same model and optimizer, step the same number of times, and not "
                "change parameters outside optimizer.step().")


__all__ = ["DataParallel", "ReplicaMismatchError", "StepCounts"]
