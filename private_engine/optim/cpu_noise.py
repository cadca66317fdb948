"""Gaussian noise on the CPU, drawn by several threads and reproducible from one generator.

torch's CPU ``normal_`` runs on one thread: for ViT-B's 86 M parameters it takes a large share of
a CPU step while the other cores idle. Here a flat tensor is cut into blocks of ``BLOCK``
coordinates and each block is drawn by its own numpy ``Generator`` on a pool of
``torch.get_num_threads()`` threads, with numpy's documented parallel generation ("Parallel
Random Number Generation" in numpy's manual): one ``numpy.random.SeedSequence`` keyed by
``KEY_WORDS`` 32-bit words (256 bits) drawn from the caller's generator, ``spawn``-ed into one
child per block, each child seeding a PCG64 bit generator (O'Neill 2014, "PCG: A Family of Simple
Fast Space-Efficient Statistically Good Algorithms for Random Number Generation"), and
``Generator.standard_normal(out=..., dtype=...)`` filling the block in place (numpy releases the
GIL while it fills). The sequence keeps all 256 bits (``pool_size=8``): the noise is as secret
as the key, and the key as secret as the generator it is drawn from — the engine's is seeded from
OS entropy (:func:`private_engine.foundation.randomness.entropy_seeded_generator`). Spawned children
are independent streams by construction (their spawn keys differ), so no two blocks, and no two
draws (each draws a fresh key), share noise. Every coordinate is N(0, std²) (the Gaussian
mechanism's noise, Abadi et al. 2016; Bu, Mao & Xu 2022, Alg. 1), independent across
coordinates, blocks and steps.

numpy's ziggurat costs about 2.5× torch's vectorised ``normal_`` per coordinate (which runs on
one thread), so the threaded draw is the faster one from about four threads on and the slower one
below: with fewer than ``THREADED_FROM`` intra-op threads (``torch.get_num_threads()``) a chunk is
one ``normal_`` of the caller's generator instead (docs/engine.md, "One step, in order";
``bench/bench_cpu_noise.py``). The result depends only on the generator's state, the tensor's
size and which of the two draws applies, not on the number of threads beyond that (blocks are
fixed; one thread draws them one after another). float16 and bfloat16 blocks are drawn in float32
and rounded once.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

import numpy as np
import torch

#: coordinates per block (each block has its own generator); fixed, so the noise does not depend on
#: threads
BLOCK = 1 << 20
#: 32-bit words of key drawn from the caller's generator per draw (256 bits)
KEY_WORDS = 8
#: intra-op threads from which the blocked draw replaces one ``normal_`` (it is the faster one
#: from there: numpy's ziggurat costs about 2.5× torch's vectorised Box–Muller per coordinate)
THREADED_FROM = 4

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}

_lock = threading.Lock()
_pool: Optional[ThreadPoolExecutor] = None
_pool_pid = -1


def fill_normal_(
    t: torch.Tensor, std: float, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """``t ← std·ξ`` in place, ξ ~ N(0, I) (see the module docstring for how the draw is split).

    A CUDA tensor, a tensor smaller than two blocks, a non-contiguous one, a generator that is
    not on the CPU, or fewer than ``THREADED_FROM`` intra-op threads: one ``normal_`` call of
    ``generator`` (torch's default one if None).
    """
    parent = torch.default_generator if generator is None else generator
    if (
        t.device.type != "cpu"
        or t.numel() < 2 * BLOCK
        or not t.is_contiguous()
        or not t.is_floating_point()
        or parent.device.type != "cpu"
        or torch.get_num_threads() < THREADED_FROM
    ):
        return t.normal_(0.0, std, generator=generator)
    blocks = t.detach().view(-1).split(BLOCK)
    gens = block_generators(parent, len(blocks))

    def draw(job) -> None:
        block, gen = job
        _standard_normal_(block, gen)
        block.mul_(std)

    jobs = list(zip(blocks, gens))
    workers = min(torch.get_num_threads(), len(jobs))
    if workers < 2:
        for job in jobs:
            draw(job)
    else:
        list(_thread_pool(workers).map(draw, jobs))
    return t


def block_generators(parent: torch.Generator, n: int) -> List[np.random.Generator]:
    """``n`` independent numpy generators keyed by :func:`draw_key` of ``parent`` (a CPU
    ``torch.Generator``, which advances): :func:`spawned_generators` of the key."""
    return spawned_generators(draw_key(parent), n)


def draw_key(parent: torch.Generator) -> int:
    """A key of ``32·KEY_WORDS`` = 256 bits: ``KEY_WORDS`` uniform 32-bit words drawn from
    ``parent``, ``Σ_i w_i·2^(32 i)``."""
    words = torch.randint(0, 1 << 32, (KEY_WORDS,), generator=parent, dtype=torch.int64,
                          device="cpu").tolist()
    return sum(w << (32 * i) for i, w in enumerate(words))


def spawned_generators(key: int, n: int) -> List[np.random.Generator]:
    """``[Generator(PCG64(c)) for c in SeedSequence(key, pool_size=KEY_WORDS).spawn(n)]``: the
    sequence's entropy pool holds all ``32·KEY_WORDS`` bits of ``key`` (numpy's default pool keeps
    128), and each child's spawn key differs, so the ``n`` streams are independent."""
    root = np.random.SeedSequence(key, pool_size=KEY_WORDS)
    return [np.random.Generator(np.random.PCG64(child)) for child in root.spawn(n)]


def _standard_normal_(block: torch.Tensor, gen: np.random.Generator) -> None:
    """``block ← ξ``, ξ ~ N(0, I), from ``gen``: in place for float32/float64 (numpy writes the
    tensor's memory), else drawn in float32 and rounded into ``block``'s dtype."""
    dtype = _NUMPY_DTYPES.get(block.dtype)
    if dtype is not None:
        gen.standard_normal(out=block.numpy(), dtype=dtype)
    else:
        block.copy_(torch.from_numpy(gen.standard_normal(block.numel(), dtype=np.float32)))


def _reset_after_fork() -> None:
    """In a forked child the pool's threads and a lock held by another thread do not exist: start
    afresh."""
    global _lock, _pool, _pool_pid
    _lock = threading.Lock()
    _pool, _pool_pid = None, -1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _thread_pool(workers: int) -> ThreadPoolExecutor:
    """The module's pool (recreated in a forked child, whose copy has no threads, or for more
    workers)."""
    global _pool, _pool_pid
    with _lock:
        if _pool is None or _pool_pid != os.getpid() or _pool._max_workers < workers:
            if _pool is not None and _pool_pid == os.getpid():
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix="private_engine-noise"
            )
            _pool_pid = os.getpid()
        return _pool
