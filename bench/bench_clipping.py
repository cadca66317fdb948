#!/usr/bin/env python
"""The clipping benchmark's command: seconds per step, peak memory and maximum batch size of
non-private training, private_engine and Opacus, in one run (docs/benchmarks.md; the Makefile's
bench, bench-gpu and bench-all targets).

    python bench/bench_clipping.py --help

A thin script: the benchmark is the package ``bench.clipping`` (its docstring says what is
measured and how; one module per job). Each method's child process runs this script too, with
``--only METHOD``.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: package `bench`
from bench.clipping.run import main  # noqa: E402

if __name__ == "__main__":
    main()
