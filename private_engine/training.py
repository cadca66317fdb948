"""Training-loop helpers: one logical DP batch in physical chunks, and evaluation."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from .data import physical_chunks


def private_logical_step(optimizer: torch.optim.Optimizer, batch: Sequence[torch.Tensor],
                         per_sample_loss: Callable[..., torch.Tensor], physical_batch_size: int,
                         device: Optional[torch.device] = None, lockstep: bool = False) -> float:
    """One DP step on a logical ``batch`` (batch-first tensors), in physical chunks of
    ≤ ``physical_batch_size``.

    ``per_sample_loss(*chunk)`` returns the chunk's per-sample losses (reduction="none"). Every
    chunk but the last goes through ``optimizer.virtual_step(loss=…)`` (clip and accumulate), the
    last through ``optimizer.step(loss=…)`` (noise once, update). An empty (Poisson) batch still
    takes a step — noise only — as the accountant assumes. Returns the batch's mean loss (0.0 if
    empty), with one host synchronisation.

    ``lockstep`` (FSDP2-sharded models, whose every forward runs collectives): the ranks agree on
    the number of chunks (one all-reduce of its maximum) and each runs that many forwards, empty
    chunks included, whatever its own (Poisson) batch size.
    """
    if lockstep:
        return _lockstep_step(optimizer, batch, per_sample_loss, physical_batch_size, device)
    if batch[0].shape[0] == 0:
        optimizer.step(loss=torch.zeros(0, device=device))
        optimizer.zero_grad(set_to_none=True)
        return 0.0
    chunks = list(physical_chunks(batch, physical_batch_size))
    return _run_chunks(optimizer, chunks, per_sample_loss, device)


def _lockstep_step(optimizer, batch, per_sample_loss, physical_batch_size, device) -> float:
    """:func:`private_logical_step` with the same number of chunks on every rank."""
    import torch.distributed as dist

    chunks = list(physical_chunks(batch, physical_batch_size))
    at = device if device is not None else batch[0].device
    if dist.get_backend() == "nccl" and torch.device(at).type != "cuda":
        at = torch.device("cuda", torch.cuda.current_device())
    count = torch.tensor([max(len(chunks), 1)], device=at)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    empty = tuple(t[:0] for t in batch)
    chunks += [empty] * (int(count.item()) - len(chunks))
    return _run_chunks(optimizer, chunks, per_sample_loss, device)


def _run_chunks(optimizer, chunks, per_sample_loss, device) -> float:
    """Forward, clip and accumulate each chunk; the last one steps."""
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
