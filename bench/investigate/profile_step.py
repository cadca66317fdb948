"""Where one training step's time goes, per method: torch.profiler's top operators (CPU and
device time) and the step's wall time, for the methods of the clipping benchmark
(``bench/bench_clipping.py``) built the same way (same model, batch, autocast).

    python bench/investigate/profile_step.py --device cuda --model vit_base_patch16_224 \\
        --amp bf16 --batch-size 32 --methods nondp bk_mixed --steps 5 --out /tmp/profile

Prints, per method: seconds per step (median of ``--steps`` after ``--warmup``, synchronised),
the number of host↔device synchronisations per step seen by ``torch.cuda.set_sync_debug_mode``
(CUDA), and the operator table (``--by-shape``: one row per operator and input shapes); with
``--out DIR`` also writes ``DIR/<method>.txt`` (the tables) and a Chrome trace
``DIR/<method>.json``. Every method runs in this one process, one after the other (use
bench_clipping.py for comparable timings). The benchmark's other options (``--model``,
``--img-size``, ``--amp``, …) are passed on to it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: package `bench`
from bench.clipping import cli  # noqa: E402
from bench.clipping.config import METHODS  # noqa: E402
from bench.clipping.methods import SETUPS  # noqa: E402
from bench.clipping.models import build_model, make_batch  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["nondp", "bk_mixed"], choices=METHODS)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rows", type=int, default=25, help="operators shown per table")
    p.add_argument("--out", metavar="DIR",
                   help="write the tables and a Chrome trace per method here")
    p.add_argument("--by-shape", action="store_true",
                   help="one row per operator and input shapes (which layer's norm, sum or "
                        "product costs what)")
    return cli.parse_with_benchmark_options(p, argv, "profile_steps")


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def count_syncs(step, device: str) -> int:
    """Host↔device synchronisations in one call of ``step`` (CUDA only: torch's sync debug mode
    warns on each)."""
    import torch

    if device != "cuda":
        return 0
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
            synchronize(device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def device_work(prof, steps: int) -> Tuple[float, float]:
    """Kernels and copies the device ran per step, and the sum of their durations in ms (the
    device's busy time if they never overlap): both 0 on the CPU."""
    from torch.autograd import DeviceType

    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in events)
    return len(events) / steps, busy_us / 1e3 / steps


def profile_method(method: str, args) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    model, _ = build_model(args, method)
    x, y = make_batch(args)
    runner = SETUPS[method](model, x, y, args)
    for _ in range(args.warmup):
        runner.step()
    synchronize(args.device)
    times = []
    for _ in range(args.profile_steps):
        t0 = time.perf_counter()
        runner.step()
        synchronize(args.device)
        times.append(time.perf_counter() - t0)
    syncs = count_syncs(runner.step, args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities, record_shapes=args.by_shape) as prof:
        for _ in range(args.profile_steps):
            runner.step()
        synchronize(args.device)
    sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    device_ops, device_ms = device_work(prof, args.profile_steps)
    averages = prof.key_averages(group_by_input_shape=args.by_shape)
    widths = ({"max_name_column_width": 40, "max_shapes_column_width": 70} if args.by_shape
              else {})
    lines = [f"== {method}: {statistics.median(times):.4f} s/step (median of {len(times)}), "
             f"{syncs} host-device syncs per step; profiled {args.profile_steps} steps; "
             f"{device_ops:.0f} device kernels and copies per step, busy {device_ms:.2f} ms ==",
             averages.table(sort_by=sort, row_limit=args.rows, **widths)]
    if args.device == "cuda":
        lines.append(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows, **widths))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / f"{method}.json"))
    del runner, model, x, y
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    for method in args.methods:
        text = profile_method(method, args)
        print(text, flush=True)
        if args.out:
            (Path(args.out) / f"{method}.txt").write_text(text)


if __name__ == "__main__":
    main()
