"""The convolution rule's window sums (the mass of its certified bound) and its batched im2col:
the strided-slice window sums equal the convolution with a kernel of ones for every stride,
dilation, padding, spatial rank and group count, and ``F.unfold`` runs once over the batch folded
into the channels, with the columns of one ``F.unfold`` per sample."""
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from private_engine.layers import conv as conv_rule

pytestmark = pytest.mark.usefixtures("one_thread")

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


def _ones_conv(module, x, padding):
    ones = x.new_ones(x.shape[1], 1, *module.kernel_size)
    conv = (F.conv1d, F.conv2d, F.conv3d)[x.dim() - 3]
    return conv(x, ones, None, module.stride, padding, module.dilation, x.shape[1])


CASES = [  # (nd, kernel, stride, padding, dilation, groups, size)
    (2, 3, 1, 1, 1, 1, 5), (2, 3, 2, 1, 1, 1, 5), (2, 7, 2, 3, 1, 1, 9), (2, 1, 2, 0, 1, 1, 4),
    (2, (3, 2), (2, 1), (1, 0), (2, 1), 2, 7), (2, 3, 3, 2, 2, 1, 6), (2, 2, 2, 0, 1, 4, 4),
    (1, 5, 2, 2, 1, 1, 11), (1, 3, 1, 0, 3, 3, 9), (3, 3, 2, 1, 1, 1, 5),
    (3, 2, 1, (1, 0, 1), 2, 2, 5),
    (2, 3, 1, 4, 1, 1, 3),  # padding wider than the kernel reaches: windows of zeros only
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_slices_sum_the_windows_as_the_ones_convolution(case, monkeypatch):
    """Integer-valued float64 inputs, so every order of summation is exact: the slices (forced)
    give the convolution's very numbers, and the path the rule takes by default too."""
    nd, k, s, p, d, groups, size = case
    module = CONV[nd](2 * groups, groups, k, stride=s, padding=p, dilation=d, groups=groups)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50, (3, groups, *[size] * nd), generator=gen).double()
    padding = tuple(module.padding) if not isinstance(module.padding, str) else (0,) * nd
    expected = _ones_conv(module, x, padding)
    for offsets in (1 << 30, conv_rule.WINDOW_SUM_MAX_OFFSETS):
        monkeypatch.setattr(conv_rule, "WINDOW_SUM_MAX_OFFSETS", offsets)
        got = conv_rule.window_sums(module, x, padding)
        assert got.shape == expected.shape and torch.equal(got, expected)


def test_slices_add_the_terms_that_overflow():
    """An infinite square (an overflow) reaches every window that holds it, as in the
    convolution, so the mass is infinite and the rule drops what it bounds."""
    module = nn.Conv2d(1, 1, 3, stride=1, padding=1)
    x = torch.zeros(1, 1, 5, 5)
    x[0, 0, 2, 2] = float("inf")
    got = conv_rule.window_sums(module, x, (1, 1))
    assert torch.equal(torch.isinf(got), torch.isinf(_ones_conv(module, x, (1, 1))))
    assert torch.isinf(got).sum() == 9 and not torch.isnan(got).any()


@pytest.mark.parametrize("nd", [1, 2])
def test_the_batch_is_one_unfold_with_the_per_sample_columns(nd, monkeypatch):
    """The CPU's ``F.unfold`` path runs one kernel over the batch folded into the channels (its
    per-sample loop opens one parallel region per sample) and returns the columns of the strided
    window copy, and for every sample those of ``F.unfold`` of that sample alone (strided,
    dilated, padded, grouped; a 1-d layer as a 2-d one of height 1)."""
    batches = []
    unfold = F.unfold

    def spy(x, *args, **kwargs):
        batches.append(x.shape[0])
        return unfold(x, *args, **kwargs)

    monkeypatch.setattr(conv_rule.F, "unfold", spy)
    for k, s, p, d in itertools.product([2, 3], [1, 2], [0, 1], [1, 2]):
        module = CONV[nd](4, 2, k, stride=s, padding=p, dilation=d, groups=2)
        a = torch.randn(3, 4, *[7] * nd, generator=torch.Generator().manual_seed(k * s + p))
        monkeypatch.setattr(conv_rule, "WINDOW_COPY_MIN_POSITIONS", 1 << 30)
        batches.clear()
        folded = conv_rule.unfolded_columns(module, a)
        # non-overlapping windows (k = s = 2, no padding) are a view of the input, no kernel
        assert batches == ([] if conv_rule.non_overlapping(module) else [1])
        monkeypatch.setattr(conv_rule, "WINDOW_COPY_MIN_POSITIONS", 0)
        assert torch.equal(folded, conv_rule.unfolded_columns(module, a))
        if nd == 2:
            for i in range(a.shape[0]):
                one = unfold(a[i:i + 1], k, d, p, s).reshape(1, 2, 2 * k * k, -1)
                assert torch.equal(folded[i:i + 1], one)


def _exact_mass(module, a, g, bias):
    """``M_i = Σ_γ Σ_t ‖(U(a_i)^γ_t, 1)‖·‖g_{i,t}^γ‖`` in float64 from the im2col copy (exact
    copies of the inputs; float64 squares of float32 values are exact)."""
    m = module.double()
    cols = conv_rule.unfolded_columns(m, a.double())  # (B, groups, D, T)
    sq = cols.square().sum(2)
    if bias:
        sq = sq + 1
    B, groups = cols.shape[:2]
    gg = g.double().reshape(B, groups, -1, cols.shape[-1]).square().sum(2)
    return (sq.sqrt() * gg.sqrt()).sum((1, 2))


@pytest.mark.parametrize("slices", [False, True], ids=["mass-conv", "mass-slices"])
@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e-40, 1e18], ids=lambda s: f"x{s:g}")
def test_the_mass_bounds_the_exact_mass(scale, slices, monkeypatch):
    """The rule's float64 mass ``M`` is at least the exact one for inputs of every magnitude —
    ordinary, whose float32 squares underflow (1e-30), subnormal (1e-40), whose squares sum near
    float32's top (1e18) — with the window sums from the convolution or from slices."""
    monkeypatch.setattr(conv_rule, "WINDOW_SUM_MAX_OFFSETS", (1 << 30) if slices else 0)
    rule = conv_rule.ConvRule()
    for groups, stride, padding in [(1, 1, 1), (2, 2, 1), (1, 2, 0)]:
        module = nn.Conv2d(4, 4, 3, stride=stride, padding=padding, groups=groups)
        gen = torch.Generator().manual_seed(groups + stride)
        a = (torch.randn(3, 4, 6, 6, generator=gen) * scale).float()
        out = F.conv2d(a, module.weight.detach(), None, stride, padding, 1, groups)
        g = torch.randn(out.shape, generator=gen)
        mass = rule._mass_of(module, [(a, g)], *rule._position_bounds(module, [(a, g)], True))
        exact = _exact_mass(module, a, g, True)
        assert torch.isfinite(mass).all() and (mass >= exact).all(), (mass, exact)


def _exact_rows(module, calls, bias):
    """Exact float64 ``‖(U(a_i)^γ_t, 1)‖`` and ``‖g_{i,t}^γ‖``, ``(B, groups, Σ T)``, from the
    im2col copy of each call, positions concatenated in call order."""
    m = module.double()
    na, ng = [], []
    for a, g in calls:
        cols = conv_rule.unfolded_columns(m, a.double())  # (B, groups, D, T)
        sq = cols.square().sum(2) + (1 if bias else 0)
        B, groups = cols.shape[:2]
        na.append(sq.sqrt())
        ng.append(g.double().reshape(B, groups, -1, cols.shape[-1]).square().sum(2).sqrt())
    return torch.cat(na, 2), torch.cat(ng, 2)


@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e-40, 1e18], ids=lambda s: f"x{s:g}")
def test_position_bounds_bound_every_window_row(scale):
    """The float64 bounds the mass and the ghost norm's Grams are weighed with are at least the
    exact row norms of the im2col copy (bias column included) and of the output gradient, for
    inputs of every magnitude, grouped layers, and a layer called twice on maps of two sizes."""
    rule = conv_rule.ConvRule()
    for groups, stride, padding in [(1, 1, 1), (2, 2, 1), (1, 2, 0)]:
        module = nn.Conv2d(4, 4, 3, stride=stride, padding=padding, groups=groups)
        gen = torch.Generator().manual_seed(groups + stride)
        calls = []
        for size in (6, 5):
            a = (torch.randn(3, 4, size, size, generator=gen) * scale).float()
            out = F.conv2d(a, module.weight.detach(), None, stride, padding, 1, groups)
            calls.append((a, torch.randn(out.shape, generator=gen)))
        for bias in (False, True):
            na2, ng = rule._position_bounds(module, calls, bias)
            exact_a, exact_g = _exact_rows(module, calls, bias)
            assert na2.shape == exact_a.shape and ng.shape == exact_g.shape
            assert (na2.sqrt() * (1 + 2.0 ** -51) >= exact_a).all()
            assert (ng >= exact_g).all()


def test_the_ghost_bound_reads_no_im2col_row(monkeypatch):
    """The certified ghost bound of a 3×3 convolution weighs its float32 Grams' rounding with the
    row bounds of its mass, taking no norm of the im2col rows (``Πk`` times the input), and still
    covers what the layer releases for a crafted sample and the exact float64 norm."""
    widths = []
    row_norms64 = conv_rule.row_norms64

    def recorded(t):
        widths.append(t.shape[-1])
        return row_norms64(t)

    monkeypatch.setattr(conv_rule, "row_norms64", recorded)
    module = nn.Conv2d(2, 4, 3, stride=2, padding=1)
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(3, 2, 5, 5, generator=gen)
    a[0] = 2e4 * (1 + 2 ** -20 * torch.randn(2, 5, 5, generator=gen))
    g = torch.randn(3, 4, 3, 3, generator=gen)
    g[0] = 0
    g[0, :, 1, 0], g[0, :, 1, 1] = 1e3, -1e3
    rule = conv_rule.ConvRule()
    bound = rule.certified_norm_sq(module, [(a, g)], True).sqrt()
    assert widths and 2 * 9 not in widths, widths
    for i in range(3):
        factors = torch.zeros(3, dtype=torch.float64)
        factors[i] = 1
        released = torch.cat([t.double().flatten() for t in
                              rule.weighted_grads(module, [(a, g)], factors).values()]).norm()
        assert released <= bound[i]
    exact = rule.instantiated_norm_sq(module.double(), [(a.double(), g.double())]).sqrt()
    assert (bound >= exact * (1 - 1e-12)).all()
