"""The row fingerprints two-pass and book-keeping releases compare their operands by: what they
are, which changes they see, and that they copy no operand."""
import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from private_engine.clipping import release
from private_engine.clipping.fingerprints import fingerprint_pairs, row_fingerprints


def _bit_sums(t: torch.Tensor, k: int) -> list:
    """Σ_j bits(t_rj) mod 2^k per row, in Python integers (as signed k-bit values)."""
    ints = t.reshape(t.shape[0], -1).view({16: torch.int16, 32: torch.int32,
                                           64: torch.int64}[k]).tolist()
    out = []
    for row in ints:
        s = sum(row) % 2 ** k
        out.append(s - 2 ** k if s >= 2 ** (k - 1) else s)
    return out


@pytest.mark.parametrize("dtype,k", [(torch.float32, 32), (torch.bfloat16, 16),
                                     (torch.float64, 64)])
def test_bit_sums_wrap_around_exactly(dtype, k):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(3, 40, 500, generator=g) * 1e6).to(dtype)  # sums far beyond 2^k
    bits, values, _ = row_fingerprints(t)
    assert bits.tolist() == _bit_sums(t, k)
    assert torch.equal(values, t.reshape(3, -1).sum(1))


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
    """The fingerprints of a 9.7 MB float32 output gradient allocate their ``(B,)`` results only:
    no cast of the operand (a float64 sum's 19 MB copy), no copy of it."""
    a = torch.randn(16, 197, 192)
    g = torch.randn(16, 197, 768)
    fingerprint_pairs([(a, g)])  # the position weights of these widths, drawn once
    largest = _largest_allocation(lambda: fingerprint_pairs([(a, g)]))
    assert 0 < largest <= 1024


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
