"""private_engine.optim.cpu_noise: the CPU noise drawn block by block by several threads, each block
by its own numpy generator spawned from one SeedSequence keyed by 256 bits of the caller's
generator. Every coordinate must be N(0, std²), independent of every other (no block reused within
or across draws), reproducible from the generator whatever the thread count, and as secret as the
generator (all 256 bits of the key count)."""
import math
import multiprocessing
import os

import numpy as np
import pytest
import torch

from private_engine import optim as pe_optim
from private_engine.foundation import randomness
from private_engine.optim import cpu_noise


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 1000 coordinates, drawn blocked whatever the number of threads."""
    monkeypatch.setattr(cpu_noise, "BLOCK", 1000)
    monkeypatch.setattr(cpu_noise, "THREADED_FROM", 1)
    return 1000


@pytest.fixture
def blocked(monkeypatch):
    """The real block size, drawn blocked whatever the number of threads."""
    monkeypatch.setattr(cpu_noise, "THREADED_FROM", 1)


def test_few_threads_draw_one_normal(monkeypatch):
    """Below THREADED_FROM threads, where torch's one-thread normal_ is the faster draw, a chunk
    is one normal_ of the caller's generator; from THREADED_FROM on, the blocks."""
    torch_threads = torch.get_num_threads()
    monkeypatch.setattr(cpu_noise, "BLOCK", 1000)
    monkeypatch.setattr(cpu_noise, "THREADED_FROM", 2)
    try:
        torch.set_num_threads(1)
        serial = cpu_noise.fill_normal_(torch.empty(5000), 1.5, torch.Generator().manual_seed(3))
        torch.set_num_threads(2)
        threaded = cpu_noise.fill_normal_(torch.empty(5000), 1.5,
                                          torch.Generator().manual_seed(3))
    finally:
        torch.set_num_threads(torch_threads)
    expected = torch.empty(5000).normal_(0.0, 1.5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(serial, expected) and not torch.equal(threaded, expected)


def _check_standard_normal(z: torch.Tensor):
    n = z.numel()
    z = z.double()
    assert abs(z.mean().item()) < 5 / math.sqrt(n), z.mean()
    assert abs(z.std().item() - 1) < 6 / math.sqrt(2 * n), z.std()
    inside = (z.abs() < 1).double().mean().item()
    assert abs(inside - 0.6827) < 5 * math.sqrt(0.6827 * 0.3173 / n), inside
    # Kolmogorov–Smirnov distance to Φ (1.95/√n: p ≈ 0.001)
    s = z.sort().values
    cdf = torch.special.ndtr(s)
    k = torch.arange(1, n + 1, dtype=torch.float64) / n
    assert max((k - cdf).abs().max().item(),
               (cdf - (k - 1 / n)).abs().max().item()) < 1.95 / math.sqrt(n)


def test_the_draw_is_numpy_spawned_streams_keyed_by_the_generator(small_blocks):
    """Block k of the draw is ``standard_normal`` of the k-th child of
    ``SeedSequence(key, pool_size=8).spawn(n)``, the key 256 bits from the caller's generator:
    numpy's documented parallel generation, no state written into a torch generator."""
    n = 3 * small_blocks + 17
    t = cpu_noise.fill_normal_(torch.empty(n, dtype=torch.float64), 2.0,
                               torch.Generator().manual_seed(5))
    parent = torch.Generator().manual_seed(5)
    words = torch.randint(0, 1 << 32, (8,), generator=parent, dtype=torch.int64).tolist()
    key = sum(w << (32 * i) for i, w in enumerate(words))
    children = np.random.SeedSequence(key, pool_size=8).spawn(4)
    expected = np.concatenate([
        np.random.Generator(np.random.PCG64(c)).standard_normal(m)
        for c, m in zip(children, [small_blocks] * 3 + [17])])
    assert torch.equal(t, torch.from_numpy(2.0 * expected))


def test_the_key_has_256_bits_and_every_bit_counts():
    """A key is 256 uniform bits (not a 32- or 64-bit seed), the sequence's pool keeps them all,
    and keys that differ in one bit, low or high, draw unrelated streams."""
    parent = torch.Generator().manual_seed(0)
    keys = [cpu_noise.draw_key(parent) for _ in range(64)]
    assert len(set(keys)) == 64 and all(0 <= k < 2 ** 256 for k in keys)
    bits = torch.tensor([[(k >> b) & 1 for b in range(256)] for k in keys], dtype=torch.float64)
    assert bits.mean().item() == pytest.approx(0.5, abs=0.02)
    assert bits[:, 224:].sum(0).min().item() > 0  # the top word is drawn, not zero
    root = np.random.SeedSequence(keys[0], pool_size=cpu_noise.KEY_WORDS)
    assert root.pool_size * 32 >= 256
    base = cpu_noise.spawned_generators(keys[0], 2)[1].standard_normal(1000)
    for bit in (0, 31, 128, 255):
        other = cpu_noise.spawned_generators(keys[0] ^ (1 << bit), 2)[1].standard_normal(1000)
        assert np.corrcoef(base, other)[0, 1] < 0.2 and not np.isin(base, other).any()
    # two blocks of one draw: independent streams
    a, b = (g.standard_normal(1000) for g in cpu_noise.spawned_generators(keys[0], 2))
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(1000) and not np.isin(a, b).any()


def test_the_engine_noise_is_not_reproducible_from_torch_seed(small_blocks):
    """The engine's default generator has a state from OS entropy: the CPU noise drawn from it
    after the same public ``torch.manual_seed`` differs (float64 draws: in float32, two
    independent draws of 3,000 normals share a value with probability about 0.1)."""
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        generator = pe_optim.noise.engine_noise_generator(torch.nn.Linear(2, 2), None, False)
        draws.append(cpu_noise.fill_normal_(torch.empty(3 * small_blocks, dtype=torch.float64),
                                            1.0, generator))
    assert not torch.isin(draws[0], draws[1]).any()


def test_blocks_are_normal_and_independent(small_blocks):
    gen = torch.Generator().manual_seed(1)
    t = cpu_noise.fill_normal_(torch.empty(20 * small_blocks + 123), 2.5, gen)
    _check_standard_normal(t / 2.5)
    blocks = t[:20 * small_blocks].view(20, small_blocks)
    for b in blocks:
        assert abs(b.mean().item()) < 5 * 2.5 / math.sqrt(small_blocks)
    corr = torch.corrcoef(blocks.double())
    off_diagonal = corr[~torch.eye(20, dtype=torch.bool)]
    assert off_diagonal.abs().max().item() < 5 / math.sqrt(small_blocks)
    # consecutive draws share nothing either (float64: equal values would mean a reused stream,
    # not chance)
    t64, u64 = (cpu_noise.fill_normal_(torch.empty(20 * small_blocks + 123, dtype=torch.float64),
                                       2.5, gen)
                for _ in range(2))
    assert not torch.isin(u64, t64).any() and torch.unique(t64).numel() == t64.numel()
    assert torch.corrcoef(torch.stack([t64, u64]))[0, 1].abs() < 5 / math.sqrt(t64.numel())


def test_the_draw_depends_on_the_generator_not_on_threads(small_blocks):
    torch_threads = torch.get_num_threads()
    try:
        draws = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            draws.append(cpu_noise.fill_normal_(torch.empty(7 * small_blocks + 5), 1.0,
                                                torch.Generator().manual_seed(4)))
    finally:
        torch.set_num_threads(torch_threads)
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[0], draws[2])
    other = cpu_noise.fill_normal_(torch.empty(7 * small_blocks + 5), 1.0,
                                   torch.Generator().manual_seed(5))
    assert not torch.equal(draws[0], other)


def test_default_generator_is_the_parent(small_blocks):
    torch.manual_seed(11)
    a = cpu_noise.fill_normal_(torch.empty(3 * small_blocks), 1.0)
    torch.manual_seed(11)
    b = cpu_noise.fill_normal_(torch.empty(3 * small_blocks), 1.0)
    c = cpu_noise.fill_normal_(torch.empty(3 * small_blocks), 1.0)
    assert torch.equal(a, b) and not torch.equal(b, c)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes(small_blocks, dtype):
    t = cpu_noise.fill_normal_(torch.empty(4 * small_blocks, dtype=dtype), 3.0,
                               torch.Generator().manual_seed(2))
    assert t.dtype == dtype
    _check_standard_normal(t.double() / 3.0)


def test_serial_draw_where_blocks_do_not_apply(small_blocks):
    """Small or strided tensors: one normal_ of the caller's generator."""
    def serial(t, seed, std=1.5):
        return t.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))

    small = torch.empty(2 * small_blocks - 1)
    assert torch.equal(cpu_noise.fill_normal_(small.clone(), 1.5, torch.Generator().manual_seed(3)),
                       serial(small, 3))
    def strided():
        return torch.empty(5 * small_blocks, 2)[:, 0]

    assert not strided().is_contiguous()
    assert torch.equal(cpu_noise.fill_normal_(strided(), 1.5, torch.Generator().manual_seed(3)),
                       serial(strided(), 3))


def test_a_changed_layout_is_refused(monkeypatch):
    """The layout check fails when the state words are not where it expects them (simulated by
    another offset)."""
    monkeypatch.setattr(randomness, "_WORDS", 32)
    assert randomness._verified_template() is None


def test_add_gaussian_noise_uses_the_blocks(small_blocks):
    """The engine's noise at the real sizes goes through the blocked draw (a ViT-Tiny's 5.5 M
    coordinates: 6 blocks of 2²⁰): same numbers as fill_normal_ from the same generator, and
    N(0, std²)."""
    tensors = [torch.zeros(3 * small_blocks), torch.zeros(40, 100)]
    pe_optim.add_gaussian_noise(tensors, 0.5, torch.Generator().manual_seed(8))
    expected = cpu_noise.fill_normal_(torch.empty(3 * small_blocks + 4000), 0.5,
                                      torch.Generator().manual_seed(8))
    assert torch.equal(torch.cat([t.flatten() for t in tensors]), expected)
    _check_standard_normal(expected / 0.5)


def test_real_block_size_draw(blocked):
    t = cpu_noise.fill_normal_(torch.empty(2 * cpu_noise.BLOCK + 17, dtype=torch.float64), 1.0,
                               torch.Generator().manual_seed(6))
    _check_standard_normal(t)
    first, second = t[:cpu_noise.BLOCK], t[cpu_noise.BLOCK:2 * cpu_noise.BLOCK]
    assert not torch.isin(first, second).any()


def _draw_in_child(queue):
    t = cpu_noise.fill_normal_(torch.empty(6000), 1.0, torch.Generator().manual_seed(9))
    queue.put(t.tolist()[:5])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_draws_with_its_own_threads(small_blocks):
    """A DataLoader-style fork after the pool exists: the child's copy of the pool has no threads;
    it must make its own instead of waiting forever."""
    cpu_noise.fill_normal_(torch.empty(6000), 1.0)  # the parent's pool exists
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_draw_in_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung drawing noise")
    assert child.exitcode == 0
    expected = cpu_noise.fill_normal_(torch.empty(6000), 1.0, torch.Generator().manual_seed(9))
    assert queue.get(timeout=5) == expected.tolist()[:5]


def test_seeded_draw_is_stable_across_releases(blocked):
    """A seeded generator draws the same noise from one release to the next with the same numpy
    (reproducible runs and resumed checkpoints): the blocks' streams depend only on the key drawn
    from the generator and on numpy's SeedSequence, PCG64 and ``standard_normal``."""
    t = torch.zeros(3 * cpu_noise.BLOCK)
    cpu_noise.fill_normal_(t, 1.0, torch.Generator().manual_seed(7))
    second_block = [float(v) for v in t[cpu_noise.BLOCK:cpu_noise.BLOCK + 3]]
    assert second_block == [1.0687363147735596, -1.0414702892303467, 2.004035472869873]
