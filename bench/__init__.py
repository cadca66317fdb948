"""Benchmarks of private_engine, outside the library and its default tests.

- ``clipping/``: the benchmark of docs/benchmarks.md (``python bench/bench_clipping.py``).
- ``investigate/``: one-off measurements behind docs/engine.md (host cost, A/B, profiles).
- ``tests/``: the benchmark's own tests (``make bench-test``; not part of ``make test``).

The scripts put the repository first on ``sys.path`` (to import this package), which also makes
its ``private_engine`` the one measured. ``PE_ENGINE_DIR=DIR`` (a folder holding another
checkout's ``private_engine`` package) puts ``DIR`` before it, for the benchmark and its child
processes alike, to measure that version with this benchmark (an A/B on one machine).
"""
import os as _os
import sys as _sys

_other = _os.environ.get("PE_ENGINE_DIR")
if _other:
    _other = _os.path.abspath(_other)
    if not _os.path.isdir(_os.path.join(_other, "private_engine")):
        raise SystemExit(f"PE_ENGINE_DIR={_other} holds no private_engine package")
    if _other not in _sys.path[:1]:
        _sys.path.insert(0, _other)
