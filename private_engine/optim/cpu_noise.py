"""Gaussian noise on the CPU, drawn block by block on several threads and reproducible from one
generator.

torch's CPU ``normal_`` runs on one thread (one MT19937 stream, then a vectorised Box–Muller
transform): for ResNet-18's 11.2 M parameters it is a large share of a CPU step while the other
cores idle. Here a flat tensor is cut into blocks of ``BLOCK`` coordinates and each block is drawn
by torch's own ``normal_`` from a generator of its own, one call per piece of ``PIECE``
coordinates, on a pool of ``torch.get_num_threads()`` threads (torch releases the GIL while it
draws). Block ``j``'s generator is an MT19937 (Matsumoto &
Nishimura 1998) whose whole state — 624 words of 32 bits — is SHAKE-256 of a domain tag, a key of
``KEY_WORDS`` 32-bit words (256 bits) drawn from the caller's generator, and ``j``
(:func:`block_generator`): the noise is as secret as the key, and the key as secret as the
generator it is drawn from — the engine's is seeded from OS entropy
(:func:`private_engine.foundation.randomness.entropy_seeded_generator`). Distinct ``(key, j)``
give unrelated states (an extendable-output hash of distinct inputs), so no two blocks, and no two
draws (each draws a fresh key), share noise. Every coordinate is N(0, std²) (the Gaussian
mechanism's noise, Abadi et al. 2016; Bu, Mao & Xu 2022, Alg. 1), independent across coordinates,
blocks and steps.

:func:`add_normal_` adds the noise to a tensor piece by piece, each piece drawn into a scratch
piece and added while it is still in the cache: one pass over the tensor instead of a draw into a
buffer of its size and a second pass that adds it (the scratch lives for one block: nothing is
held between draws). The result depends only on the generator's state
and the tensor's size, not on the number of threads (blocks are fixed; one thread draws them one
after another). float16 and bfloat16 blocks are drawn in float32 and rounded once. Where torch's
generator state has an unknown layout (:func:`private_engine.foundation.randomness.
mt19937_template` is None) no state can be written: the draw is one ``normal_`` of the caller's
generator.
"""
from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional

import torch

from ..foundation.randomness import MT_N, generator_from_words, mt19937_template

#: coordinates per block (each block has its own generator); fixed, so the noise does not depend on
#: threads
BLOCK = 1 << 20
#: coordinates drawn by one ``normal_`` call within a block (1 MiB of float32: a scratch piece
#: that stays in the cache while it is added)
PIECE = 1 << 18
#: 32-bit words of key drawn from the caller's generator per draw (256 bits)
KEY_WORDS = 8
#: the domain tag hashed with a key and a block index into a block's generator state
_BLOCK_DOMAIN = b"private_engine.optim.cpu_noise.block"

_lock = threading.Lock()
_pool: Optional[ThreadPoolExecutor] = None
_pool_pid = -1


def fill_normal_(
    t: torch.Tensor, std: float, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """``t ← std·ξ`` in place, ξ ~ N(0, I), block by block (see the module docstring).

    A CUDA tensor, a tensor smaller than two blocks, a non-contiguous or non-floating one, a
    generator that is not on the CPU, or an unknown generator layout: one ``normal_`` call of
    ``generator`` (torch's default one if None).
    """
    if not _blocked(t, generator):
        return t.normal_(0.0, std, generator=generator)
    _by_blocks(t, generator, lambda block, gen: _draw_pieces(block, gen, std, add=False))
    return t


def add_normal_(
    t: torch.Tensor, std: float, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """``t ← t + std·ξ`` in place, with ξ what :func:`fill_normal_` draws for a tensor of ``t``'s
    size from the same generator state: each piece drawn into a scratch piece (``normal_``) and
    added (``add_``) while it is in the cache. Where :func:`fill_normal_` draws one ``normal_``,
    one ``normal_`` into a scratch tensor of ``t``'s size, then one ``add_``."""
    if not _blocked(t, generator):
        return t.add_(torch.empty_like(t).normal_(0.0, std, generator=generator))
    _by_blocks(t, generator, lambda block, gen: _draw_pieces(block, gen, std, add=True))
    return t


def _draw_pieces(block: torch.Tensor, gen: torch.Generator, std: float, add: bool) -> None:
    """``block ← std·ξ`` (``add``: ``block + std·ξ``) piece by piece of ``PIECE`` elements, ξ from
    ``gen``: float32 and float64 blocks drawn in place (added from a scratch piece of their
    dtype); 16-bit blocks drawn into a float32 scratch piece and rounded once."""
    wide = block.dtype in (torch.float32, torch.float64)
    if wide and not add:
        for piece in block.split(PIECE):
            piece.normal_(0.0, std, generator=gen)
        return
    scratch = torch.empty(min(PIECE, block.numel()),
                          dtype=block.dtype if wide else torch.float32)
    for piece in block.split(PIECE):
        drawn = scratch[:piece.numel()].normal_(0.0, std, generator=gen)
        if add:
            piece.add_(drawn)
        else:
            piece.copy_(drawn)


def _blocked(t: torch.Tensor, generator: Optional[torch.Generator]) -> bool:
    """Whether ``t`` is drawn block by block (else one ``normal_`` of ``generator``)."""
    parent = torch.default_generator if generator is None else generator
    return (t.device.type == "cpu" and t.numel() >= 2 * BLOCK and t.is_contiguous()
            and t.is_floating_point() and parent.device.type == "cpu"
            and mt19937_template() is not None)


def _by_blocks(t: torch.Tensor, generator: Optional[torch.Generator],
               draw: Callable[[torch.Tensor, torch.Generator], None]) -> None:
    """``draw(block_j, generator_j)`` for every block ``j`` of ``t``, on
    ``min(torch.get_num_threads(), blocks)`` threads."""
    parent = torch.default_generator if generator is None else generator
    blocks = t.detach().view(-1).split(BLOCK)
    key = draw_key(parent)

    def job(j: int) -> None:
        draw(blocks[j], block_generator(key, j))

    workers = min(torch.get_num_threads(), len(blocks))
    if workers < 2:
        for j in range(len(blocks)):
            job(j)
    else:
        list(_thread_pool(workers).map(job, range(len(blocks))))


def draw_key(parent: torch.Generator) -> int:
    """A key of ``32·KEY_WORDS`` = 256 bits: ``KEY_WORDS`` uniform 32-bit words drawn from
    ``parent``, ``Σ_i w_i·2^(32 i)``."""
    words = torch.randint(0, 1 << 32, (KEY_WORDS,), generator=parent, dtype=torch.int64,
                          device="cpu").tolist()
    return sum(w << (32 * i) for i, w in enumerate(words))


def block_words(key: int, j: int) -> torch.Tensor:
    """The MT19937 state of block ``j`` under ``key``: the 624 little-endian 32-bit words of
    ``SHAKE-256(tag ‖ key as 32 bytes ‖ j as 8 bytes)`` (as int64 values < 2³²)."""
    stream = hashlib.shake_256(_BLOCK_DOMAIN + key.to_bytes(4 * KEY_WORDS, "little")
                               + j.to_bytes(8, "little"))
    words = torch.frombuffer(bytearray(stream.digest(4 * MT_N)), dtype=torch.int32)
    return words.to(torch.int64) & 0xFFFFFFFF


def block_generator(key: int, j: int) -> torch.Generator:
    """A CPU generator whose whole MT19937 state is :func:`block_words` of ``(key, j)``."""
    template = mt19937_template()
    if template is None:
        raise RuntimeError("this torch's CPU generator state has an unknown layout: no block "
                           "generator can be written (the draw is one normal_ instead).")
    return generator_from_words(template, block_words(key, j))


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


__all__: List[str] = ["BLOCK", "KEY_WORDS", "fill_normal_", "add_normal_", "draw_key",
                      "block_words", "block_generator"]
