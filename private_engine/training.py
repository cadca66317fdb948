"""Training-loop helpers: one logical DP batch in physical chunks, and evaluation."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from .data import physical_chunks


def private_logical_step(optimizer: torch.optim.Optimizer, batch: Sequence[torch.Tensor],
                         per_sample_loss: Callable[..., torch.Tensor], physical_batch_size: int,
                         device: Optional[torch.device] = None) -> float:
    """One DP step on a logical ``batch`` (batch-first tensors), in physical chunks of
    ≤ ``physical_batch_size``.

    ``per_sample_loss(*chunk)`` returns the chunk's per-sample losses (reduction="none"). Every
    chunk but the last goes through ``optimizer.virtual_step(loss=…)`` (clip and accumulate), the
    last through ``optimizer.step(loss=…)`` (noise once, update). An empty (Poisson) batch still
    takes a step — noise only — as the accountant assumes. Returns the batch's mean loss (0.0 if
    empty), with one host synchronisation.
    """
    if batch[0].shape[0] == 0:
        optimizer.step(loss=torch.zeros(0, device=device))
        optimizer.zero_grad(set_to_none=True)
        return 0.0
    chunks = list(physical_chunks(batch, physical_batch_size))
    total, count = None, 0
    for k, chunk in enumerate(chunks):
        if device is not None:
            chunk = tuple(t.to(device, non_blocking=True) for t in chunk)
        loss = per_sample_loss(*chunk)
        batch_sum = loss.detach().sum()
        total = batch_sum if total is None else total + batch_sum  # stays on device
        count += loss.shape[0]
        if k + 1 < len(chunks):
            optimizer.virtual_step(loss=loss)
        else:
            optimizer.step(loss=loss)
    optimizer.zero_grad(set_to_none=True)
    return float(total) / max(count, 1)


@torch.no_grad()
def accuracy(model: nn.Module, loader, device: Optional[torch.device] = None) -> float:
    """Top-1 accuracy of ``model`` over ``loader`` (eval mode, restored afterwards)."""
    was_training = model.training
    model.eval()
    correct = total = 0
    for x, y in loader:
        if device is not None:
            x, y = x.to(device), y.to(device)
        correct += int((model(x).argmax(1) == y).sum())
        total += y.shape[0]
    model.train(was_training)
    return correct / max(total, 1)
