"""The certified ghost bounds move no more data than they need: no float64 copy or product of a
float32 Gram (its row dot products and the slack's bilinear forms are float32 matmuls, the
float64 work is on rows), no outer products of the weights, one stack of operands of one shape
is not stacked a second time, and the operands padded for CUDA's 16-bit Gram kernels are copied
once, with only the appended rows zeroed."""
import math
from fractions import Fraction

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from private_engine.layers.base import pad_positions
from private_engine.layers.ghost_stack import GhostBoundStack, _grams_and_norms, _stack_positions
from private_engine.layers.gram import _gram32, weighted_abs_sum
from private_engine.layers.rounding import gamma, unit_roundoff


class _Ops(TorchDispatchMode):
    """Records ``(op name, output dtype, output shape)`` of every operator."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.ops.append((func.overloadpacket.__name__, out.dtype, tuple(out.shape)))
        return out


def _operands(L, N=3, T=9, D=16, P=24, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return [(torch.randn(N, T, D).to(dtype), torch.randn(N, T, P).to(dtype)) for _ in range(L)]


def test_stacked_bounds_write_no_float64_gram_and_copy_operands_once():
    L, N, T = 4, 3, 9
    stack = GhostBoundStack()
    for a, g in _operands(L, N, T):
        assert stack.add(a, g, True, 1e-6)
    with _Ops() as rec:
        stack.take()
    # no float64 tensor of (…, T, T) elements: ν̃ by float32 row dot products, the weighted forms
    # by float32 matrix–vector products, float64 work on (L, N, T) rows only
    wide64 = [op for op in rec.ops if op[1] == torch.float64 and len(op[2]) >= 2
              and math.prod(op[2]) >= L * N * T * T]
    assert wide64 == [], wide64
    # float32 (L, N, T, T) tensors written besides the Grams' views: the bias column added and
    # the two absolute values, in place (no element-wise product temporaries)
    gram = (L, N, T, T)
    written32 = [op[0] for op in rec.ops if op[1] == torch.float32 and op[2] == gram
                 and op[0] not in ("view", "expand", "_unsafe_view", "alias")]
    assert sorted(written32) == ["abs_", "abs_", "add_"], written32
    stacked = [op for op in rec.ops if op[0] == "stack"]
    # the a's and the g's stacked once each for their Grams; the Grams themselves not again
    assert [op[2] for op in stacked] == [(L, N, T, 16), (L, N, T, 24)], stacked
    # on the CPU, each stack of 16-bit operands widened to float32 once for its Gram
    to32 = [op for op in rec.ops if op[0] == "_to_copy" and op[1] == torch.float32
            and len(op[2]) == 3 and op[2][2] in (16, 24)]
    assert len(to32) == 2, to32


def test_pad_positions_is_the_zero_padded_operand():
    t = torch.randn(2, 3, 5, 7).bfloat16()
    expected = torch.nn.functional.pad(t, (0, 0, 0, 3))
    with _Ops() as rec:
        out = pad_positions(t, 8)
    assert torch.equal(out, expected) and out.is_contiguous()
    assert "fill_" not in [op[0] for op in rec.ops]  # only the appended rows are zeroed
    assert pad_positions(t, 5) is t


def test_padded_stack_is_the_padded_operand_of_the_gram_kernels():
    """The padded stack is, bit for bit, the tensor the Gram kernels were given before (a stack,
    then a padded copy of it); its Grams' first T rows and columns are the operand's Grams."""
    for L in (2, 5):  # copied one by one into the padded stack; stacked, then padded
        ts = [a for a, _ in _operands(L, T=9)]
        x = _stack_positions(ts, 16)
        assert x.shape == (L, 3, 16, 16) and x.is_contiguous()
        assert torch.equal(x, pad_positions(torch.stack(ts), 16))
    ts = [a for a, _ in _operands(3, T=9)]
    x = _stack_positions(ts, 16)
    padded = _gram32(x.reshape(-1, 16, 16), 9).reshape(3, 3, 9, 9)
    grams, norms = _grams_and_norms(ts)
    assert torch.equal(grams, torch.stack([_gram32(t) for t in ts]))
    torch.testing.assert_close(padded, grams, rtol=1e-6, atol=1e-5)
    assert torch.equal(norms, torch.linalg.vector_norm(torch.stack(ts), dim=-1,
                                                       dtype=torch.float32))
    f32 = [t.float() for t in ts]
    x32 = _stack_positions(f32, 12)
    assert torch.equal(x32, pad_positions(torch.stack(f32), 12))
    torch.testing.assert_close(_gram32(x32.reshape(-1, 12, 16), 9),
                               _gram32(torch.stack(f32).reshape(-1, 9, 16)))


@pytest.mark.parametrize("one_pass", [False, True])
def test_weighted_abs_sum_is_the_bilinear_forms_within_their_rounding(one_pass):
    """``Σ_{t,s} (n_t n_s |G_ts| + m_t m_s |A_ts|)`` against the exact rational sum of the same
    float values: within ``γ^{(64)}_{2T+1}`` (its rounding, :func:`weighted_abs_sum`), for values
    spread over 60 orders of magnitude and of both signs (both reductions, the CPU's and
    CUDA's)."""
    torch.manual_seed(1)
    N, T = 3, 7
    G = (torch.randn(N, T, T) * torch.logspace(-30, 30, T)).float()
    A = (torch.randn(N, T, T) * torch.logspace(30, -30, T)).float()
    n = torch.rand(N, T, dtype=torch.float64) * torch.logspace(-20, 20, T, dtype=torch.float64)
    m = torch.rand(N, T, dtype=torch.float64) * torch.logspace(9, -9, T, dtype=torch.float64)
    got = weighted_abs_sum(n, G, m, A, one_pass)
    g = gamma(2 * T + 1, unit_roundoff(torch.float64))

    def fr(x):
        return Fraction(x.item())

    for i in range(N):
        exact = sum(fr(n[i, t]) * abs(fr(G[i, t, s])) * fr(n[i, s])
                    + fr(m[i, t]) * abs(fr(A[i, t, s])) * fr(m[i, s])
                    for t in range(T) for s in range(T))
        assert abs(fr(got[i]) - exact) <= Fraction(g) * exact
