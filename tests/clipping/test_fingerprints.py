"""The row fingerprints two-pass and book-keeping releases compare their operands by: what they
are, which changes they see, and that they copy no operand."""
import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from private_engine.clipping import fingerprints, release
from private_engine.clipping.fingerprints import fingerprint_pairs, row_fingerprints


def _bit_sums(t: torch.Tensor, k: int) -> list:
    """Σ_j bits(t_rj) mod 2^k per row, in Python integers (as signed k-bit values)."""
    ints = t.reshape(t.shape[0], -1).view({16: torch.int16, 32: torch.int32,
                                           64: torch.int64}[k]).tolist()
    return [_signed(sum(row), k) for row in ints]


def _signed(s: int, k: int) -> int:
    s %= 2 ** k
    return s - 2 ** k if s >= 2 ** (k - 1) else s


def _weighted_word_sums(t: torch.Tensor, word: torch.dtype) -> list:
    """Σ_m c_m·u_rm mod 2^64 per row in Python integers: the words of at most 32 bits the
    elements' bit patterns split into, times the module's secret weights of that width."""
    words = t.reshape(t.shape[0], -1).view(word)
    c = fingerprints.position_weights(words.shape[1], words.device).tolist()
    return [_signed(sum(ci * ui for ci, ui in zip(c, row)), 64) for row in words.tolist()]


@pytest.mark.parametrize("dtype,k,word", [(torch.float32, 32, torch.int32),
                                          (torch.bfloat16, 16, torch.int16),
                                          (torch.float64, 64, torch.int32)])
@pytest.mark.parametrize("piece", [3000, None], ids=["pieces", "one"])
def test_bit_and_weighted_sums_wrap_around_exactly(dtype, k, word, piece, monkeypatch):
    """Both sums are exact integers modulo 2^k and 2^64, the words widened in one piece or in
    several (pieces of 1,000 words per row)."""
    if piece is not None:
        monkeypatch.setitem(fingerprints.PIECE_WORDS, "cpu", piece)
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(3, 40, 50, generator=g) * 1e6).to(dtype)  # sums far beyond 2^k
    bits, weighted = row_fingerprints(t)
    assert bits.tolist() == _bit_sums(t, k)
    assert weighted.tolist() == _weighted_word_sums(t, word)


def test_fingerprints_of_equal_operands_are_equal():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(16, 197, 192, generator=g)
    other = torch.empty(16, 192, 197).transpose(1, 2).copy_(t)  # other strides, same values
    assert release.same_tensors(row_fingerprints(t), row_fingerprints(other))


@pytest.mark.parametrize("where,value", [
    ((5, 100, 150), None),             # one ulp up
    ((2, 3, 4), 1e-38),                # a tiny element next to O(1) ones
    ((7, 0, 0), -0.0),                 # the sign of a zero
])
def test_a_change_of_one_element_changes_its_rows_fingerprint(where, value):
    g = torch.Generator().manual_seed(2)
    t = torch.randn(16, 197, 192, generator=g)
    t[7, 0, 0] = 0.0
    t[2, 3, 4] = 0.0
    before = row_fingerprints(t)
    changed = t.clone()
    changed[where] = (torch.nextafter(changed[where], torch.tensor(math.inf))
                      if value is None else value)
    after = row_fingerprints(changed)
    row = where[0]
    assert not torch.equal(after[0][row], before[0][row])
    rest = [i for i in range(16) if i != row]
    assert all(torch.equal(x[rest], y[rest]) for x, y in zip(after, before))
    assert not release.same_tensors(fingerprint_pairs([(t, t)]),
                                    fingerprint_pairs([(t, changed)]))


def _largest_allocation(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


def test_fingerprints_copy_no_operand():
    """The fingerprints of a 9.7 MB float32 output gradient hold one piece of ``PIECE_WORDS``
    words widened to int64 (8 MiB) besides their ``(B,)`` results: no cast or copy of the
    operand (a float64 or int64 one would be 19 MB)."""
    a = torch.randn(16, 197, 192)
    g = torch.randn(16, 197, 768)
    fingerprint_pairs([(a, g)])  # the position weights of these widths, drawn once
    largest = _largest_allocation(lambda: fingerprint_pairs([(a, g)]))
    assert 0 < largest <= 8 * fingerprints.PIECE_WORDS["cpu"] < g.numel() * g.element_size()


@pytest.mark.parametrize("move", [
    lambda r: r.flip(-1),                                  # a row read backwards
    lambda r: r.roll(1, -1),                               # shifted by one position
    lambda r: torch.cat([r[1:2], r[0:1], r[2:]]),          # two positions swapped
])
def test_values_moved_between_positions_change_their_rows_fingerprint(move):
    """Moving values between the positions of a row keeps its bit-pattern and value sums (for
    exactly summable values) but changes the ghost norm of a sequence layer: the secret position
    weights see it, for float and integer (token id) operands."""
    g = torch.Generator().manual_seed(3)
    for t in (torch.randint(-8, 8, (4, 6, 5), generator=g).float() * 0.25,
              torch.randint(0, 100, (4, 6), generator=g)):
        changed = t.clone()
        changed[1] = move(t[1])
        before, after = row_fingerprints(t), row_fingerprints(changed)
        assert all(torch.equal(x[1], y[1]) for x, y in zip(before[:-1], after[:-1]))
        assert not torch.equal(before[-1][1], after[-1][1])
        assert not release.same_tensors(fingerprint_pairs([(t, t)]),
                                        fingerprint_pairs([(t, changed)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("other", [1e30, 6e4, 0.0])
def test_a_move_next_to_a_huge_element_or_a_sign_flip_changes_the_fingerprint(dtype, other):
    """A huge element elsewhere in the row (1e30; float16: 6e4) would absorb the change of a
    floating-point weighted sum of the values; the weighted sum of bit-pattern words is exact.
    Swapping ``x`` and ``-x`` changes one bit per word pair, the sign (a word change of
    ``2^31``): seen for every dtype, a float64's sign bit included."""
    if other == 1e30 and dtype == torch.float16:
        other = 6e4
    for first, second in ((64.0, 0.0), (3.0, -3.0)):
        t = torch.zeros(4, 3, 8, dtype=dtype)
        t[1, 2, 7] = other
        t[1, 0, 0], t[1, 0, 1] = first, second
        changed = t.clone()
        changed[1, 0, 0], changed[1, 0, 1] = second, first
        before, after = row_fingerprints(t), row_fingerprints(changed)
        assert torch.equal(before[0], after[0])
        assert not torch.equal(before[1][1], after[1][1])
        assert torch.equal(before[1][[0, 2, 3]], after[1][[0, 2, 3]])


def test_same_bits_compares_the_bytes_of_whole_lists():
    """Equal bytes: True. One byte changed anywhere, ``-0.0`` for ``0.0``, a NaN of another
    payload, another dtype or shape: False (the caller then compares value by value)."""
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(5, generator=g), torch.randint(-9, 9, (3,), generator=g, dtype=torch.int32),
          torch.randn(2, generator=g, dtype=torch.float64)]
    assert release.same_bits(xs, [x.clone() for x in xs])
    assert release.same_bits([], [])
    for k, i in ((0, 4), (1, 0), (2, 1)):
        ys = [x.clone() for x in xs]
        ys[k].view(torch.uint8)[ys[k].element_size() * i] ^= 1  # one bit of one element
        assert not release.same_bits(xs, ys) and not release.same_tensors(xs, ys)
    zero, nan = torch.zeros(2), torch.full((2,), math.nan)
    assert not release.same_bits([zero], [-zero]) and release.same_tensors([zero], [-zero])
    other_nan = nan.view(torch.int32).add(1).view(torch.float32)
    assert not release.same_bits([nan], [other_nan]) and release.same_tensors([nan], [other_nan])
    assert not release.same_bits([zero], [zero.double()])
    assert not release.same_bits([zero], [torch.zeros(3)])
    assert not release.same_bits(xs, xs[:2])


def _normed_layers():
    """Book-keeping's record of two Linear layers normed during the backward."""
    from torch import nn

    from private_engine.layers.linear import LinearRule

    torch.manual_seed(5)
    layers = []
    for d_in, d_out in ((6, 4), (5, 7)):
        pairs = [(torch.randn(3, 4, d_in), torch.randn(3, 4, d_out))]
        layers.append((nn.Linear(d_in, d_out), LinearRule(), pairs, True,
                       fingerprint_pairs(pairs)))
    return layers


def test_unchanged_operands_take_one_comparison_for_all_layers():
    """At the end of a book-keeping norm pass the fingerprints of every normed layer are
    compared by one comparison (one host synchronisation), not one per fingerprint."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    strategy = release.BookKeeping("bk_mixed")
    strategy._normed = _normed_layers()
    with Count():
        assert strategy.changed_terms() == []
    assert ops.count("equal") == 1 and "allclose" not in ops, ops


@pytest.mark.parametrize("which", ["a", "g"])
def test_an_operand_changed_after_its_layer_was_normed_gets_its_term_again(which):
    """One element of the second layer's activation or output gradient changed after its norm:
    that layer's certified norm is formed again from the operands as they are now (the one the
    release is formed from), and only that layer's."""
    strategy = release.BookKeeping("bk_mixed")
    layers = _normed_layers()
    strategy._normed = list(layers)
    module, rule, pairs, _, _ = layers[1]
    a, g = pairs[0]
    (a if which == "a" else g)[1, 2, 3] *= 1e6
    terms = strategy.changed_terms()
    assert len(terms) == 1
    assert torch.equal(terms[0], rule.certified_norm_sq(module, pairs, True))
    a64, g64 = a.double(), g.double()
    exact = (torch.einsum("ntp,ntd->npd", g64, a64).pow(2).sum((1, 2))
             + g64.sum(1).pow(2).sum(1))
    assert bool((terms[0] >= exact).all())
