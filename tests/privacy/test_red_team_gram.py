"""Red team of the certified ghost norms from float32 Grams (:mod:`private_engine.layers.gram`),
the convolution's im2col per-sample gradients and clipped sums for small maps, and the Linear,
Conv and Embedding rules that use them.

One break, fixed: a training step written inside ``torch.autocast`` (the engine's norms and sums,
formed in the backward pass and in ``step``, ran under the caller's autocast, whose bfloat16
matmuls rounded the float32 Grams far beyond their certified bound; ratio 1.31). The tests of the
last section failed before the engine formed them with autocast off. The other attacks held and
are kept as regression tests.

Two contracts are measured directly:

* the bound: every certified ghost norm (the fast one from float32 Grams as it is, before any
  second try — on CUDA it is kept as it is —, the blocked second try's, the tensor-core model's on
  the same CPU Grams, and the refined result) is at least the exact float64 squared norm of the
  per-sample gradient, on crafted operands in float32, bfloat16 and float16;
* the release: with noise 0 and SGD at lr 1, ``B·‖Δupdate‖/R ≤ 1 + 10⁻⁶`` between a batch with
  and without one crafted sample (harness of tests/privacy/test_privacy_under_attack.py).

The crafted operands: positions whose Gram entries cancel while the row norms stay moderate
(alternating gradients on repeated inputs), with widths on both sides of the blocked second try's
``2·CHUNK`` threshold; subnormal rows next to rows near 10¹⁸ in one sample; rows near float32's
overflow (``‖a_t‖ ≈ 1.8·10¹⁹``, whose squares overflow); positions at scales 10⁻²⁰ to 10²⁰ in one
sample; many positions (T = 512); a NaN, an inf or a 10³⁰ hidden at a position the loss ignores.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import private_engine as pe
from private_engine import opacus_compat
from private_engine.layers.gram import (
    CHUNK,
    certified_ghost_sq,
    certified_token_ghost_sq,
    fast_ghost_bound,
)
from private_engine.layers.rounding import ETA32, ETA_TENSOR_CORE, pair_norms, row_norms64
from test_privacy_under_attack import (
    B,
    CapturingSGD,
    Case,
    R,
    assert_bounded,
    mse,
    opacus_private,
    released,
    run_pair,
    true_norm,
)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def exact_sq(a: torch.Tensor, g: torch.Tensor, bias: bool) -> torch.Tensor:
    """``‖g_iᵀ ã_i‖²_F`` per sample, the per-sample gradient formed in float64."""
    A, G = a.double(), g.double()
    if bias:
        A = torch.cat([A, torch.ones_like(A[..., :1])], 2)
    return torch.einsum("ntp,ntd->npd", G, A).square().sum((1, 2))


def crafted(kind: str, T: int, D: int, p: int, seed: int = 0):
    """Four samples ``(a, g)`` of T positions, widths D and p, all crafted as ``kind``."""
    gen = torch.Generator().manual_seed(seed)
    a, g = torch.randn(4, T, D, generator=gen), torch.randn(4, T, p, generator=gen)
    sign = (torch.arange(T) % 2 * 2 - 1).view(1, T, 1).float()
    if kind == "cancel":  # one input repeated, gradients alternating: Gram terms ±|a|²|g|²
        a = 1e4 * (torch.randn(4, 1, D, generator=gen) + 1e-4 * a)
        g = 1e3 * (sign * torch.randn(4, 1, p, generator=gen) + 1e-5 * g)
    elif kind == "subnormal_and_large":  # subnormal rows beside a row near 10¹⁸
        a = a * 1e-42
        a[:, 0] = torch.randn(4, D, generator=gen) * 1e18
        g = g * 10 ** (torch.rand(4, T, 1, generator=gen) * 60 - 40)
    elif kind == "near_overflow":  # ‖a_t‖ ≈ 1.8·10¹⁹: float32 squares and Gram entries overflow
        a = a / a.norm(dim=2, keepdim=True) * 1.8e19
        a = a * (0.9 + 0.2 * torch.rand(4, T, 1, generator=gen))
        g = g * 1e-25
    elif kind == "mixed_scales":  # positions at 10⁻²⁰ … 10²⁰ within one sample
        a = a * 10 ** (torch.rand(4, T, 1, generator=gen) * 40 - 20)
        g = g * 10 ** (torch.rand(4, T, 1, generator=gen) * 40 - 20)
    return a, g


def narrow(a: torch.Tensor, g: torch.Tensor, dtype: torch.dtype):
    """The operands in ``dtype`` (float16: clamped to its range first)."""
    if dtype == torch.float16:
        a, g = a.clamp(-6e4, 6e4), g.clamp(-6e4, 6e4)
    return a.to(dtype), g.to(dtype)


def assert_above(bound: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """``bound ≥ exact`` wherever the bound is finite (a non-finite bound drops the sample)."""
    keep = torch.isfinite(bound) & torch.isfinite(exact)
    short = (bound < exact) & keep
    assert not short.any(), f"{what}: bound {bound[short].tolist()} < {exact[short].tolist()}"


SHAPES = {"narrow": (6, 12, 7), "wide": (5, 130, 140), "long": (512, 3, 2)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["cancel", "subnormal_and_large", "near_overflow",
                                  "mixed_scales"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_gram_bound_is_at_least_the_exact_norm(shape, kind, bias, dtype):
    """The fast bound as it is (no second try), the blocked one, the tensor-core model's and the
    refined one are upper bounds of the exact float64 norm on crafted operands."""
    a, g = narrow(*crafted(kind, *SHAPES[shape]), dtype)
    na, ng = pair_norms(a, g, bias)
    exact = exact_sq(a, g, bias)
    assert_above(certified_ghost_sq(a, g, bias, na, ng), exact, "refined")
    assert_above(fast_ghost_bound(a, g, bias, na, ng, False, ETA32)[0], exact, "fast")
    assert_above(fast_ghost_bound(a, g, bias, na, ng, False, ETA32, chunk=CHUNK)[0], exact,
                 "blocked")
    assert_above(fast_ghost_bound(a, g, bias, na, ng, True, ETA_TENSOR_CORE)[0], exact,
                 "tensor-core model")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [7, 130])
def test_token_gram_bound_is_at_least_the_exact_norm(p, dtype):
    """One token repeated at every position, gradients alternating in sign (the token Gram
    cancels): the embedding's certified bound is at least the exact norm."""
    T = 9
    gen = torch.Generator().manual_seed(3)
    sign = (torch.arange(T) % 2 * 2 - 1).view(1, T, 1).float()
    g = 1e3 * (sign * torch.randn(4, 1, p, generator=gen) + 1e-5 * torch.randn(4, T, p,
                                                                               generator=gen))
    g = narrow(g, g, dtype)[1].float()
    ids = torch.zeros(4, T, dtype=torch.long)
    ids[1:, ::3] = 1  # samples 1-3: two tokens
    exact = torch.stack([sum(g[i, ids[i] == v].double().sum(0).square().sum()
                             for v in ids[i].unique()) for i in range(4)])
    assert_above(certified_token_ghost_sq(ids, g, row_norms64(g)), exact, "token")


# -- end to end -----------------------------------------------------------------------------------
DOORS = [("native", "bk_mixed"), ("native", "bk_mixopt"), ("native", "ghost"),
         ("native", "mixed"), ("native", "per_sample"), ("opacus", "ghost")]
DOOR_IDS = [f"{d}-{h}" for d, h in DOORS]
AMPS = {"float32": None, "bfloat16": torch.bfloat16}


def conv_case(nd: int, cin: int, cout: int, k: int, stride: int, pad: int, dil: int,
              groups: int, S: int) -> Case:
    """One convolution on a small map (fewer than 16 output positions: im2col release and, where
    positions ≤ channels per group, im2col per-sample gradients). The crafted input repeats one
    channel vector ×10⁴ at every pixel (every window the same), its output gradients ±2·10³
    alternate over the positions: the Gram terms are ~10¹⁴, the true norm ~10²–10⁴."""
    torch.manual_seed(0)
    conv = (nn.Conv1d, nn.Conv2d)[nd - 1]
    model = nn.Sequential(conv(cin, cout, k, stride=stride, padding=pad, dilation=dil,
                               groups=groups))
    gen = torch.Generator().manual_seed(1)
    x = 0.1 * torch.randn(3, cin, *(S,) * nd, generator=gen)
    with torch.no_grad():
        t = model(x) + 0.02 * torch.randn(model(x).shape, generator=gen)
    xc = 1e4 * torch.randn(1, cin, *(1,) * nd, generator=gen).expand(1, cin, *(S,) * nd)
    xc = (xc * (1 + 2 ** -12 * torch.randn(xc.shape, generator=gen))).contiguous()
    with torch.no_grad():
        y = model(xc)
    T = y[0, 0].numel()
    sign = torch.tensor([(-1.0) ** i for i in range(T)])
    if T % 2:
        sign[-1] = 0
    u = 1e3 * torch.randn(1, cout, *(1,) * nd, generator=gen)
    gdir = u * sign.reshape(y.shape[2:]) * (1 + 1e-5 * torch.randn(y.shape, generator=gen))
    return Case(model, (x, t), (xc, y - gdir / 2))


CONVS = {
    "conv1d": (1, 4, 8, 3, 1, 0, 1, 1, 4),
    "conv2d-stride-pad-groups": (2, 4, 8, 3, 2, 1, 1, 2, 6),
    "conv2d-dilation-groups4": (2, 4, 16, 2, 1, 0, 2, 4, 5),
    "conv2d-wide": (2, 130, 8, 1, 1, 0, 1, 1, 3),
}


@pytest.mark.parametrize("amp", list(AMPS))
@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
@pytest.mark.parametrize("conv", list(CONVS))
def test_conv_small_map_cancellation_is_clipped(conv, door, how, amp):
    case = conv_case(*CONVS[conv])
    assert true_norm(case.model, *case.crafted) >= 10.0
    assert_bounded(*run_pair(case, door, how, amp=AMPS[amp]), what=f"{conv} {door}-{how} {amp}")


def wide_linear_case(D: int, bias: bool, layers: int = 1) -> Case:
    """``Linear(D, D)`` (``layers`` of them in a row) on 3 positions; the crafted sample repeats one
    input ×10⁴ whose output gradients ±2·10³ alternate: D ≥ 2·CHUNK takes the blocked second try,
    a smaller D the float64 Grams."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(D, D, bias=bias) for _ in range(layers)])
    gen = torch.Generator().manual_seed(2)
    x = 0.1 * torch.randn(3, 3, D, generator=gen)
    with torch.no_grad():
        t = model(x) + 0.02 * torch.randn(3, 3, D, generator=gen)
    xc = 1e4 * torch.randn(1, 1, D, generator=gen).expand(1, 3, D)
    xc = (xc * (1 + 2 ** -12 * torch.randn(1, 3, D, generator=gen))).contiguous()
    with torch.no_grad():
        y = model(xc)
    u = 1e3 * torch.randn(1, 1, D, generator=gen)
    gdir = u * torch.tensor([1.0, -1.0, 0.0]).view(1, 3, 1)
    gdir = gdir * (1 + 1e-5 * torch.randn(y.shape, generator=gen))
    return Case(model, (x, t), (xc, y - gdir / 2))


@pytest.mark.parametrize("amp", list(AMPS))
@pytest.mark.parametrize("door,how", DOORS[:4], ids=DOOR_IDS[:4])
@pytest.mark.parametrize("D,bias", [(130, True), (130, False), (40, True)])
def test_linear_cancellation_through_the_second_tries_is_clipped(D, bias, door, how, amp):
    case = wide_linear_case(D, bias)
    assert true_norm(case.model, *case.crafted) >= 10.0
    assert_bounded(*run_pair(case, door, how, amp=AMPS[amp]), what=f"D={D} {door}-{how} {amp}")


class FirstPosition(nn.Module):
    """``Linear → Linear`` on ``(n, 2, 8)``, the loss reading position 0 only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.l2(self.l1(x))[:, :1]


@pytest.mark.parametrize("amp", list(AMPS))
@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30])
def test_value_hidden_at_an_ignored_position(value, door, how, amp):
    """A NaN, inf or 10³⁰ at a position whose output the loss ignores (its output gradient is 0,
    its Gram entries not finite) neither fails the step nor passes unclipped."""
    model = FirstPosition()
    x = 0.1 * torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        t = model(x) + 0.02
    xc = torch.randn(1, 2, 8, generator=torch.Generator().manual_seed(5))
    xc[0, 1] = value
    with torch.no_grad():
        tc = model(xc) + 100.0
    case = Case(model, (x, t), (xc, tc))
    assert_bounded(*run_pair(case, door, how, amp=AMPS[amp]), what=f"{value} {door}-{how} {amp}")


# -- the clipping computed while the caller's autocast is on ------------------------------------
def autocast_gram_operands(seed: int = 0, n: int = 64, T: int = 4, w: int = 16, c: float = 0.15):
    """``n`` samples whose ``T`` inputs share one direction (plus ``c``-sized noise) and whose
    output gradients alternate in sign around another: the ghost norm is a fraction of
    ``Σ|A_ts G_ts|``, yet the fast bound's slack stays below ``LOOSE·ν̃`` (no second try)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, 1, w, generator=gen) + c * torch.randn(n, T, w, generator=gen)
    sign = torch.tensor([(-1.0) ** t for t in range(T)]).view(1, T, 1)
    g = sign * torch.randn(n, 1, w, generator=gen) + c * torch.randn(n, T, w, generator=gen)
    return a.bfloat16(), g.bfloat16()


def test_gram_bound_holds_under_the_callers_autocast():
    """The engine's norms are computed in the backward pass and in ``step``, i.e. under the
    caller's autocast when the training step is written inside ``with torch.autocast(...)``.
    CPU autocast runs ``torch.bmm`` in bfloat16 and rounds the "float32" Grams to bfloat16
    (2⁻⁹ relative per entry), which the fast bound's ``γ_w`` at 2⁻²⁴ does not cover: the bound
    came out at 0.71 of the exact squared norm."""
    a, g = autocast_gram_operands()
    na, ng = pair_norms(a, g, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bound = certified_ghost_sq(a, g, False, na, ng)
    assert_above(bound, exact_sq(a, g, False), "under autocast")


def autocast_case(seed: int = 27, T: int = 4, D: int = 16) -> Case:
    """``Linear(D, D, bias=False)`` on T positions; the crafted sample's inputs share one direction
    (noise 0.1) and its output gradients (×10) alternate in sign around another (noise 0.1): true
    norm 27.5, ghost norm a fraction of ``Σ|A G|`` but its fast bound not loose."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D, bias=False))
    gen = torch.Generator().manual_seed(100)
    x = 0.1 * torch.randn(3, T, D, generator=gen)
    with torch.no_grad():
        t = model(x) + 0.01 * torch.randn(3, T, D, generator=gen)
    gen = torch.Generator().manual_seed(seed)
    xc = torch.randn(1, 1, D, generator=gen) + 0.1 * torch.randn(1, T, D, generator=gen)
    sign = torch.tensor([(-1.0) ** i for i in range(T)]).view(1, T, 1)
    gd = sign * torch.randn(1, 1, D, generator=gen) + 0.1 * torch.randn(1, T, D, generator=gen)
    with torch.no_grad():
        y = model(xc)
    return Case(model, (x, t), (xc, y - 5 * gd))


def step_inside_autocast(case: Case, door: str, how: str, batch) -> list:
    """One private step (noise 0, SGD at lr 1) written entirely inside
    ``torch.autocast("cpu", dtype=torch.bfloat16)``: the native ``opt.step(loss=…)``, or the
    Opacus door's ``loss.backward()`` and ``optimizer.step()`` (sum loss, ``loss_reduction="sum"``).
    Returns the released tensors."""
    model = copy.deepcopy(case.model)
    opt = CapturingSGD(model.parameters())
    x, t = batch
    if door == "native":
        engine = pe.PrivacyEngine(model, batch_size=B, sample_size=10 * B, max_grad_norm=R,
                                  noise_multiplier=0.0, clipping_mode=how)
        engine.attach(opt)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            opt.step(loss=mse(model(x), t))
        return released(model, opt)
    out = opacus_private(opacus_compat.PrivacyEngine(accountant="rdp"), model, opt, how,
                         loss_reduction="sum")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mse(out[0](x), t).sum().backward()
        out[1].step()
    return released(model, opt)


@pytest.mark.parametrize("door,how", [("native", "ghost"), ("native", "bk_mixed"),
                                      ("native", "mixed"), ("opacus", "hooks")],
                         ids=["native-ghost", "native-bk_mixed", "native-mixed", "opacus-hooks"])
def test_step_inside_autocast_is_clipped(door, how):
    """The whole step written inside ``torch.autocast("cpu", dtype=torch.bfloat16)`` (a common
    way to write a mixed-precision loop): the crafted sample of :func:`autocast_case` moved the
    release by 1.31·R (ratio 1.3079 in every mode that takes the Linear's ghost norm, and the
    Opacus door's plain backward); with the step outside autocast the same sample gives 0.9997."""
    case = autocast_case()
    assert true_norm(case.model, *case.crafted) >= 10.0
    runs = [step_inside_autocast(case, door, how, b) for b in (case.with_sample, case.honest)]
    assert_bounded(*runs, batch=1 if door == "opacus" else B, what=f"{door}-{how}")
