"""Benchmarks of private_engine, outside the library and its default tests.

- ``clipping/``: the benchmark of docs/benchmarks.md (``python bench/bench_clipping.py``).
- ``investigate/``: one-off measurements behind docs/engine.md (host cost, A/B, profiles).
- ``tests/``: the benchmark's own tests (``make bench-test``; not part of ``make test``).
"""
