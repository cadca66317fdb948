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
``get_state()`` layout; that layout is checked once against Python's own MT19937 (``random``), and
if it ever differs (another torch version) every draw falls back to one ``normal_`` of the caller's
generator.
"""
from __future__ import annotations

import hashlib
import os
import random
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

import torch

#: coordinates per block (each block has its own generator); fixed, so the noise does not depend on
#: threads
BLOCK = 1 << 20

_MT_N = 624  # words of MT19937 state
_STATE_BYTES = 5056  # sizeof(CPUGeneratorImplState), torch ≥ 1.6 (checked at run time)
_LEFT, _NEXT, _WORDS = 8, 16, 24  # byte offsets of `left`, `next` and the 624 uint64 state words
_NORMAL_VALID, _FLOAT_NORMAL_VALID = 5040, 5052  # cached Box–Muller samples: must read "not valid"

_lock = threading.Lock()
_template: Optional[torch.Tensor] = None
_checked = False
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
    template = _checked_template()
    if template is None or not _is_mt19937(parent):
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
    template = _checked_template() if template is None else template
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
    words = torch.frombuffer(bytearray(stream.digest(4 * _MT_N * n)), dtype=torch.int32).view(
        n, _MT_N
    )
    return [_generator_from_words(template, w.to(torch.int64) & 0xFFFFFFFF) for w in words]


def parallel_draw_available() -> bool:
    """Whether this torch's CPU generator state has the layout :func:`block_generators` writes
    (checked once)."""
    return _checked_template() is not None


def _generator_from_words(template: torch.Tensor, words: torch.Tensor) -> torch.Generator:
    """A CPU generator whose MT19937 state is ``words`` (624 values < 2³²), positioned so that its
    next draw twists the state first (``left = 1``, ``next = 0``: what a freshly seeded generator
    holds)."""
    state = template.clone()
    state[_WORDS : _WORDS + 8 * _MT_N] = words.view(torch.uint8)
    g = torch.Generator()
    g.set_state(state)
    return g


def _checked_template() -> Optional[torch.Tensor]:
    """A freshly seeded CPU generator's state, if its layout is the expected one; else None. The
    check: the state words of ``manual_seed(5489)`` are MT19937's initialisation, ``left``/``next``
    are 1/0, no cached normal sample; a generator given words W by :func:`_generator_from_words`
    twists W as Python's ``random`` (MT19937) does; and the words of seed 5489 written by hand draw
    what ``manual_seed(5489)`` draws."""
    global _template, _checked
    with _lock:
        if _checked:
            return _template
        _checked = True
        try:
            _template = _verified_template()
        except Exception:  # noqa: BLE001 - any surprise means: do not write states, draw serially
            _template = None
        return _template


def _verified_template() -> Optional[torch.Tensor]:
    if sys.byteorder != "little":
        return None
    g = torch.Generator()
    g.manual_seed(5489)
    state = g.get_state()
    if state.dtype != torch.uint8 or state.numel() != _STATE_BYTES:
        return None
    words = state[_WORDS : _WORDS + 8 * _MT_N].view(torch.int64).tolist()
    if words != _mt_init(5489):
        return None
    if (
        state[_LEFT : _LEFT + 4].view(torch.int32).item() != 1
        or state[_NEXT : _NEXT + 8].view(torch.int64).item() != 0
        or state[_NORMAL_VALID : _NORMAL_VALID + 4].view(torch.int32).item() != 0
        or state[_FLOAT_NORMAL_VALID].item() != 0
    ):
        return None
    # words written by _generator_from_words are the MT19937 state: its next draw twists them as
    # Python's MT19937 does, and the initialisation of 5489 written by hand draws what
    # manual_seed(5489) draws
    probe = [(2654435761 * (i + 1)) & 0xFFFFFFFF for i in range(_MT_N)]
    mine = _generator_from_words(state, torch.tensor(probe, dtype=torch.int64))
    torch.randint(0, 2, (1,), generator=mine)
    reference = random.Random()
    reference.setstate((3, tuple(probe) + (_MT_N,), None))
    reference.getrandbits(32)
    if mine.get_state()[_WORDS : _WORDS + 8 * _MT_N].view(torch.int64).tolist() != list(
        reference.getstate()[1][:_MT_N]
    ):
        return None
    seeded = torch.Generator()
    seeded.manual_seed(5489)
    written = _generator_from_words(state, torch.tensor(_mt_init(5489), dtype=torch.int64))
    if not torch.equal(torch.randn(1000, generator=seeded), torch.randn(1000, generator=written)):
        return None
    return state


def _mt_init(seed: int) -> List[int]:
    """MT19937's state after ``init_genrand(seed)`` (Matsumoto & Nishimura 1998)."""
    mt = [seed & 0xFFFFFFFF]
    for i in range(1, _MT_N):
        mt.append((1812433253 * (mt[-1] ^ (mt[-1] >> 30)) + i) & 0xFFFFFFFF)
    return mt


def _is_mt19937(g: torch.Generator) -> bool:
    """A CPU generator whose state has the size of torch's own MT19937 state (not, e.g., a
    CSPRNG's)."""
    if g.device.type != "cpu":
        return False
    try:
        return g.get_state().numel() == _STATE_BYTES
    except Exception:  # noqa: BLE001 - a generator without a readable state is not ours to split
        return False


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
