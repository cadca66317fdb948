"""Running a function on 2 CPU processes under a gloo process group, for tests/distributed/.

``run_ranks(fn, out_dir)`` spawns ``fn(rank, out_dir)`` on ranks 0 and 1 (``torch.multiprocessing``
with the spawn start method, a free TCP port from binding port 0, ``init_process_group("gloo")``
with a 60 s collective timeout so that a rank left waiting fails instead of hanging, one thread per
process) and returns what each rank returned, through files in ``out_dir``
(``torch.save`` / ``torch.load``). A rank that raises fails the call with its traceback.
"""
from __future__ import annotations

import gc
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (bound to port 0, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(seconds=60))
    try:
        result = fn(rank, out_dir)
        torch.save(result, os.path.join(out_dir, f"result{rank}.pt"))
    finally:
        # objects of the run (engines' hooks, FSDP2 states) sit in reference cycles that hold
        # the group's resources: free them while the group is alive, the ranks in step
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def run_ranks(fn, out_dir, timeout: float = 120.0) -> list:
    """``[fn(0, out_dir), fn(1, out_dir)]``, run on two processes of one gloo group."""
    out_dir = os.fspath(out_dir)
    context = mp.start_processes(_entry, args=(fn, free_port(), out_dir), nprocs=WORLD,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"the ranks did not finish within {timeout} s.")
    return [torch.load(os.path.join(out_dir, f"result{r}.pt"), weights_only=False)
            for r in range(WORLD)]
