"""The second tries of the ghost bounds formed together (:mod:`.ghost_stack`): after one host
synchronisation per device per step, the samples whose fast bound is loose or not finite get the
second try of their layer (:func:`.gram.second_try`), the loose samples of layers of one shape
over their rows together (:func:`.gram.second_try_rows`), each written into its chunk's block."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterator, List, NamedTuple, Sequence, Tuple

import torch

from .gram import CHUNK, second_try, second_try_rows

if TYPE_CHECKING:
    from .ghost_stack import _Pending


def released_bound(bound: torch.Tensor, c_rel: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """``(√max(b, 0) + c_r·M)²``: the released sample's squared norm bound from the bound ``b`` of
    its ghost norm and its mass ``M`` (:func:`.rounding.certified_ghost` with ``c_ν = 0``)."""
    return (bound.clamp(min=0).sqrt_() + c_rel * mass).square()


class Retry(NamedTuple):
    """One chunk's bounds (``block``, ``(L, N)``) and what a second try needs: its layers, which
    samples' fast bounds are tight enough (``ok``), their row-norm bounds, ``c_r`` and masses."""

    layers: Sequence["_Pending"]
    block: torch.Tensor
    ok: torch.Tensor
    na: torch.Tensor
    ng: torch.Tensor
    c_rel: torch.Tensor
    mass: torch.Tensor


def second_tries(retries: Sequence[Retry]) -> None:
    """:func:`.gram.refine` over every chunk of a step at once, on every device: one host
    synchronisation per device per step reads whether any sample's fast bound is loose (slack
    above ``LOOSE·ν̃``) or not finite; those samples get the second try of their layer
    (:func:`.gram.second_try`: blocked Grams, then float64 Grams), written into their chunk's
    block. A loose bound is an upper bound all the same; the second try keeps an honest sample's
    bound within about 5·10⁻⁴ of its norm where the fast one can be several times looser (the
    pessimistic tensor-core model of 16-bit CUDA Grams)."""
    by_device: Dict[torch.device, List[Retry]] = {}
    for r in retries:
        by_device.setdefault(r.block.device, []).append(r)
    for group in by_device.values():
        flags = group[0].ok if len(group) == 1 else torch.cat([r.ok.flatten() for r in group])
        if bool(flags.all()):
            continue
        loose: Dict[tuple, List[Tuple[Retry, int, torch.Tensor]]] = {}
        for r in group:
            if bool(r.ok.all()):
                continue
            for layer in (~r.ok).any(1).nonzero().squeeze(1).tolist():
                p = r.layers[layer]
                idx = (~r.ok[layer]).nonzero().squeeze(1)
                loose.setdefault((p.key(), p.a.dtype, p.g.dtype), []).append((r, layer, idx))
        for items in loose.values():
            for part in _together(items):
                _second_try_together(part)


#: the most samples whose second tries are formed together, times ``T²``: the loose samples of
#: layers of one shape take one second try up to this many Gram entries
TOGETHER_ELEMENTS = 1 << 23


def _together(items: List[Tuple["Retry", int, torch.Tensor]]
              ) -> Iterator[List[Tuple["Retry", int, torch.Tensor]]]:
    """``items`` (loose samples of layers of one shape) in runs whose samples hold at most
    ``TOGETHER_ELEMENTS`` Gram entries (``samples·T²``), one layer at least per run."""
    T = items[0][0].layers[items[0][1]].a.shape[1]
    run: list = []
    samples = 0
    for item in items:
        n = item[2].numel()
        if run and (samples + n) * T * T > TOGETHER_ELEMENTS:
            yield run
            run, samples = [], 0
        run.append(item)
        samples += n
    if run:
        yield run


def _second_try_together(items: Sequence[Tuple["Retry", int, torch.Tensor]]) -> None:
    """The second tries (:func:`.gram.second_try`) of the loose samples ``idx`` of layers of one
    shape (``(retry, layer, idx)``: widths, positions, bias and fast-Gram model equal), formed
    together over their rows laid one after the other (each sample's bound is its own: the same
    formulas as one layer's), each written into its chunk's block."""
    if len(items) == 1:
        r, layer, idx = items[0]
        p = r.layers[layer]
        parts = [second_try(p.a, p.g, p.bias, r.na[layer], r.ng[layer], p.model, idx,
                            p.c_rel)]
    else:
        first = items[0][0].layers[items[0][1]]
        if max(first.a.shape[2], first.g.shape[2]) < 2 * CHUNK:  # float64 Grams, layer by layer
            parts = [second_try(r.layers[k].a, r.layers[k].g, first.bias, r.na[k], r.ng[k],
                                first.model, idx, r.layers[k].c_rel) for r, k, idx in items]
        else:
            def rows(pick):
                return torch.cat([pick(r, k)[idx] for r, k, idx in items])

            second = second_try_rows(rows(lambda r, k: r.layers[k].a),
                                     rows(lambda r, k: r.layers[k].g), first.bias,
                                     rows(lambda r, k: r.na[k]), rows(lambda r, k: r.ng[k]),
                                     first.model, first.c_rel)
            parts = list(second.split([idx.numel() for _, _, idx in items]))
    for (r, layer, idx), part in zip(items, parts):
        r.block[layer].index_put_((idx,), released_bound(part, r.c_rel[layer], r.mass[layer, idx]))
