"""The default ``torch.distributed`` process group as the library sees it: whether one is ready,
and what a ``distributed=`` argument (of the engine, of :func:`private_engine.data.poisson_loader`)
resolves to. The engine's steps over the group are :mod:`private_engine.optim.topology`."""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist


def process_group_ready() -> bool:
    """``torch.distributed.is_available() and torch.distributed.is_initialized()``."""
    return dist.is_available() and dist.is_initialized()


def wants_distributed(distributed: Optional[bool], what: str = "the engine") -> bool:
    """Resolve a ``distributed`` argument: None → an initialised default process group of world
    size W > 1; True → an initialised one is required (``ValueError`` otherwise); False → one
    process."""
    if distributed is not None and not isinstance(distributed, bool):
        raise TypeError(f"distributed must be None, True or False, got {distributed!r}.")
    ready = process_group_ready()
    if distributed is None:
        return ready and dist.get_world_size() > 1
    if distributed and not ready:
        raise ValueError(
            f"distributed=True: {what} needs an initialised default process group "
            "(torch.distributed.init_process_group(...) on every rank, e.g. under torchrun) "
            "before it is built; none is. Leave distributed=None to detect one, or pass False.")
    return distributed


__all__ = ["process_group_ready", "wants_distributed"]
