"""Which rows of a recorded layer belong to which sample: the checks that every clipped layer saw
batch-first rows of the step's batch, and the layers that see ``k·B`` rows, ``k`` consecutive per
sample (Swin windows, LeViT's flattened tokens), whose rows are merged per sample."""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Sequence, Tuple

import torch

from ..capture.recorder import RecordedLayer
from ..layers.base import LayerDims
from ..layers.linear import LinearRule


def check_rows(layer: RecordedLayer, pairs, B: int) -> None:
    """Refuse a layer whose recorded rows are not ``B`` (or ``k·B`` where allowed) batch-first
    rows of the step's batch, naming the layer and the likely cause."""
    for a, g in pairs:
        if a.shape[0] != g.shape[0] or a.shape[0] % max(B, 1) or B == 0 or \
                (a.shape[0] != B and not layer.rows_ok()) or layer.batch_moved():
            if a.shape[0] != g.shape[0]:
                raise ValueError(
                    f"layer {layer.name}: the first dimension of its input "
                    f"({a.shape[0]}) differs from its output's ({g.shape[0]}): the layer "
                    "was applied to a tensor that is not batch-first. Inputs of clipped "
                    "layers must have the batch in dimension 0.")
            if a.shape[0] == 1 < B:
                raise ValueError(
                    f"layer {layer.name} saw a batch of 1 but the loss has {B} values: its "
                    "input is shared by all samples and broadcast later, so its output "
                    "gradient is already summed over the batch and per-sample norms cannot "
                    "be formed. A shared row of no sample's data (Hugging Face's default "
                    "position_ids) is expanded to the batch while the engine follows the "
                    "step's batch (batch-first inputs); here it was not. Give the layer one "
                    "row per sample, e.g. position_ids=torch.arange(T).expand(B, T), or "
                    "freeze the layer (requires_grad_(False)).")
            raise ValueError(
                f"layer {layer.name} saw a batch of {a.shape[0]} but the loss has {B} values; "
                'the loss must have one value per sample: compute it with reduction="none" '
                "and sum per-token or per-element losses per sample (e.g. "
                "loss.view(B, -1).sum(1)). Inputs must be batch-first (batch dimension 0); a "
                "layer may see k·B rows (Swin windows) only when they come from batch-first "
                "tensors without moving dim 0."
            )


def merged_rows(layer: RecordedLayer, pairs, B: int) -> Tuple[list, int]:
    """A Linear seeing k·B rows, k consecutive per sample (Swin windows): the rows merged into
    positions, ``(k·B, T, d) -> (B, k·T, d)``, exact for ghost norm, instantiation and clipped
    sum. ``(pairs, k)``."""
    if not (isinstance(layer.rule, LinearRule) and any(a.shape[0] != B for a, _ in pairs)):
        return pairs, 1
    k = pairs[0][0].shape[0] // B
    return [(a.reshape(B, -1, a.shape[-1]), g.reshape(B, -1, g.shape[-1]))
            for a, g in pairs], k


def rows_grads(layer: RecordedLayer, pairs, dims: Sequence[LayerDims], B: int
               ) -> Tuple[Dict[str, torch.Tensor], list]:
    """Per-sample gradients of a (non-Linear) layer that sees ``k·B`` rows, k consecutive rows
    per sample (LeViT's ``flatten(0, 1)`` tokens): instantiated per row, the k rows of each
    sample summed, ``∂L_i/∂θ = Σ_{r ∈ rows(i)} G_r``."""
    total: Dict[str, torch.Tensor] = {}
    for a, g in pairs:
        for name, grad in layer.rule.per_sample_grads(layer.module, [(a, g)]).items():
            grad = grad.reshape(B, grad.shape[0] // B, *grad.shape[1:]).sum(1)
            total[name] = grad if name not in total else total[name] + grad
    return total, [replace(d, ghost_capable=False) for d in dims]


def check_extra_rows(name: str, grad: torch.Tensor, B: int) -> None:
    """Refuse a traced parameter's or fallback module's per-sample gradients whose rows are not
    the step's ``B`` samples."""
    rows = grad.shape[0]
    if rows != B:
        raise ValueError(
            f"{name} saw a batch of {rows} but the loss has {B} values; the "
            "loss must have one value per sample (batch-first inputs).")
