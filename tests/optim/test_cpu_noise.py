"""private_engine.optim.cpu_noise: the CPU noise drawn block by block by several threads, each block
by torch's ``normal_`` from an MT19937 generator whose whole state is SHAKE-256 of a 256-bit key
drawn from the caller's generator and the block's index. Every coordinate must be N(0, std²),
independent of every other (no block reused within or across draws), reproducible from the
generator whatever the thread count, and as secret as the generator (all 256 bits of the key
count); ``add_normal_`` adds exactly what ``fill_normal_`` draws."""
import hashlib
import math
import multiprocessing
import os

import pytest
import torch

from private_engine import optim as pe_optim
from private_engine.foundation import randomness
from private_engine.optim import cpu_noise


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 1000 coordinates."""
    monkeypatch.setattr(cpu_noise, "BLOCK", 1000)
    return 1000


@pytest.fixture
def blocked():
    """The real block size."""


def _key(seed: int) -> int:
    """The key ``fill_normal_`` draws first from ``manual_seed(seed)``: 8 words of 32 bits."""
    words = torch.randint(0, 1 << 32, (8,), generator=torch.Generator().manual_seed(seed),
                          dtype=torch.int64).tolist()
    return sum(w << (32 * i) for i, w in enumerate(words))


def _block_generator(key: int, j: int) -> torch.Generator:
    """MT19937 with the state SHAKE-256(tag ‖ key ‖ j), written independently of the module."""
    digest = hashlib.shake_256(b"private_engine.optim.cpu_noise.block" + key.to_bytes(32, "little")
                               + j.to_bytes(8, "little")).digest(4 * 624)
    words = torch.frombuffer(bytearray(digest), dtype=torch.int32).to(torch.int64) & 0xFFFFFFFF
    return randomness.generator_from_words(randomness.mt19937_template(), words)


def test_one_thread_draws_the_blocks_too():
    """The blocks at every thread count (drawing a block into the cache and adding it is the
    faster draw on one thread too): the same numbers on 1 and 2 threads, not one normal_ of
    the caller's generator."""
    torch_threads = torch.get_num_threads()
    n = 2 * cpu_noise.BLOCK + 3
    try:
        draws = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            draws.append(cpu_noise.fill_normal_(torch.empty(n), 1.5,
                                                torch.Generator().manual_seed(3)))
    finally:
        torch.set_num_threads(torch_threads)
    serial = torch.empty(n).normal_(0.0, 1.5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], serial)


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


def test_block_j_is_normal_of_its_shake_keyed_generator(small_blocks, monkeypatch):
    """Block j of the draw is torch's ``normal_(0, std)``, one call per piece, from the MT19937
    generator whose whole state is SHAKE-256(tag ‖ key ‖ j), the key 256 bits from the caller's
    generator."""
    monkeypatch.setattr(cpu_noise, "PIECE", 300)
    n = 3 * small_blocks + 17
    t = cpu_noise.fill_normal_(torch.empty(n, dtype=torch.float64), 2.0,
                               torch.Generator().manual_seed(5))
    key = _key(5)
    expected = []
    for j, m in enumerate([small_blocks] * 3 + [17]):
        gen = _block_generator(key, j)
        expected += [torch.empty(k, dtype=torch.float64).normal_(0.0, 2.0, generator=gen)
                     for k in ([300, 300, 300, 100] if m == small_blocks else [m])]
    assert torch.equal(t, torch.cat(expected))


def test_the_key_has_256_bits_and_every_bit_counts():
    """A key is 256 uniform bits (not a 32- or 64-bit seed), a block's state is all 624 words
    hashed from it, and keys that differ in one bit, low or high, draw unrelated streams."""
    parent = torch.Generator().manual_seed(0)
    keys = [cpu_noise.draw_key(parent) for _ in range(64)]
    assert len(set(keys)) == 64 and all(0 <= k < 2 ** 256 for k in keys)
    bits = torch.tensor([[(k >> b) & 1 for b in range(256)] for k in keys], dtype=torch.float64)
    assert bits.mean().item() == pytest.approx(0.5, abs=0.02)
    assert bits[:, 224:].sum(0).min().item() > 0  # the top word is drawn, not zero
    words = cpu_noise.block_words(keys[0], 1)
    assert words.numel() == 624 and torch.unique(words).numel() == 624

    def stream(key, j):
        return torch.randn(1000, dtype=torch.float64, generator=cpu_noise.block_generator(key, j))

    base = stream(keys[0], 1)
    for bit in (0, 31, 128, 255):
        other = stream(keys[0] ^ (1 << bit), 1)
        assert torch.corrcoef(torch.stack([base, other]))[0, 1].abs() < 0.2
        assert not torch.isin(base, other).any()
    # two blocks of one draw: independent streams
    a, b = stream(keys[0], 0), stream(keys[0], 1)
    assert torch.corrcoef(torch.stack([a, b]))[0, 1].abs() < 5 / math.sqrt(1000)
    assert not torch.isin(a, b).any()


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
    """A seeded generator draws the same noise from one release to the next (reproducible runs and
    resumed checkpoints): the blocks' streams depend only on the key drawn from the generator, on
    SHAKE-256 and on torch's MT19937 and ``normal_``."""
    t = torch.zeros(3 * cpu_noise.BLOCK)
    cpu_noise.fill_normal_(t, 1.0, torch.Generator().manual_seed(7))
    second_block = [float(v) for v in t[cpu_noise.BLOCK:cpu_noise.BLOCK + 3]]
    assert second_block == SECOND_BLOCK


@pytest.mark.parametrize("size", [3500, 1999])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_add_normal_adds_what_fill_normal_draws(small_blocks, size, dtype, monkeypatch):
    """``t + std·ξ`` with ξ the very draw of ``fill_normal_`` from the same generator state, blocked
    (3.5 blocks) or not (under two blocks); bitwise (one rounding of each noise value and of the
    sum); blocks of bfloat16 from the float32 draw, rounded once with the sum; pieces of 300."""
    monkeypatch.setattr(cpu_noise, "PIECE", 300)
    base = torch.linspace(-3.0, 3.0, size, dtype=dtype)
    added = cpu_noise.add_normal_(base.clone(), 0.7, torch.Generator().manual_seed(12))
    if dtype == torch.bfloat16 and size >= 2 * small_blocks:  # blocks: drawn in float32
        noise = cpu_noise.fill_normal_(torch.empty(size), 0.7, torch.Generator().manual_seed(12))
        expected = (base.float() + noise).to(dtype)
    else:
        noise = cpu_noise.fill_normal_(torch.empty(size, dtype=dtype), 0.7,
                                       torch.Generator().manual_seed(12))
        expected = base + noise
    assert added.dtype == dtype and torch.equal(added, expected)
    if dtype != torch.bfloat16:
        _check_standard_normal((added - base) / 0.7)


def test_add_normal_on_threads_matches_one_thread(small_blocks):
    torch_threads = torch.get_num_threads()
    try:
        out = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out.append(cpu_noise.add_normal_(torch.ones(9 * small_blocks + 7), 1.0,
                                             torch.Generator().manual_seed(13)))
    finally:
        torch.set_num_threads(torch_threads)
    assert torch.equal(out[0], out[1])


def test_a_flat_buffer_is_noised_by_add_normal(small_blocks, monkeypatch):
    """The engine's flat buffer of clipped sums (one contiguous tensor) gets its noise from
    ``add_normal_`` (no scratch of its size), the same numbers as ``fill_normal_`` of its size."""
    calls = []
    add_normal = cpu_noise.add_normal_

    def spy(t, std, generator=None):
        calls.append(t.numel())
        return add_normal(t, std, generator)

    monkeypatch.setattr(cpu_noise, "add_normal_", spy)
    buffer = torch.arange(5 * small_blocks, dtype=torch.float32)
    pe_optim.add_gaussian_noise([buffer], 0.5, torch.Generator().manual_seed(14))
    assert calls == [5 * small_blocks]
    expected = torch.arange(5 * small_blocks, dtype=torch.float32) + cpu_noise.fill_normal_(
        torch.empty(5 * small_blocks), 0.5, torch.Generator().manual_seed(14))
    assert torch.equal(buffer, expected)


#: the first three coordinates of the second block of ``fill_normal_(zeros(3·BLOCK), 1,
#: manual_seed(7))``
SECOND_BLOCK = [-0.12503550946712494, -0.9903742671012878, 0.1833602637052536]
