#!/usr/bin/env python
"""Milliseconds to draw one step's Gaussian noise on the CPU: the library's
:func:`private_engine.optim.cpu_noise.fill_normal_` against one torch ``normal_`` call, and
optionally against ``fill_normal_`` of another git revision (``--baseline REV``, loaded from
``git show``), at parameter counts of ViT-Tiny (5.7 M) and ViT-B (86 M).

Repetitions are interleaved (each round draws once with every method, in a rotating order), so a
load that comes and goes on the machine hits every method alike; the median over rounds is
reported, with the spread (min–max).

    python bench/bench_cpu_noise.py --sizes 5.7e6 86e6 --rounds 9 --threads 1 2
    python bench/bench_cpu_noise.py --baseline HEAD~1
"""
import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from private_engine.foundation.randomness import entropy_seeded_generator  # noqa: E402
from private_engine.optim import cpu_noise  # noqa: E402


def load_revision(rev: str):
    """``private_engine/optim/cpu_noise.py`` as it is at git revision ``rev``, as a module of
    the package (its relative imports resolve against the package on disk)."""
    source = subprocess.run(["git", "show", f"{rev}:private_engine/optim/cpu_noise.py"],
                            cwd=ROOT, check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "cpu_noise_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("private_engine.optim._cpu_noise_baseline",
                                                  path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[5.7e6, 86e6])
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--baseline", default=None, help="git revision to compare against")
    args = parser.parse_args()

    methods = {"torch normal_ (1 call)": lambda t, g: t.normal_(0.0, 1.0, generator=g),
               "fill_normal_ (this tree)": lambda t, g: cpu_noise.fill_normal_(t, 1.0, g)}
    if args.baseline:
        old = load_revision(args.baseline)
        methods[f"fill_normal_ ({args.baseline})"] = lambda t, g: old.fill_normal_(t, 1.0, g)
    generator = entropy_seeded_generator("cpu")
    print(f"torch {torch.__version__}, {args.rounds} interleaved rounds, median ms [min–max]")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for size in args.sizes:
            t = torch.empty(int(size))
            names = list(methods)
            for fn in methods.values():
                fn(t, generator)  # warm-up: pools, page faults
            times = {name: [] for name in names}
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    start = time.perf_counter()
                    methods[name](t, generator)
                    times[name].append(1e3 * (time.perf_counter() - start))
            for name in names:
                ms = times[name]
                print(f"threads={threads:2d} n={size / 1e6:5.1f}M  {name:32s} "
                      f"{statistics.median(ms):8.1f}  [{min(ms):.1f}–{max(ms):.1f}]")


if __name__ == "__main__":
    main()
