"""Running the methods, parent side: one child process per method driven step by step over a
pipe (interleaved or sequential), the CPU memory pass, the ``--max-batch`` probes, or every
method timed in this one process; then the per-round time ratios to non-private training."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from typing import Dict, List, Optional

from .cli import child_command
from .config import RESULT_TAG
from .measure import error_text
from .methods import Runner, build_runner


def child_env(args, memory: bool = False) -> Dict[str, str]:
    """The subprocess environment. For the CPU memory pass (``memory``), glibc's malloc gets a
    fixed mmap threshold: by default it raises the threshold as large blocks are freed and then
    keeps freed memory in its heap, so the peak RSS would count freed memory and depend on the
    allocation history (with the fixed threshold, the peak RSS increase matches PyTorch's own peak
    of allocated bytes within a few MiB). Timing runs keep the default allocator: the fixed
    threshold maps and faults in every large block again at each step, which slowed non-private
    ViT-Tiny steps by ~40 % and distorted the ratios."""
    env = dict(os.environ)
    if args.cuda_alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = args.cuda_alloc_conf
    if args.device == "cpu" and memory:
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
        env.setdefault("MALLOC_TRIM_THRESHOLD_", "65536")
    return env


class Worker:
    """One method in its own subprocess, driven step by step."""

    def __init__(self, args, method: str, memory: bool = False, probe_max_batch: bool = False):
        import queue
        import tempfile
        import threading

        self.method, self.timeout = method, args.timeout
        self.result: dict = {"method": method, "times": []}
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(child_command(args, method, probe_max_batch),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, bufsize=1,
                                     env=child_env(args, memory))
        self.replies: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        # "ready" with the model notes (or the setup error; or the max batch)
        ready = self._request(None)
        self.result.update({k: v for k, v in ready.items() if k != "ready"})
        if probe_max_batch:
            self.close()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(RESULT_TAG):
                self.replies.put(line[len(RESULT_TAG):])
        self.replies.put(None)  # the child exited

    @property
    def ok(self) -> bool:
        return "error" not in self.result

    def _request(self, command: Optional[str]) -> dict:
        """Send ``command`` (None: just wait) and return the child's reply; failures end in
        ``result["error"]``."""
        import queue

        if not self.ok:
            return {}
        try:
            if command is not None:
                self.proc.stdin.write(command + "\n")
                self.proc.stdin.flush()
            line = self.replies.get(timeout=self.timeout)
        except (queue.Empty, BrokenPipeError, OSError):
            line = None
            if self.proc.poll() is None:
                self.result["error"] = f"timed out after {self.timeout:.0f} s"
        if line is None:
            self.result.setdefault("error", self._crash_reason())
            self.close()
            return {}
        reply = json.loads(line)
        if "error" in reply:
            self.result.update(reply)  # the error, and the model notes when it was built
            self.close()
        return reply

    def _crash_reason(self) -> str:
        self.proc.poll()
        self.stderr.seek(0)
        tail = (self.stderr.read().strip().splitlines() or ["no output"])[-1]
        return f"crashed (exit {self.proc.returncode}): {tail}"[:300]

    def step(self) -> None:
        reply = self._request("step")
        if "time" in reply:
            self.result["times"].append(reply["time"])

    def finish(self) -> dict:
        self.result.update(self._request("finish"))
        self.close()
        return self.result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def run_all(args, methods: List[str]) -> Dict[str, dict]:
    """Run the methods, each in its own subprocess; return ``{method: result}``.

    "interleaved": all subprocesses are built first, then each round runs one step of every
    method (the starting method rotates), so a change in background load hits all methods alike.
    "sequential": one method after the other (one subprocess alive at a time).
    """
    from tqdm import tqdm

    rounds = args.warmup + args.steps
    memory_pass = args.device == "cpu"
    bar = tqdm(total=len(methods) * (rounds + 1 + 3 * memory_pass + args.max_batch), unit="step")

    def start(method):
        bar.set_postfix_str(f"building {method}")
        worker = Worker(args, method)
        bar.update()
        return worker

    def steps(worker, n):
        for _ in range(n):
            bar.set_postfix_str(worker.method)
            worker.step()
            bar.update()

    results = {}
    if args.schedule == "one-process":
        results = time_in_this_process(args, methods, bar)
    elif args.schedule == "sequential":
        for method in methods:
            worker = start(method)
            steps(worker, rounds)
            results[method] = worker.finish()
            bar.write(progress_line(method, results[method], args.warmup))
    else:
        workers = [start(m) for m in methods]
        for r in range(rounds):
            k = r % len(workers)
            for worker in workers[k:] + workers[:k]:
                steps(worker, 1)
        results = {w.method: w.finish() for w in workers}
    if memory_pass:  # a short second run per method with the fixed mmap threshold: memory columns
        for method in methods:
            if "error" in results[method]:
                bar.update(3)
                continue
            worker = Worker(args, method, memory=True)
            bar.update()
            steps(worker, 2)
            mem = worker.finish()
            for key in ("peak_delta_mib", "first_step_peak_delta_mib", "held_mib",
                        "exact_cpu_peak"):
                if key in mem:
                    results[method][key] = mem[key]
            if "error" in mem:
                results[method]["error"] = "memory pass: " + mem["error"]
    if args.max_batch:
        for method in methods:
            bar.set_postfix_str(f"max batch of {method}")
            if "error" not in results[method]:
                probe = Worker(args, method, probe_max_batch=True).result
                results[method]["max_batch"] = probe.get("max_batch")
                if "oom" in probe:
                    results[method]["max_batch_oom"] = probe["oom"]
                if "error" in probe:
                    results[method]["max_batch_error"] = probe["error"]
                bar.write(f"{method}: max batch {probe.get('max_batch')}"
                          + (f" ({probe['error']})" if "error" in probe else ""))
            bar.update()
    bar.close()
    for r in results.values():  # drop warm-up steps
        r["times"] = r["times"][args.warmup:]
        if r.get("times") and "error" not in r:
            r["median_s"] = statistics.median(r["times"])
    add_paired_ratios(results)
    return results


def progress_line(method: str, result: dict, warmup: int) -> str:
    """One line on a finished method (its median step after the warm-up, its memory, or its
    error), printed as it ends so that a run stopped later still shows it."""
    if "error" in result:
        return f"{method}: error: {result['error']}"
    times = result.get("times", [])[warmup:]
    memory = {k: round(v, 1) for k, v in result.items() if k.endswith("_mib")}
    median = f"{statistics.median(times):.4f} s" if times else "no timed step"
    return f"{method}: median {median} over {len(times)} steps; {memory}"


def time_in_this_process(args, methods: List[str], bar) -> Dict[str, dict]:
    """``--schedule one-process``: build every method here and time one step of each per round
    (the starting method rotates), as the interleaved schedule does across subprocesses. On a
    shared VM a subprocess can run 10–20 % slower than another for its whole life, which neither
    interleaving nor repeats remove; in one process every method meets the same allocator, caches
    and placement; before each step the heap's free memory is given back
    (:func:`release_free_heap`). Returns ``{method: {"times": [...], notes}}``."""
    import warnings

    import torch

    results: Dict[str, dict] = {}
    runners: Dict[str, Runner] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for method in methods:
            bar.set_postfix_str(f"building {method}")
            notes: dict = {}
            try:
                runners[method] = build_runner(args, method, notes)
                results[method] = {"method": method, "times": [], **notes}
            except Exception as e:  # noqa: BLE001 - e.g. a layer Opacus does not support: a row
                results[method] = {"method": method, "times": [], "error": error_text(e),
                                   **notes}
            bar.update()
        live = list(runners)
        for r in range(args.warmup + args.steps):
            k = r % max(len(live), 1)
            for method in live[k:] + live[:k]:
                bar.set_postfix_str(method)
                if "error" not in results[method]:
                    try:
                        # what the previous method freed goes back to the OS, as between processes
                        release_free_heap()
                        t0 = time.perf_counter()
                        runners[method].step()
                        results[method]["times"].append(time.perf_counter() - t0)
                    except Exception as e:  # noqa: BLE001
                        results[method]["error"] = error_text(e)
                bar.update()
            bar.update(len(methods) - len(live))
    for method in live:
        results[method].update(note=runners[method].describe(), threads=torch.get_num_threads())
    return results


def release_free_heap() -> None:
    """``malloc_trim(0)`` (glibc): give the heap's free memory back to the OS, so that a method
    timed after another in one process meets a heap as small as its own would be, not the pages
    another method's larger steps left mapped. Without it, ViT-Tiny's non-DP steps took 0.90 s in
    a one-process run with Opacus and 0.74 s in one without, while bk_mixed's took 0.95 and
    0.94 s (1.07× against 1.21×); with it, 1.16× and 1.18×, with min–max spreads halved. A no-op
    where glibc is not the allocator."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def add_paired_ratios(results: Dict[str, dict]) -> None:
    """``time_ratio``: median over rounds of (step time / non-DP step time of the same round)."""
    ref = results.get("nondp", {}).get("times")
    for r in results.values():
        if ref and r.get("times") and len(r["times"]) == len(ref) and "error" not in r:
            r["time_ratio"] = statistics.median(t / t0 for t, t0 in zip(r["times"], ref))
