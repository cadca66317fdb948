"""Measuring one method, in its child process: the peak-memory meter (CUDA allocator or the
process' peak RSS) and the protocol with the parent — build the method, then time one step per
``step`` line read from stdin and report the memory on ``finish``, one tagged JSON line each."""
from __future__ import annotations

import json
import resource
import sys
import time
from typing import Optional

from .config import MIB, RESULT_TAG, SKIPPED
from .maxbatch import probe_max_batch
from .methods import build_runner
from .models import Skip


class MemoryMeter:
    """Peak memory increase over a baseline: CUDA allocator statistics, or the process' peak RSS
    on CPU."""

    def __init__(self, device: str):
        import torch

        self.cuda = device == "cuda"
        self.torch = torch
        self.exact_cpu_peak = False

    def start(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            self.base = self.torch.cuda.memory_allocated()
        else:
            self.exact_cpu_peak = _reset_peak_rss()
            self.base = _rss_bytes() if self.exact_cpu_peak else _maxrss_bytes()

    def peak(self) -> int:
        """Peak bytes since ``start`` (absolute). On the CPU the kernel's VmHWM, which ``start``
        reset — not ``getrusage``'s ``ru_maxrss``: that one also keeps the high-water mark the
        process had before ``exec``, i.e. the RSS of the parent it was forked from (a benchmark
        parent holding models of its own would show through as every child's peak)."""
        if self.cuda:
            self.torch.cuda.synchronize()
            return self.torch.cuda.max_memory_allocated()
        return _status_bytes("VmHWM:") if self.exact_cpu_peak else _maxrss_bytes()

    def reserved_peak(self) -> Optional[int]:
        """CUDA: peak bytes the caching allocator reserved from the driver since ``start``
        (absolute; what must fit on the device — above the allocated peak by what the allocator's
        segments hold unused); None on the CPU."""
        return self.torch.cuda.max_memory_reserved() if self.cuda else None

    def delta_mib(self, nbytes: int) -> float:
        return max(nbytes - self.base, 0) / MIB

    def held_mib(self) -> float:
        """Memory still held over the baseline (after garbage collection): a leak shows here."""
        import gc

        gc.collect()
        return self.delta_mib(self.torch.cuda.memory_allocated() if self.cuda else _rss_bytes())


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (Linux ≥ 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_bytes() -> int:
    return _status_bytes("VmRSS:")


def _status_bytes(field: str) -> int:
    """A size field of ``/proc/self/status`` (``VmRSS:``, ``VmHWM:``) in bytes; the peak RSS where
    it is missing."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return _maxrss_bytes()


def _maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def emit(payload: dict) -> None:
    """Send one message to the parent (the only lines the child writes that the parent reads)."""
    print(RESULT_TAG + json.dumps(payload), flush=True)


def error_text(e: BaseException) -> str:
    """``Type: first sentence`` of the message, its lines joined (so a list of names on the next
    lines shows)."""
    text = " ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())
    kind = SKIPPED if isinstance(e, Skip) else type(e).__name__ + ":"
    return f"{kind} {text.split('. ')[0]}"[:300]


def run_child(args) -> None:
    """Subprocess entry point: build ``args.only``, then serve ``step`` / ``finish`` requests from
    stdin.

    Replies (one tagged JSON line each): ``{"ready": …}`` once built, ``{"time": s}`` per step,
    the measurements on ``finish``, or ``{"error": …}`` — e.g. a layer Opacus does not support.
    """
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    if args.probe_max_batch:
        try:
            return emit(probe_max_batch(args))
        except Exception as e:  # not an out-of-memory error: the method cannot run at some size
            return emit({"error": error_text(e)})
    notes: dict = {}
    try:
        runner = build_runner(args, args.only, notes)
    except Exception as e:
        return emit({"error": error_text(e), **notes})
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    meter = MemoryMeter(args.device)
    meter.start()
    emit({"ready": True, **notes})
    first_peak = None
    for line in sys.stdin:
        if line.strip() == "step":
            try:
                sync()
                t0 = time.perf_counter()
                runner.step()
                sync()
            except Exception as e:
                return emit({"error": error_text(e)})
            elapsed = time.perf_counter() - t0
            first_peak = meter.peak() if first_peak is None else first_peak
            emit({"time": elapsed})
        elif line.strip() == "finish":
            peak = meter.peak()
            reserved = {"peak_reserved_mib": meter.reserved_peak() / MIB} if meter.cuda else {}
            return emit({"peak_delta_mib": meter.delta_mib(peak),
                         "first_step_peak_delta_mib": meter.delta_mib(first_peak or peak),
                         "peak_total_mib": peak / MIB, "held_mib": meter.held_mib(),
                         **reserved,
                         "exact_cpu_peak": meter.exact_cpu_peak, "note": runner.describe(),
                         "threads": torch.get_num_threads(), **notes})
