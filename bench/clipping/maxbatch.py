"""``--max-batch``, in a method's child process: the largest physical batch whose training step
fits in GPU memory (doubling, then bisection), and the CUDA allocator's state and the failing
request when the smallest batch that did not fit ran out of memory."""
from __future__ import annotations

import argparse
import gc
import os
import re
import traceback
from pathlib import Path
from typing import Callable, Dict

from .config import MIB
from .methods import SETUPS
from .models import build_model, make_batch


def max_batch_by_bisection(fits: Callable[[int], bool], start: int, cap: int,
                           tolerance: float = 0.0) -> int:
    """The largest n ≤ cap with ``fits(n)``, assuming fits is monotone (True up to some n, then
    False): double from ``start`` until a failure (or the cap), then bisect between the last
    success ``lo`` and the first failure ``hi`` until ``hi − lo ≤ max(1, ⌊tolerance·lo⌋)``, and
    return ``lo`` (with ``tolerance`` 0 the exact largest size; with 0.02 within 2 % below it, in
    fewer probes). 0 when even ``fits(1)`` fails."""
    start = max(1, min(start, cap))
    lo, hi = 0, None  # lo: largest size known to fit; hi: smallest known not to
    n = start
    while hi is None:
        if fits(n):
            lo = n
            if n >= cap:
                return cap
            n = min(2 * n, cap)
        else:
            hi = n
    while hi - lo > max(1, int(tolerance * lo)):  # lo fits (or is 0), hi does not
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def is_out_of_memory(e: BaseException) -> bool:
    """torch.cuda.OutOfMemoryError, or a RuntimeError saying 'out of memory' (cuBLAS, cuDNN, older
    torch)."""
    import torch

    return isinstance(e, torch.cuda.OutOfMemoryError) or (isinstance(e, RuntimeError)
                                                         and "out of memory" in str(e).lower())


def probe_max_batch(args) -> int:
    """``{"max_batch": n, "oom": {...}}``: the largest physical batch for which a full training
    step of ``args.only`` runs without CUDA out-of-memory (``max_batch_by_bisection`` from
    ``--batch-size`` up to ``--max-batch-cap``), and the allocator's state when the smallest batch
    that did not fit ran out (:func:`oom_state`). Each probe builds the model, a batch of its size
    and the method afresh (Opacus wraps the model), runs two steps (the second would show memory
    allocated lazily by the first), and frees everything before the next probe."""
    import torch

    failures: Dict[int, dict] = {}

    def attempt(n: int) -> bool:
        torch.cuda.reset_peak_memory_stats()
        model, _ = build_model(args, args.only)
        x, y = make_batch(args, n)
        runner = SETUPS[args.only](model, x, y,
                                   argparse.Namespace(**{**vars(args), "batch_size": n}))
        try:
            for _ in range(2):
                runner.step()
            torch.cuda.synchronize()
            return True
        except Exception as e:  # noqa: BLE001 - only running out of memory means "does not fit"
            if is_out_of_memory(e):
                failures[n] = oom_state(torch, e)
                return False
            raise
        finally:
            del model, x, y, runner

    def fits(n: int) -> bool:
        try:
            ok = attempt(n)
        except Exception as e:  # noqa: BLE001 - out of memory while building the model or batch
            if not is_out_of_memory(e):
                raise
            failures.setdefault(n, oom_state(torch, e))
            ok = False
        # attempt's frame (and the exception's traceback, which referenced its tensors) are gone
        gc.collect()
        torch.cuda.empty_cache()
        return ok

    best = max_batch_by_bisection(fits, args.batch_size, args.max_batch_cap,
                                  args.max_batch_tolerance)
    oom = {"oom": {"batch": min(failures), **failures[min(failures)]}} if failures else {}
    return {"max_batch": best, **oom}


def oom_state(torch, error: BaseException) -> dict:
    """The CUDA caching allocator when a step ran out of memory (MiB): bytes in live tensors, bytes
    reserved from the driver (their difference: free space inside the allocator's segments, too
    fragmented for the failed request), and the attempt's peak of live tensors; from the
    ``error``, the size of the request that failed ("Tried to allocate …": one huge tensor or
    workspace, or a small block that fragmentation refused) and where it was raised
    (:func:`raised_at`)."""
    state = {"allocated_mib": torch.cuda.memory_allocated() / MIB,
             "reserved_mib": torch.cuda.memory_reserved() / MIB,
             "peak_allocated_mib": torch.cuda.max_memory_allocated() / MIB}
    request = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(error))
    if request:
        state["request"] = request.group(1)
    where = raised_at(error)
    if where:
        state["where"] = where
    return state


def raised_at(error: BaseException) -> str:
    """``file.py:line (function)`` of the innermost traceback frame of ``error`` in
    private_engine's code, else the innermost frame of all (a backward's error surfaces at the
    Python call that ran it, or in a hook)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    ours = [f for f in frames if f"{os.sep}private_engine{os.sep}" in f.filename]
    f = (ours or frames)[-1]
    return f"{Path(f.filename).name}:{f.lineno} ({f.name})"
