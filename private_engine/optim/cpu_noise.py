"""Gaussian noise on the CPU, drawn by several threads and reproducible from one generator.

torch's CPU ``normal_`` is single-threaded: its Mersenne Twister (MT19937) hands out one number at a
time under a lock, about 6 ns per coordinate — ≈ 35 ms for ViT-Tiny's 5.5 M parameters, ≈ 0.5 s for
ViT-B's 86 M, every step, with the other cores idle. Here a flat tensor is cut into blocks of
``BLOCK`` coordinates and each block is drawn by its own MT19937 generator, on a pool of
``torch.get_num_threads()`` threads (``normal_`` releases the GIL).

Each block's generator gets a full 19,968-bit state: ``SHAKE-256(key)`` expanded to 624 words per
block, the key (nine 31-bit numbers, 279 bits) drawn from the caller's generator (torch's default
one when none is given). Not 32-bit seeds: torch's CPU generator keeps only the low 32 bits of
``manual_seed`` (``manual_seed(s)`` and ``manual_seed(s + 2**32)`` draw the same numbers), so fresh
seeds at every step would collide by the birthday bound (≈ 5 % over 10⁴ steps of two blocks), and a
collision adds the same noise to two blocks of coordinates — their difference would be released
without noise. Two blocks here share noise only if their hashed states meet within the stream's
length: probability ≈ L / 2^19937. Every coordinate is still N(0, std²) (the Gaussian mechanism's
noise, Abadi et al. 2016; Bu, Mao & Xu 2022, Alg. 1), independent across coordinates, blocks and
steps.

The result depends only on the generator's state and the tensor's size, not on the number of threads
(blocks are fixed; one thread draws them one after another). The states are written into torch's
``get_state()`` layout (:func:`private_engine.randomness.generator_from_words`, checked once
against Python's own MT19937); if it ever differs (another torch version) every draw falls back to
one ``normal_`` of the caller's generator.
"""
from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

import torch

from ..randomness import MT_N, generator_from_words, is_mt19937, mt19937_template

#: coordinates per block (each block has its own generator); fixed, so the noise does not depend on
#: threads
BLOCK = 1 << 20

_lock = threading.Lock()
_pool: Optional[ThreadPoolExecutor] = None
_pool_pid = -1


#: the domain tag hashed with each key: fixed bytes (not the module's name), so that a seeded
#: generator draws the same noise whatever the package layout
_DOMAIN = b"private_engine.cpu_noise"

def fill_normal_(
    t: torch.Tensor, std: float, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """``t ← std·ξ`` in place, ξ ~ N(0, I) (see the module docstring for how the draw is split).

    A CUDA tensor, a tensor smaller than two blocks, a non-contiguous one, a generator that is not
    torch's CPU MT19937 (its state is not the layout checked here), or an unknown layout: one
    ``normal_`` call.
    """
    if (
        t.device.type != "cpu"
        or t.numel() < 2 * BLOCK
        or not t.is_contiguous()
        or not t.is_floating_point()
    ):
        return t.normal_(0.0, std, generator=generator)
    parent = torch.default_generator if generator is None else generator
    template = mt19937_template()
    if template is None or not is_mt19937(parent):
        return t.normal_(0.0, std, generator=generator)
    blocks = t.view(-1).split(BLOCK)
    gens = block_generators(parent, len(blocks), template)
    jobs = list(zip(blocks, gens))
    workers = min(torch.get_num_threads(), len(jobs))
    if workers < 2:
        for block, g in jobs:
            block.normal_(0.0, std, generator=g)
    else:
        list(
            _thread_pool(workers).map(lambda job: job[0].normal_(0.0, std, generator=job[1]), jobs)
        )
    return t


def block_generators(
    parent: torch.Generator, n: int, template: Optional[torch.Tensor] = None
) -> List[torch.Generator]:
    """``n`` CPU generators with full MT19937 states ``SHAKE-256(key)``, ``key`` = nine 31-bit
    numbers (279 bits) drawn from ``parent`` (which advances). Raises if the state layout is not the
    checked one (see :func:`parallel_draw_available`)."""
    template = mt19937_template() if template is None else template
    if template is None:
        raise RuntimeError(
            "this torch's CPU generator state layout is not the one "
            "private_engine.optim.cpu_noise checks."
        )
    key = torch.randint(
        0, 1 << 31, (9,), generator=parent, dtype=torch.int64, device="cpu"
    ).tolist()
    stream = hashlib.shake_256(
        _DOMAIN + b"".join(v.to_bytes(4, "little") for v in key)
    )
    words = torch.frombuffer(bytearray(stream.digest(4 * MT_N * n)), dtype=torch.int32).view(
        n, MT_N
    )
    return [generator_from_words(template, w.to(torch.int64) & 0xFFFFFFFF) for w in words]


def parallel_draw_available() -> bool:
    """Whether this torch's CPU generator state has the layout :func:`block_generators` writes
    (checked once)."""
    return mt19937_template() is not None


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
