"""Red team of the second tries of the certified ghost bounds: the per-sample gradients formed by
a float32 matmul (:func:`private_engine.layers.gram.instantiated_ghost_bound`, where
:func:`~private_engine.layers.gram.instantiation_pays`), fast bounds kept within the release's own
rounding term (:func:`~private_engine.layers.gram.tight` with
:func:`~private_engine.layers.gram.release_term`), and blocked Grams added block by block into
their float64 total (:func:`~private_engine.layers.gram._gram_chunked`).

1. The instantiated bound, the whole certified bound with the per-sample gradients first or
   second, and :func:`~private_engine.layers.gram.second_try_rows`, against the exact squared norm
   ``‖Σ_t g_t ã_tᵀ‖²`` of the same operands (scaled Python integers: no rounding): positions that
   cancel (equal activations, opposite gradients; up to 1 + 10⁻⁶), subnormal values beside huge
   ones in the same column, per-sample gradients that overflow float32 where the Grams do not,
   with and without a bias, ``T`` = 2 and wide layers (``T = 64``, ``w_a = p = 96``), bfloat16
   operands widened on the CPU, and under flush-to-zero (``torch.set_flush_denormal(True)``).
2. The release term decides looseness only: with a release coefficient so large (or infinite, or
   NaN) that every finite fast bound is kept, every kept bound is still at least the exact norm,
   and no non-finite bound is kept.
3. The blocked Grams of the second try, formed one block group at a time, are within their
   documented rounding of the exact Gram, whatever the number of blocks formed at once.
   Per-sample gradients formed one sample at a time are each sample's own.
4. End to end (noise 0, SGD at lr 1, ``B·‖Δ(released)‖/R ≤ 1 + 10⁻⁶``, every mode and both doors):
   a ViT-like patch embedding (``Conv2d(3, 8, 8, stride 8)`` on 32 × 32 images, 16 positions:
   the per-sample gradients are its first try; float32 and bfloat16 autocast), a depthwise one,
   a conv called twice (overlapping padded windows too), three Linear layers of one shape whose
   loose samples take their second tries (per-sample gradients) layer by layer or together in the
   ghost stack, and no per-sample gradients at all under a float32 matmul precision that rounds
   operands (``torch.set_float32_matmul_precision("medium" | "high")``).

Every attack here held (smallest bound/exact ratio 1, largest end-to-end ratio below 1 + 10⁻⁶);
they are kept as regression tests.
"""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from torch import nn

from private_engine.layers import gram
from private_engine.layers.rounding import pair_norms
from test_privacy_under_attack import (
    DOORS,
    LOWP_TOL,
    B,
    Case,
    assert_bounded,
    assert_large,
    run_pair,
)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

#: float32 and 16-bit values are integer multiples of 2⁻¹⁴⁹
SCALE = 149


def _ints(x: torch.Tensor) -> list:
    """The values of ``x`` (``(T, w)``) times ``2¹⁴⁹``: exact Python integers, row by row."""
    out = []
    for row in x.double().tolist():
        ints = []
        for v in row:
            n, d = v.as_integer_ratio()
            ints.append(n * ((1 << SCALE) // d))
        out.append(ints)
    return out


def exact_sq(a: torch.Tensor, g: torch.Tensor, bias: bool) -> list:
    """``‖Σ_t g_t ã_tᵀ‖²_F`` per sample as exact rationals of the values of ``a``, ``g``."""
    res = []
    for ai, gi in zip(a, g):
        A, G = _ints(ai), _ints(gi)
        if bias:
            A = [row + [1 << SCALE] for row in A]
        total = 0
        for k in range(len(G[0])):
            col = [row[k] for row in G]
            for j in range(len(A[0])):
                s = sum(c * row[j] for c, row in zip(col, A))
                total += s * s
        res.append(Fraction(total, 1 << (4 * SCALE)))
    return res


def assert_covers(bound: torch.Tensor, a: torch.Tensor, g: torch.Tensor, bias: bool,
                  what: str) -> float:
    """Every finite bound is at least the exact norm (NaN never returned); the smallest ratio."""
    worst = math.inf
    for i, (b, e) in enumerate(zip(bound.tolist(), exact_sq(a, g, bias))):
        assert b == b, f"{what}: sample {i}: NaN bound"
        if b == math.inf:
            continue
        assert Fraction(b) >= e, f"{what}: sample {i}: bound {b!r} < exact {float(e)!r}"
        if e:
            worst = min(worst, float(Fraction(b) / e))
    return worst


def crafted(kind: str, T: int, D: int, P: int, seed: int = 0):
    """``(a, g)`` float32 ``(3, T, D)``, ``(3, T, P)``: one honest sample, two crafted ones."""
    gen = torch.Generator().manual_seed(seed)
    a, g = torch.randn(3, T, D, generator=gen), torch.randn(3, T, P, generator=gen)
    x, u = torch.randn(D, generator=gen), torch.randn(P, generator=gen)
    sign = torch.tensor([(-1.0) ** j for j in range(T)]).unsqueeze(1)
    if kind == "cancel":  # x·1e4·(1 + jε), gradients ±u·1e3; then exactly equal, exactly opposite
        a[1] = torch.stack([(x.double() * 1e4 * (1 + 1e-6 * j)).float() for j in range(T)])
        g[1] = sign * u * 1e3
        a[2], g[2] = x.expand(T, D), sign * u
        if T % 2:
            g[1:, -1] = 0
    elif kind == "subnormal-beside-huge":  # subnormal factors of huge ones, in the same column
        a[1], g[1] = 1e10, 1e-39 * torch.sign(g[1])
        a[2], g[2] = 1e-39 * torch.sign(a[2]), 1e10
        a[2, 0], g[1, 0] = 1e30, 1e-20
    elif kind == "gradient-overflow":  # |g_t|·|a_t|·T above float32's range, |a|², |g|² below
        a[1], g[1] = 1e19 / math.sqrt(D + 1), 1e19 / math.sqrt(P)
        a[2], g[2] = 3e38 / (4 * math.sqrt(D + 1)), 1e-30
    return a, g


KINDS = ["cancel", "subnormal-beside-huge", "gradient-overflow"]
#: (T, D, P): every one with p·w_a ≤ T·(w_a + p), so the per-sample gradients are formed
SHAPES = [(2, 1, 1), (3, 3, 3), (16, 24, 24), (64, 96, 96)]


def all_bounds(a, g, bias, c_rel=1e-3):
    """The instantiated bound, the certified bound with the per-sample gradients first and
    second, and the second try of every sample (:func:`gram.second_try_rows`)."""
    na, ng = pair_norms(a, g, bias)
    model = gram.fast_gram_model(a)
    assert gram.instantiation_pays(a.shape[1], a.shape[2] + bias, g.shape[2], model)
    return {
        "instantiated": gram.instantiated_ghost_bound(a, g, bias, na, ng)[0],
        "gradients-first": gram.certified_ghost_sq(a, g, bias, na, ng, c_rel,
                                                   gradients_first=True),
        "grams-first": gram.certified_ghost_sq(a, g, bias, na, ng, c_rel),
        "second-try-rows": gram.second_try_rows(a, g, bias, na, ng, model, c_rel),
    }


# -- 1. never below the exact norm ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_instantiated_bounds_cover_the_exact_norm(kind, bias, dtype):
    for T, D, P in SHAPES:
        if T == 64 and (dtype != torch.float32 or kind != "cancel"):
            continue  # the wide shape once: its exact norms take a second
        a, g = crafted(kind, T, D, P)
        a, g = a.to(dtype), g.to(dtype)
        for name, bound in all_bounds(a, g, bias).items():
            assert_covers(bound, a, g, bias, f"{kind} {name} T={T} D={D} P={P}")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_instantiated_bounds_cover_the_exact_norm_under_flush_to_zero(kind, bias):
    """Subnormal operands are read as zero by the matmul (denormals-are-zero) and subnormal
    products flushed: the row-norm floors cover what that loses."""
    stored = [crafted(kind, T, D, P) for T, D, P in SHAPES[:3]]  # subnormals stored before
    if not torch.set_flush_denormal(True):
        pytest.skip("no flush-to-zero on this CPU")
    try:
        bounds = [all_bounds(a, g, bias) for a, g in stored]
    finally:
        torch.set_flush_denormal(False)
    for (a, g), found in zip(stored, bounds):
        for name, bound in found.items():
            assert_covers(bound, a, g, bias, f"{kind} {name} T={a.shape[1]} (flush to zero)")


@pytest.mark.parametrize("bias", [False, True])
def test_per_sample_gradients_formed_a_few_samples_at_a_time_stay_each_samples_own(bias,
                                                                                 monkeypatch):
    """``GRADIENT_ENTRIES_AT_ONCE`` so small that each sample's per-sample gradient is formed
    alone: the bounds are those formed all at once, in the samples' order, each above its own
    exact norm (samples 10³⁰ apart, so that a bound of the wrong sample shows)."""
    a, g = crafted("cancel", 16, 24, 24)
    a[0] *= 1e-15
    g[2] *= 1e15
    na, ng = pair_norms(a, g, bias)
    whole = gram.instantiated_ghost_bound(a, g, bias, na, ng)[0]
    monkeypatch.setattr(gram, "GRADIENT_ENTRIES_AT_ONCE", 1)
    parts = gram.instantiated_ghost_bound(a, g, bias, na, ng)[0]
    assert torch.equal(parts, whole)
    assert_covers(parts, a, g, bias, "one sample at a time")


# -- 2. the release term decides looseness only --------------------------------------------------
CRAFT_KINDS = KINDS + ["mixed", "edge"]


def more_crafted(kind: str, T: int, D: int, P: int):
    """:func:`crafted`, and positions 30 orders apart (``mixed``) or Gram entries near float32's
    largest (``edge``)."""
    if kind in KINDS:
        return crafted(kind, T, D, P)
    a, g = crafted("none", T, D, P)
    if kind == "mixed":
        a[1, ::2], a[1, 1::2] = a[1, ::2] * 1e15, a[1, 1::2] * 1e-15
        g[1, ::2], g[1, 1::2] = g[1, ::2] * 1e-15, g[1, 1::2] * 1e15
    else:
        a[1] = a[1, :1] / a[1, :1].norm() * 0.45 * math.sqrt(3.4e38)
        g[1] = g[1] * 1e-10
    return a, g


@pytest.mark.parametrize("c_rel", [1e30, math.inf, math.nan])
@pytest.mark.parametrize("kind", CRAFT_KINDS)
def test_a_huge_or_non_finite_release_term_keeps_only_upper_bounds(kind, c_rel, monkeypatch):
    """With ``c_r`` so large that every finite fast bound is kept (the loose ones of crafted
    samples included), or infinite or NaN (``na·ng`` overflowing), every bound returned is still
    an upper bound of the exact norm, and none is NaN."""
    kept_loose = []
    own = gram.tight

    def spy(bound, slack, nu, floor=gram.NEGLIGIBLE, release=None):
        ok = own(bound, slack, nu, floor, release)
        kept_loose.append(bool((ok & ~own(bound, slack, nu, floor)).any()))
        assert not bool((ok & ~(bound < math.inf)).any()), "a non-finite bound was kept"
        return ok

    monkeypatch.setattr(gram, "tight", spy)
    for bias in (False, True):
        for T, D, P in [(2, 1, 1), (3, 6, 5), (16, 24, 24), (3, 130, 130)]:
            a, g = more_crafted(kind, T, D, P)
            na, ng = pair_norms(a, g, bias)
            for first in (False, True):
                bound = gram.certified_ghost_sq(a, g, bias, na, ng, c_rel, gradients_first=first)
                assert_covers(bound, a, g, bias, f"{kind} c_r={c_rel} T={T} D={D} first={first}")
    if c_rel == 1e30 and kind == "cancel":
        assert any(kept_loose), "no loose bound was kept: the release term went untested"


def test_tight_refuses_non_finite_bounds_slacks_and_norms_whatever_the_release():
    """``tight`` keeps no infinite or NaN bound (an infinite or NaN slack or ``ν̃`` gives one),
    whatever the release term (NaN, infinite, 0, huge)."""
    inf, nan = math.inf, math.nan
    # as the bounds come: ν̃ + slack (an infinite slack gives an infinite bound)
    bound = torch.tensor([inf, nan, nan, nan, 0.0, 2.0, inf], dtype=torch.float64)
    slack = torch.tensor([0.0, 0.0, nan, 0.5, 0.0, 1.0, inf], dtype=torch.float64)
    nu = torch.tensor([1.0, 1.0, 1.0, nan, 0.0, 1.0, 1.0], dtype=torch.float64)
    for r in (inf, nan, 0.0, 1e300):
        release = torch.full_like(nu, r)
        ok = gram.tight(bound, slack, nu, gram.NEGLIGIBLE, release).tolist()
        assert ok[:4] == [False] * 4, (r, ok)
        assert ok[6] is False, (r, ok)
        # a finite bound with a finite slack: kept or not, the choice is the release term's
        assert ok[5] is (r == math.inf or r == 1e300), (r, ok)


# -- 3. the blocked Grams, one block group at a time ---------------------------------------------
@pytest.mark.parametrize("entries", [1, 3 * 4 * 4 * 2, 1 << 23])
def test_blocked_grams_are_within_their_rounding_of_the_exact_gram(entries, monkeypatch):
    """``_gram_chunked`` against the exact Gram, with 1, 2 and every block formed at once
    (``GRAM_ENTRIES_AT_ONCE``), and the blocked second try's bound against the exact norm of a
    sample whose positions cancel (widths of several blocks where instantiation does not pay)."""
    monkeypatch.setattr(gram, "GRAM_ENTRIES_AT_ONCE", entries)
    a, g = crafted("cancel", 4, 200, 130, seed=3)
    a[0, 1] *= 1e-20  # magnitudes 20 orders apart across positions
    got = gram._gram_chunked(a, gram.CHUNK)
    A = [_ints(ai) for ai in a]
    gam = gram.gram_gamma(200, False, gram.CHUNK)
    norms = a.double().norm(dim=-1)
    for i in range(a.shape[0]):
        for t in range(4):
            for s in range(4):
                exact = Fraction(sum(x * y for x, y in zip(A[i][t], A[i][s])), 1 << (2 * SCALE))
                err = abs(Fraction(got[i, t, s].item()) - exact)
                allowed = gam * norms[i, t].item() * norms[i, s].item() * (1 + 1e-12)
                assert err <= Fraction(allowed) + Fraction(2 * 200 * 2.0 ** -126), (i, t, s)
    na, ng = pair_norms(a, g, True)
    model = gram.fast_gram_model(a)
    assert not gram.instantiation_pays(4, 201, 130, model)
    bound = gram.second_try_rows(a, g, True, na, ng, model, 1e-3)
    assert_covers(bound, a, g, True, f"blocked second try, {entries} entries at once")


# -- 4. end to end -------------------------------------------------------------------------------
class PatchEmbed(nn.Module):
    """``Conv2d(3, c, 8, stride 8)`` (depthwise ``Conv2d(3, 3, 8, stride 8, groups=3)`` with
    ``depthwise``) on 32 × 32 images, 16 positions flattened, a Linear head per position."""

    def __init__(self, bias: bool, depthwise: bool = False):
        super().__init__()
        c = 3 if depthwise else 8
        self.conv = nn.Conv2d(3, c, 8, 8, bias=bias, groups=3 if depthwise else 1)
        self.head = nn.Linear(c, 6)

    def forward(self, x):
        return self.head(self.conv(x).flatten(2).transpose(1, 2))


def alternating(model: nn.Module, x: torch.Tensor, K: float, seed: int = 7):
    """Targets making the output gradients ``±2u`` alternately across positions (|u| ~ K)."""
    with torch.no_grad():
        y = model(x)
    u = torch.randn(y.shape[-1], generator=torch.Generator().manual_seed(seed)) * K
    sign = torch.tensor([(-1.0) ** j for j in range(y.shape[1])]).unsqueeze(1)
    return y - sign * u


def patch_case(kind: str, bias: bool, depthwise: bool = False) -> Case:
    """Honest images of small noise; the crafted one repeats one patch ×10⁴ (relative steps
    10⁻⁶) with gradients of alternating sign (``cancel``), is noise ×10¹⁵ (``huge``: the
    per-sample gradients overflow float32) or ×10³ (``large``: its bound from the per-sample
    gradients is kept, and clips it), or alternates rows of ±10⁻⁴⁰ and 10²⁰
    (``subnormal``)."""
    torch.manual_seed(0)
    model = PatchEmbed(bias, depthwise)
    gen = torch.Generator().manual_seed(1)
    xh = torch.randn(3, 3, 32, 32, generator=gen) * 0.1
    with torch.no_grad():
        th = model(xh) + 0.02 * torch.randn(3, 16, 6, generator=gen)
    gen = torch.Generator().manual_seed(7)
    if kind == "cancel":
        patch = torch.randn(3, 8, 8, generator=gen) * 1e4
        x = torch.stack([(patch.double() * (1 + 1e-6 * j)).float() for j in range(16)])
        x, K = x.reshape(4, 4, 3, 8, 8).permute(2, 0, 3, 1, 4).reshape(1, 3, 32, 32), 1e3
    elif kind == "huge":
        x, K = torch.randn(1, 3, 32, 32, generator=gen) * 1e15, 1e18
    elif kind == "large":
        x, K = torch.randn(1, 3, 32, 32, generator=gen) * 1e3, 1e2
    else:
        x = torch.randn(1, 3, 32, 32, generator=gen).sign() * 1e-40
        x[..., ::2, :], K = 1e20, 1e-10
    return Case(model, (xh, th), (x, alternating(model, x, K)))


@pytest.fixture
def instantiated(monkeypatch):
    """The operand dtypes :func:`gram.instantiated_ghost_bound` was called with."""
    calls = []
    own = gram.instantiated_ghost_bound

    def spy(a, *rest):
        calls.append(a.dtype)
        return own(a, *rest)

    monkeypatch.setattr(gram, "instantiated_ghost_bound", spy)
    return calls


@pytest.mark.parametrize("depthwise", [False, True], ids=["patch", "depthwise"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["cancel", "huge", "large", "subnormal"])
def test_patch_embedding_with_per_sample_gradients_first(kind, bias, depthwise, instantiated):
    case = patch_case(kind, bias, depthwise)
    assert_large(case)
    for door, how in DOORS:
        assert_bounded(*run_pair(case, door, how), what=f"{kind} bias={bias} {door}-{how}")
    assert instantiated, "the per-sample gradients were never the ghost bound's try"


@pytest.mark.parametrize("kind", ["cancel", "large"])
def test_patch_embedding_under_bfloat16_autocast(kind, instantiated):
    """bfloat16 operands widened to float32 for the per-sample gradients on the CPU (the Opacus
    hooks flow with a sum loss: a mean loss is refused under 16-bit autocast)."""
    case = patch_case(kind, True)
    assert_large(case)
    for door, how in DOORS:
        kw, batch = {"amp": torch.bfloat16}, B
        if (door, how) == ("opacus", "hooks"):
            kw["loss_reduction"], batch = "sum", 1
        assert_bounded(*run_pair(case, door, how, **kw), tol=LOWP_TOL, batch=batch,
                       what=f"{kind} bf16 {door}-{how}")
    assert any(dtype == torch.bfloat16 for dtype in instantiated), instantiated


class TwoCalls(nn.Module):
    """``Conv2d(3, 8, k, stride, padding)`` called on the image and on its top-left 16 × 16 crop
    (the positions of both calls in one ghost norm), a Linear head per position."""

    def __init__(self, k: int, stride: int, padding: int):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 8, k, stride, padding=padding), nn.Linear(8, 6)

    def forward(self, x):
        y = torch.cat([self.conv(x).flatten(2), self.conv(x[..., :16, :16]).flatten(2)], 2)
        return self.head(y.transpose(1, 2))


@pytest.mark.parametrize("kind", ["large", "cancel"])
@pytest.mark.parametrize("k,stride,padding", [(8, 8, 0), (8, 4, 2)])
def test_conv_called_twice_with_per_sample_gradients_first(k, stride, padding, kind,
                                                           instantiated):
    """A conv called twice (non-overlapping patches, and overlapping padded windows): the
    crafted image is noise ×10³ (``large``) or one pixel ×10⁴ everywhere up to 1 + 10⁻⁶ε with
    gradients of alternating sign (``cancel``)."""
    torch.manual_seed(0)
    model = TwoCalls(k, stride, padding)
    gen = torch.Generator().manual_seed(1)
    xh = torch.randn(3, 3, 32, 32, generator=gen) * 0.1
    with torch.no_grad():
        y = model(xh)
    th = y + 0.02 * torch.randn(y.shape, generator=gen)
    gen = torch.Generator().manual_seed(7)
    if kind == "large":
        x, K = torch.randn(1, 3, 32, 32, generator=gen) * 1e3, 1e2
    else:
        x = (torch.randn(1, 3, 1, 1, generator=gen) * 1e4).expand(1, 3, 32, 32)
        x, K = x * (1 + 1e-6 * torch.randn(1, 3, 32, 32, generator=gen)), 1e3
    case = Case(model, (xh, th), (x, alternating(model, x, K)))
    assert_large(case)
    for door, how in DOORS:
        assert_bounded(*run_pair(case, door, how), what=f"k={k} s={stride} {kind} {door}-{how}")
    assert instantiated, "the per-sample gradients were never the ghost bound's try"


def stacked_case(D: int, T: int, eps: float) -> Case:
    """``Linear(D, D)`` three times on ``T`` positions (``p·w_a ≤ T·(w_a + p)``); the crafted
    sample repeats one input ×10⁴ (up to 1 + eps·ε, ε standard normal) with output gradients ±10³
    alternating over the positions: loose fast bounds in every layer, whose second tries form
    per-sample gradients (eps = 0.2: the cancellation leaves enough that their bound is kept)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(D, D) for _ in range(3)])
    gen = torch.Generator().manual_seed(2)
    x = 0.1 * torch.randn(3, T, D, generator=gen)
    with torch.no_grad():
        t = model(x) + 0.02 * torch.randn(3, T, D, generator=gen)
    xc = 1e4 * torch.randn(1, 1, D, generator=gen).expand(1, T, D)
    xc = (xc * (1 + eps * torch.randn(1, T, D, generator=gen))).contiguous()
    return Case(model, (x, t), (xc, alternating(model, xc, 1e3)))


@pytest.mark.parametrize("eps", [2.0 ** -12, 0.2])
@pytest.mark.parametrize("D,T", [(24, 16), (130, 66)], ids=["layer-by-layer", "rows-together"])
def test_layers_of_one_shape_take_instantiated_second_tries(D, T, eps, instantiated,
                                                           together_rows):
    """Three Linears of one shape: widths under two blocks take their second tries layer by layer
    (:func:`gram.second_try`), wider ones over their rows together
    (:func:`gram.second_try_rows` from the ghost stack); both form per-sample gradients."""
    together = together_rows
    case = stacked_case(D, T, eps)
    assert_large(case)
    for door, how in DOORS:
        assert_bounded(*run_pair(case, door, how), what=f"D={D} T={T} {door}-{how}")
    assert instantiated, "no second try formed per-sample gradients"
    if D >= 2 * gram.CHUNK:
        assert any(n >= 3 for n in together), f"no second try over several layers: {together}"


@pytest.mark.parametrize("precision", ["medium", "high"])
def test_no_per_sample_gradients_where_float32_matmuls_may_round_their_operands(precision,
                                                                               instantiated):
    """``torch.set_float32_matmul_precision("medium" | "high")`` (oneDNN's bfloat16 or TF32
    operands on the CPU): the IEEE model of the per-sample gradients does not hold, so they are
    never formed (the fast path is off: float64 Grams), and the patch embedding's large sample is
    clipped as before."""
    case = patch_case("large", True)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        assert gram.fast_gram_model(torch.zeros(1)) is None
        for door, how in DOORS:
            assert_bounded(*run_pair(case, door, how), what=f"{precision} {door}-{how}")
    finally:
        torch.set_float32_matmul_precision(before)
    assert not instantiated, "per-sample gradients formed under a rounding matmul precision"
