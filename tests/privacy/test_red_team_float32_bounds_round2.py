"""Red team, second round, of the float32 arithmetic of the certified ghost bounds
(:func:`private_engine.layers.gram.ghost_terms`, :func:`~private_engine.layers.gram.refine`,
:func:`~private_engine.layers.gram.certified_token_ghost_sq`, the stacked
:class:`~private_engine.layers.ghost_stack.GhostBoundStack` and its chunks).

1. Flush-to-zero on the CPU (``torch.set_flush_denormal(True)``): float32 products of *normal*
   operands below ``2⁻¹²⁶`` are flushed, in the Grams and in the row norms. A Linear sample with
   one visible position and three whose activation Gram entries (``~10⁻³⁸``) are flushed,
   against output-gradient Grams of ``~10³⁸``: with the Grams' error model counting ``2⁻¹⁴⁹``
   per product (gradual underflow only) its certified bound was 0.12 times its exact norm², and
   end to end ``B·‖Δ‖/R = 8.77`` in every ghost mode and both doors; an embedding's token ghost
   bound fell to 0.03 of its (tiny) exact norm². Counting ``2⁻¹²⁶`` (:data:`private_engine.
   layers.rounding.ETA32`) covers them; these tests fail with ``2⁻¹⁴⁹``.
2. Attacks that hold: weights above float32's range with all-zero Grams (``inf·0``), a NaN Gram
   entry, ``torch.set_float32_matmul_precision("medium")`` (no fast path), layers split across
   ``BOUND_ELEMENTS`` chunks with and without a bias and a sample loose in one layer and not
   finite in another (``T = 2`` and a batch of 1 too), the floored weights far above float32's
   subnormal range, token ghost norms with repeated ids whose row sums overflow.
3. Honest samples: a timm ViT-Tiny block's Linear layers (random init, images at ImageNet's
   normalised scale) keep fast bounds within 10⁻³ of their float64 norm.
"""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from test_red_team_float32_bounds import craft, exact_sq
from torch import nn

from private_engine.layers import ghost_stack, gram
from private_engine.layers.ghost_stack import GhostBoundStack
from private_engine.layers.gram import (
    certified_ghost_sq,
    certified_token_ghost_sq,
    fast_ghost_bound,
    fast_gram_model,
)
from private_engine.layers.rounding import pair_norms
from test_privacy_under_attack import DOORS, B, Case, assert_bounded, assert_large, run_pair

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]


@pytest.fixture(params=["matmul", "elementwise"])
def branch(request, monkeypatch):
    """The row sums by float32 matmuls or by element-wise products and sums."""
    if request.param == "elementwise":
        monkeypatch.setattr(gram, "ieee_matmul", lambda device: False)
    return request.param


@pytest.fixture
def flush_to_zero():
    """Float32 results below the normal range flushed to zero (and subnormal inputs read as zero)
    on this thread, as ``torch.set_flush_denormal(True)`` sets it; restored after."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    yield
    torch.set_flush_denormal(False)


def assert_at_least(bound: torch.Tensor, exact: list, what) -> None:
    for i, e in enumerate(exact):
        v = bound[i].item()
        assert math.isnan(v) or math.isinf(v) or Fraction(v) >= e, (what, i, v, float(e))


def hidden(N: int = 3, T: int = 4, D: int = 6, P: int = 5, visible: float = 0.1):
    """``(a, g)``: honest samples, the last one with one visible position (``a = e₀``,
    ``g = visible·e₀``) and ``T − 1`` positions ``a = 3·10⁻²⁰·e₁``, ``g = 3·10¹⁸·e₁``: normal
    values whose activation Gram products (``9·10⁻⁴⁰``) are subnormal, against gradient Gram
    entries of ``9·10³⁶``. The visible part keeps the fast bound tight (no second try)."""
    gen = torch.Generator().manual_seed(0)
    a, g = torch.randn(N, T, D, generator=gen), torch.randn(N, T, P, generator=gen)
    a[-1], g[-1] = 0, 0
    a[-1, 0, 0], g[-1, 0, 0] = 1.0, visible
    a[-1, 1:, 1], g[-1, 1:, 1] = 3e-20, 3e18
    return a, g


# -- 1. flush-to-zero ------------------------------------------------------------------------------
def test_hidden_products_are_covered_with_gradual_underflow(branch):
    """Without flush-to-zero the subnormal Gram products lose at most ``2⁻¹⁴⁹`` each: every bound
    of the hidden-position sample is at least its exact norm²."""
    a, g = hidden()
    exact = exact_sq(a, g, False)
    na, ng = pair_norms(a, g, False)
    assert_at_least(fast_ghost_bound(a, g, False, na, ng, *fast_gram_model(a))[0], exact, "fast")
    assert_at_least(certified_ghost_sq(a, g, False, na, ng), exact, "certified")


def test_flushed_gram_products_are_covered(flush_to_zero, branch):
    """Under flush-to-zero the hidden positions' activation Gram entries are 0 and their row norms
    0: the certified and stacked bounds must still be at least the exact norm² (0.12 of it)."""
    a, g = hidden()
    exact = exact_sq(a, g, False)
    na, ng = pair_norms(a, g, False)
    assert_at_least(certified_ghost_sq(a, g, False, na, ng), exact, "certified")
    stack = GhostBoundStack()
    assert stack.add(a, g, False, 0.0)
    stack.take()
    assert_at_least(stack.rows[0], exact, "stacked")


def token_exact(ids: torch.Tensor, g: torch.Tensor) -> list:
    """``Σ_v ‖Σ_{t: x_t = v} g_t‖²`` per sample as exact rationals."""
    out = []
    for row, gi in zip(ids.tolist(), g.double().tolist()):
        sums: dict = {}
        for k, gt in zip(row, gi):
            acc = sums.setdefault(k, [Fraction(0)] * len(gt))
            sums[k] = [s + Fraction(v) for s, v in zip(acc, gt)]
        out.append(sum(v * v for s in sums.values() for v in s))
    return out


def test_flushed_token_gram_products_are_covered(flush_to_zero):
    """An embedding sample of four equal ids, every gradient entry ``1.05·10⁻¹⁹`` (products just
    below ``2⁻¹²⁶``) over 512 features: under flush-to-zero its token ghost bound must still be at
    least the exact norm² (0.03 of it)."""
    ids = torch.tensor([[1, 1, 1, 1], [1, 2, 1, 2]])
    g = torch.randn(2, 4, 512, generator=torch.Generator().manual_seed(0))
    g[-1] = 1.05e-19
    ng = pair_norms(torch.ones(2, 4, 1), g, False)[1]
    assert_at_least(certified_token_ghost_sq(ids, g, ng), token_exact(ids, g), "token")


def ftz_case(T: int = 4, D: int = 16, P: int = 16) -> Case:
    """A Linear without bias (ghost norms in every mixed mode: ``D·P > 2T²``) on 4 positions; the
    crafted sample's first position ``e₀`` with an output gradient of norm 2, the others
    ``10⁻¹⁹`` in 15 features (activation Gram products ``10⁻³⁸ < 2⁻¹²⁶``) with output gradients
    of norm ``1.5·10¹⁹``: true norm 17.5."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, P, bias=False))
    gen = torch.Generator().manual_seed(3)
    honest = torch.randn(3, T, D, generator=gen) * 0.1
    with torch.no_grad():
        y = model(honest)
    honest_t = y + 0.02 * torch.randn(y.shape, generator=gen)
    x = torch.zeros(1, T, D)
    x[0, 0, 0] = 1.0
    x[0, 1:, 1:] = 1e-19
    with torch.no_grad():
        t = model(x)
    t[0, 0, 0] -= 1.0
    t[0, 1:, :] -= 7.5e18 / P ** 0.5
    return Case(model, (honest, honest_t), (x, t))


GHOST_DOORS = [d for d in DOORS if d != ("native", "per_sample")]


@pytest.mark.parametrize("door,how", GHOST_DOORS, ids=[f"{d}-{h}" for d, h in GHOST_DOORS])
def test_flushed_gram_products_end_to_end(door, how):
    """``B·‖Δ‖/R ≤ 1`` under flush-to-zero (8.77 in every ghost mode and both doors)."""
    case = ftz_case()
    assert_large(case)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        runs = run_pair(case, door, how)
    finally:
        torch.set_flush_denormal(False)
    assert_bounded(*runs, batch=B, what=f"flush-to-zero {door}-{how}")


def test_flushed_gram_products_end_to_end_instantiated_and_without_ftz():
    """The same sample holds where the per-sample gradient is instantiated (under flush-to-zero)
    and in a ghost mode with gradual underflow."""
    case = ftz_case()
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        runs = run_pair(case, "native", "per_sample")
    finally:
        torch.set_flush_denormal(False)
    assert_bounded(*runs, batch=B, what="flush-to-zero per_sample")
    assert_bounded(*run_pair(case, "native", "bk"), batch=B, what="gradual underflow bk")


# -- 2. attacks that hold --------------------------------------------------------------------------
def test_zero_grams_with_weights_beyond_float32(branch):
    """A sample whose activations are all zero (Grams of exact zeros) with a row-norm bound of
    10⁴⁵ (weights that round to ``inf`` in float32: ``inf·0`` in the matrix–vector products):
    its fast bound is not finite, never a finite value below the norm; the certified one is
    finite and at least the exact norm² (0)."""
    a = torch.zeros(2, 3, 4)
    a[0] = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    g = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(2))
    na, ng = pair_norms(a, g, False)
    na[1] = 1e45
    fast = fast_ghost_bound(a, g, False, na, ng, *fast_gram_model(a))[0]
    assert not math.isfinite(fast[1].item()) and math.isfinite(fast[0].item())
    cert = certified_ghost_sq(a, g, False, na, ng)
    assert bool(torch.isfinite(cert).all())
    assert_at_least(cert, exact_sq(a, g, False), "certified")


@pytest.mark.parametrize("where", ["A", "G"])
def test_a_nan_gram_entry_is_never_kept(where, branch):
    """A NaN in one sample's Gram (off the diagonal): that sample's ν̃ and slack are NaN and its
    bound is not kept; the other samples' bounds are finite and kept."""
    a, g = craft("honest")
    A, G = gram._gram32(a), gram._gram32(g)
    (A if where == "A" else G)[1, 0, 2] = math.nan
    na, ng = pair_norms(a, g, False)
    T, (tc, eta) = a.shape[1], fast_gram_model(a)
    ga, gg = gram.gram_gamma(a.shape[2], tc), gram.gram_gamma(g.shape[2], tc)
    c = gram.form_constants(T)
    n2, m2 = gram._floored(na, a.shape[2], eta, ga), gram._floored(ng, g.shape[2], eta, gg)
    nu, slack = gram.ghost_terms(A, G, n2, m2, c)
    bound = (nu + slack) * (1 + 2.0 ** -50)
    assert math.isnan(bound[1].item()) and math.isnan(slack[1].item())
    assert bool(torch.isfinite(bound[[0, 2]]).all())
    kept = gram.tight(bound, slack, nu, gram.loose_floor(T))
    assert kept.tolist() == [True, False, True]


@pytest.fixture
def medium_matmuls():
    """``torch.set_float32_matmul_precision("medium")`` (restored after)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    yield
    torch.set_float32_matmul_precision(before)


def test_medium_matmul_precision_takes_the_fast_path_away(medium_matmuls):
    """Under ``set_float32_matmul_precision("medium")`` (bfloat16 operands allowed) no fast Gram
    path is offered, per layer, stacked or for token ghost norms, and the row sums are
    element-wise."""
    a, g = craft("honest")
    na, ng = pair_norms(a, g, True)
    assert fast_gram_model(a) is None and not gram.ieee_matmul(a.device)
    assert certified_ghost_sq(a, g, True, na, ng) is None
    assert not GhostBoundStack().add(a, g, True, 0.0)
    ids = torch.zeros(a.shape[:2], dtype=torch.long)
    assert certified_token_ghost_sq(ids, g, ng) is None


def stacked_rows(ops) -> list:
    stack = GhostBoundStack()
    for a, g, bias in ops:
        assert stack.add(a, g, bias, 1e-7)
    stack.take()
    return stack.rows


@pytest.mark.parametrize("N,T", [(3, 4), (1, 2)])
def test_layers_split_across_chunks(N, T, monkeypatch):
    """Five layers (bias or not, two widths) of one ``(N, T)`` whose last sample is crafted
    differently in each — cancelling with overflowing products (not finite), one huge position
    among tiny ones (loose), subnormal Grams, overflowing products — bounded in chunks of two
    layers: every row equals the one-chunk stack's bit for bit, is finite and is at least the
    exact norm² of its layer."""
    kinds = ["dot-overflow-cancel", "huge-among-tiny", "subnormal-gram", "dot-overflow",
             "honest"]
    ops = []
    for n, kind in enumerate(kinds):
        D = 6 if n % 2 else 9
        a, g = craft(kind, N=max(N, 2), T=T, D=D, seed=n)
        ops.append((a[-N:], g[-N:], n % 2 == 0))
    whole = stacked_rows(ops)
    monkeypatch.setattr(ghost_stack, "BOUND_ELEMENTS", 2 * N * T * T)  # 2 layers per chunk
    split = stacked_rows(ops)
    for (a, g, bias), r1, r2 in zip(ops, whole, split):
        assert torch.equal(r1, r2)
        assert bool(torch.isfinite(r2).all()), r2
        assert_at_least(r2, exact_sq(a, g, bias), "split")


def test_floored_weights_are_normal_float32():
    """The scaled, floored weights of a zero row norm stay far above float32's subnormal range
    for every width and both Gram models: their float32 rounding is relative (``fl32(w)·(1 +
    2⁻²³) ≥ w``), never an absolute loss of a subnormal."""
    zero = torch.zeros(1, 3, dtype=torch.float64)
    for width in (1, 64, 1 << 20):
        for tc, eta in ((False, 2.0 ** -149), (True, 2.0 ** -126)):
            g = gram.gram_gamma(width, tc)
            w = gram._floored(zero, width, eta, g)
            assert bool((w >= 2.0 ** -100).all()), (width, w)
            assert bool((w.float().double() * gram.WEIGHT_RAISE >= w).all()), (width, w)


def test_token_row_sums_overflowing_get_the_second_try(branch):
    """Repeated ids with gradients of ``10¹⁸`` over 64 features: Gram entries of ``6.4·10³⁷``
    whose masked row sums overflow float32; the bound is finite (the float64 Gram) and at least
    the exact norm², the honest sample's too."""
    ids = torch.tensor([[1, 1, 1, 1, 1, 1], [3, 4, 3, 4, 5, 5]])
    g = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(0))
    g[0] = 1e18
    ng = pair_norms(torch.ones(2, 6, 1), g, False)[1]
    bound = certified_token_ghost_sq(ids, g, ng)
    assert bool(torch.isfinite(bound).all()), bound
    assert_at_least(bound, token_exact(ids, g), "token")


# -- 3. honest samples -----------------------------------------------------------------------------
def test_vit_tiny_block_bounds_are_within_a_thousandth():
    """The Linear layers of a timm ViT-Tiny's first block (random init, 197 positions, a batch of
    two images smooth at ImageNet's normalised scale, a summed cross-entropy): every fast bound is
    kept (no second try), at least the float64 norm² and within 10⁻³ of it."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, depth=1)
    x = nn.functional.interpolate(torch.rand(2, 3, 28, 28), size=224, mode="bilinear")
    x = (x - 0.45) / 0.225
    ops: dict = {}

    def keep(name):
        def hook(mod, inp, out):
            ops[name] = [inp[0].detach()]
            out.register_hook(lambda grad: ops[name].append(grad.detach()))
        return hook

    for name, mod in model.blocks.named_modules():
        if isinstance(mod, nn.Linear):
            mod.register_forward_hook(keep(name))
    nn.functional.cross_entropy(model(x), torch.tensor([1, 7]), reduction="sum").backward()
    assert len(ops) == 4
    for name, (a, g) in ops.items():
        ones = torch.ones_like(a[..., :1])
        exact = torch.einsum("ntp,ntd->npd", g.double(),
                             torch.cat([a, ones], -1).double()).square().sum((1, 2))
        na, ng = pair_norms(a, g, True)
        bound, slack, nu = fast_ghost_bound(a, g, True, na, ng, *fast_gram_model(a))
        assert bool(gram.tight(bound, slack, nu, gram.loose_floor(a.shape[1])).all()), name
        ratio = bound / exact
        assert bool((ratio >= 1).all()) and bool((ratio <= 1 + 1e-3).all()), (name, ratio)
