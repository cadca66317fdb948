"""Red team of the float32 arithmetic of the certified ghost bounds
(:func:`private_engine.layers.gram.ghost_terms`): ``ν̃`` from float32 row dot products summed in
float64, the slack's bilinear forms from float32 matrix–vector products of the Grams' absolute
values with the weights rounded to float32, in the per-layer path and stacked.

1. A fast bound that is not finite is never kept, even with a finite slack; row dot products
   that overflow with opposite signs (``ν̃ = −∞``) are not clamped to 0.
2. Crafted operands — Grams within float32's range whose products overflow it (cancelling or
   not), Gram entries below the normal range, one huge position among tiny ones — and weights
   above float32's range (row-norm bounds of 10⁴⁵): every bound at least the exact rational
   norm², the certified one finite, by the matmul and the element-wise branches.
3. A float32 matmul precision switch (implicit bfloat16 operands on the CPU) takes the fast
   path away, or, once the Grams are formed, the element-wise branch of the row sums.
4. End to end, ``B·‖Δ(released)‖/R ≤ 1 + 10⁻⁶`` (tests/privacy/test_privacy_under_attack.py)
   for a Linear whose crafted sample's Gram products overflow float32, in every mode and door.
"""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from test_red_team_bound_movement import exact_sq
from torch import nn

from private_engine.layers import gram
from private_engine.layers.ghost_stack import GhostBoundStack
from private_engine.layers.gram import certified_ghost_sq, fast_ghost_bound, fast_gram_model
from private_engine.layers.rounding import pair_norms, row_norms64
from test_privacy_under_attack import DOORS, B, Case, assert_bounded, assert_large, run_pair

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]


@pytest.fixture(params=["matmul", "elementwise"])
def branch(request, monkeypatch):
    """The row sums by float32 matmuls (IEEE float32 matmuls) or by element-wise products and
    sums (where a matmul may round its operands), whatever the precision switches say."""
    if request.param == "elementwise":
        monkeypatch.setattr(gram, "ieee_matmul", lambda device: False)
    return request.param


def craft(kind: str, N: int = 3, T: int = 4, D: int = 6, P: int = 5, seed: int = 0):
    """``(a, g)`` float32: honest samples, the last one crafted."""
    gen = torch.Generator().manual_seed(seed)
    a, g = torch.randn(N, T, D, generator=gen), torch.randn(N, T, P, generator=gen)
    x, u = torch.randn(D, generator=gen), torch.randn(P, generator=gen)
    x, u = x / x.norm(), u / u.norm()
    sign = torch.tensor([(-1.0) ** j for j in range(T)]).unsqueeze(1)
    if kind == "dot-overflow-cancel":  # Ã ~ 1e36, G̃ ~ ±1e6: products ±1e42, ν cancels
        a[-1] = torch.stack([(x.double() * 1e18 * (1 + 1e-6 * j)).float() for j in range(T)])
        g[-1] = u * 1e3 * sign
    elif kind == "dot-overflow":  # the same products, all positive: ν itself ~ 1e43
        a[-1] = x * 1e18
        g[-1] = u * 1e3
    elif kind == "dot-overflow-one-row":  # one position's products overflow, the others tiny
        a[-1, 1:] *= 1e-10
        a[-1, 0] = x * 1e18
        g[-1] = u * 1e3 * sign
    elif kind == "subnormal-gram":  # every Gram entry below float32's normal range
        a[-1] *= 1e-21
        g[-1] *= 1e-21
    elif kind == "huge-among-tiny":  # one position 1e15, the others 1e-15, gradients opposite
        a[-1, 0] *= 1e15
        a[-1, 1:] *= 1e-15
        g[-1, 0] *= 1e-15
        g[-1, 1:] *= 1e15
    return a, g


KINDS = ["dot-overflow-cancel", "dot-overflow", "dot-overflow-one-row", "subnormal-gram",
         "huge-among-tiny"]


def assert_at_least(bound: torch.Tensor, exact: list, what) -> None:
    for i, e in enumerate(exact):
        v = bound[i].item()
        assert math.isnan(v) or math.isinf(v) or Fraction(v) >= e, (what, i, v, float(e))


# -- 1. a bound that is not finite is never kept ---------------------------------------------------
def test_a_non_finite_bound_with_a_finite_slack_gets_the_second_try():
    """``refine`` replaces a bound that is infinite or NaN even when its slack is finite (a
    ``ν̃`` that overflowed while the slack did not)."""
    bound = torch.tensor([1.0, math.inf, math.nan, 2.0], dtype=torch.float64)
    slack = torch.tensor([1e-9, 1e-9, 1e-9, 1e-9], dtype=torch.float64)
    nu = torch.tensor([1.0, math.inf, 1.0, 2.0], dtype=torch.float64)
    asked = []

    def exact(idx):
        asked.append(idx.tolist())
        return torch.full((len(idx),), 7.0, dtype=torch.float64)

    out = gram.refine(bound, slack, nu, exact)
    assert asked == [[1, 2]] and out.tolist() == [1.0, 7.0, 7.0, 2.0]


@pytest.mark.parametrize("T", [2, 3])
def test_row_dots_overflowing_with_opposite_signs_are_not_clamped(T, branch):
    """Gram-like float32 matrices whose diagonal products stay below float32's largest value and
    whose off-diagonal ones overflow negative (computed Grams need not meet Cauchy–Schwarz
    exactly): the row dot products are ``−∞``; ``ν̃`` comes out NaN, never ``max(−∞, 0) = 0``, and
    the bound is not kept."""
    A = torch.full((1, T, T), 1.7e19)
    G = torch.full((1, T, T), -2.5e19)
    G[0].diagonal().fill_(1.0e19)
    n2 = torch.ones(1, T, dtype=torch.float64)
    c = gram.form_constants(T)
    assert gram.row_dots(A, G).item() == -math.inf
    nu, slack = gram.ghost_terms(A.clone(), G.clone(), n2, n2, c)
    assert math.isnan(nu.item())
    bound = (nu + slack) * (1 + 2.0 ** -50)
    assert not bool(gram.tight(bound, slack, nu).any())


# -- 2. crafted operands and weights ---------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_crafted_operands_are_covered(kind, bias, branch):
    """Fast, certified and stacked bounds of crafted samples at least the exact norm²; the
    certified and stacked ones finite (a fast bound that overflowed got the second try)."""
    a, g = craft(kind)
    exact = exact_sq(a, g, bias)
    na, ng = pair_norms(a, g, bias)
    fast = fast_ghost_bound(a, g, bias, na, ng, *fast_gram_model(a))[0]
    cert = certified_ghost_sq(a, g, bias, na, ng)
    assert_at_least(fast, exact, "fast")
    assert_at_least(cert, exact, "certified")
    assert bool(torch.isfinite(cert).all()), cert
    stack = GhostBoundStack()
    assert stack.add(a, g, bias, 0.0)
    stack.take()
    assert_at_least(stack.rows[0], exact, "stacked")
    assert bool(torch.isfinite(stack.rows[0]).all()), stack.rows[0]
    if kind.startswith("dot-overflow"):  # the float32 products overflowed: the second try
        assert not math.isfinite(fast[-1].item()), fast


def test_weights_above_float32_range_give_a_second_try(branch):
    """Row-norm bounds of 10⁴⁵ (valid, loose upper bounds whose scaled weights exceed float32's
    range): the fast bound of that sample is not finite and the certified one, from the second
    try, is finite and at least the exact norm²."""
    a, g = craft("honest")
    na, ng = pair_norms(a, g, True)
    na[-1] = 1e45
    exact = exact_sq(a, g, True)
    fast = fast_ghost_bound(a, g, True, na, ng, *fast_gram_model(a))[0]
    assert not math.isfinite(fast[-1].item()) and bool(torch.isfinite(fast[:-1]).all())
    cert = certified_ghost_sq(a, g, True, na, ng)
    assert bool(torch.isfinite(cert).all())
    assert_at_least(cert, exact, "certified")


@pytest.mark.parametrize("kind", ["honest"] + KINDS)
def test_both_branches_bound_alike(kind):
    """The matmul and element-wise branches of the row sums give bounds within ``ρ_T²`` of each
    other (both within their float32 rounding of one formula)."""
    a, g = craft(kind)
    na, ng = pair_norms(a, g, True)
    model = fast_gram_model(a)
    by_matmul = fast_ghost_bound(a, g, True, na, ng, *model)[1]
    own = gram.ieee_matmul
    try:
        gram.ieee_matmul = lambda device: False
        by_elements = fast_ghost_bound(a, g, True, na, ng, *model)[1]
    finally:
        gram.ieee_matmul = own
    rho = gram.form_constants(a.shape[1]).rho
    finite = torch.isfinite(by_matmul)
    assert torch.equal(finite, torch.isfinite(by_elements))
    assert bool((by_matmul[finite] <= by_elements[finite] * rho * rho).all())
    assert bool((by_elements[finite] <= by_matmul[finite] * rho * rho).all())


def test_token_row_sums_that_overflow_get_the_second_try(branch):
    """An embedding's token ghost norm whose float32 row sums overflow (Gram entries of 2·10³⁸
    between equal tokens): the bound is finite (the float64 Gram's) and at least the exact
    norm², the honest samples' untouched."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([[1, 2, 1, 3], [4, 4, 4, 4], [5, 6, 7, 5]])
    g = torch.randn(3, 4, 5, generator=gen)
    g[1] = torch.ones(5) / math.sqrt(5) * 1.5e19
    ng = row_norms64(g)
    bound = gram.certified_token_ghost_sq(ids, g, ng)
    assert bool(torch.isfinite(bound).all()), bound
    for i in range(3):
        rows = {}
        for t, tok in enumerate(ids[i].tolist()):
            rows.setdefault(tok, [Fraction(0)] * 5)
            rows[tok] = [r + Fraction(v) for r, v in zip(rows[tok], g[i, t].double().tolist())]
        exact = sum(v * v for r in rows.values() for v in r)
        assert Fraction(bound[i].item()) >= exact, (i, bound[i].item(), float(exact))


# -- 3. matmul precision switches ------------------------------------------------------------------
@pytest.fixture
def bf16_matmuls():
    """oneDNN's float32 matmuls allowed bfloat16 operands (restored after)."""
    switch = torch.backends.mkldnn.matmul
    before = switch.fp32_precision
    try:
        switch.fp32_precision = "bf16"
    except (RuntimeError, AttributeError, ValueError):
        pytest.skip("this torch has no oneDNN float32 precision switch")
    yield
    switch.fp32_precision = before


def test_bfloat16_matmuls_take_the_float32_arithmetic_away(bf16_matmuls):
    """Under implicit bfloat16 matmuls there is no fast Gram path (the caller's float64 Grams)
    and the row sums of Grams formed before the switch use element-wise products: no matmul."""
    from torch.utils._python_dispatch import TorchDispatchMode

    a, g = craft("honest")
    na, ng = pair_norms(a, g, True)
    assert fast_gram_model(a) is None
    assert certified_ghost_sq(a, g, True, na, ng) is None
    assert not GhostBoundStack().add(a, g, True, 0.0)
    assert not gram.ieee_matmul(a.device)
    A, G = gram._gram32(a), gram._gram32(g)

    class Matmuls(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("bmm", "mm", "matmul", "mv", "baddbmm"):
                self.seen.append(func)
            return func(*args, **(kwargs or {}))

    with Matmuls() as rec:
        gram.ghost_terms(A, G, na, ng, gram.form_constants(a.shape[1]))
    assert rec.seen == []


# -- 4. end to end ---------------------------------------------------------------------------------
def overflow_case() -> Case:
    """Two Linears on 4 positions; the crafted sample's inputs ~1e18 along one direction (the
    first layer's Grams ~1e36: their float32 products with the output gradients' overflow) with
    targets alternating around the outputs (output gradients of alternating sign)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4, bias=False))
    gen = torch.Generator().manual_seed(3)
    honest = torch.randn(3, 4, 8, generator=gen) * 0.1
    with torch.no_grad():
        y = model(honest)
    honest_t = y + 0.02 * torch.randn(y.shape, generator=gen)
    x = torch.randn(8, generator=gen)
    x = torch.stack([(x.double() / x.norm().double() * 1e18 * (1 + 1e-6 * j)).float()
                     for j in range(4)]).unsqueeze(0)
    with torch.no_grad():
        out = model(x)
    sign = torch.tensor([(-1.0) ** j for j in range(4)]).reshape(1, 4, 1)
    return Case(model, (honest, honest_t), (x, out - sign * 1e3))


@pytest.mark.parametrize("door,how", DOORS, ids=[f"{d}-{h}" for d, h in DOORS])
def test_gram_product_overflow_end_to_end(door, how):
    case = overflow_case()
    assert_large(case)
    assert_bounded(*run_pair(case, door, how), batch=B, what=f"overflow {door}-{how}")
