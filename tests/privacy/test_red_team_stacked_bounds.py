"""Red team of the stacked certified bounds: the ghost-norm bounds of many Linears formed together
at the end of the norm pass (:class:`private_engine.layers.ghost_stack.GhostBoundStack`), the
LayerNorm per-sample gradients of one shape instantiated together
(:class:`private_engine.layers.norm_stack.LayerNormGradStack`) and the clip factors repeated per
position (:func:`private_engine.layers.linear.row_factors`), attacked.

Same contract and harness as tests/privacy/test_privacy_under_attack.py: noise 0, SGD at lr 1,
one step with and without the attacker's sample (same other samples, declared batch size B)::

    ratio = B·‖Δ(released)‖ / R  ≤  1 + 1e-6

or both runs refused with a ValueError before anything is released. The stack is also checked
directly: each layer's stacked bound against the per-layer certificate
(:meth:`LinearRule.certified_norm_sq`) and against the float64 per-sample gradient norm, with
crafted operands in some layers beside honest ones in the same batched Gram, and the chunk sizes
forced down so that every layer falls in its own chunk.

Three breaks found here are fixed (each test failed before its fix; the ratio is in its
docstring): activations written through ``.data`` during the backward, between a layer's norm and
its clipped sum (section 7). One documented limit is ``xfail(strict=True)``: such a write that
keeps every row's sum. The other tests are attacks that held, kept as regression tests.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import private_engine as pe
from private_engine.clipping import clipper as clipper_module
from private_engine.layers import ghost_stack
from private_engine.layers.ghost_stack import GhostBoundStack
from private_engine.layers.linear import LinearRule, row_factors
from test_privacy_under_attack import (
    DOOR_IDS,
    DOORS,
    LOWP_TOL,
    MODES,
    B,
    CapturingSGD,
    Case,
    R,
    assert_bounded,
    assert_hooks_in_16_bit,
    assert_large,
    autocast,
    bf16,
    honest_positions,
    mse,
    native_release,
    opposite_targets,
    released,
    run_pair,
)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]


# -- 1. the stack against the per-layer certificate and the float64 truth --------------------------
def exact_norm_sq(a: torch.Tensor, g: torch.Tensor, bias: bool) -> torch.Tensor:
    """``‖g_iᵀ a_i‖²_F (+ ‖Σ_t g_{i,t}‖²)`` in float64, one per-sample gradient each."""
    a, g = a.double(), g.double()
    n = torch.einsum("ntp,ntd->npd", g, a).flatten(1).pow(2).sum(1)
    return n + g.sum(1).pow(2).sum(1) if bias else n


def craft(a: torch.Tensor, g: torch.Tensor, kind: str, i: int) -> None:
    """Make sample ``i`` of one layer's operands hostile, in place."""
    if kind == "cancel":  # two almost equal inputs, opposite output gradients
        x = torch.randn(a.shape[2]) * 1e4
        a[i, 0], a[i, 1] = x, (x.double() * (1 + 1e-5)).float()
        u = torch.randn(g.shape[2]) * 1e3
        g[i, 0], g[i, 1] = u, -u
        g[i, 2:] = 0
    elif kind == "huge":
        a[i] *= 1e30
    elif kind == "huge-g":
        g[i] *= 1e30
        a[i] *= 1e10
    elif kind == "tiny":
        a[i] *= 1e-30
        g[i] *= 1e-30
    elif kind == "subnormal":
        a[i], g[i] = 1e-40, 1e-40
    elif kind == "inf":
        a[i, 0, 0] = math.inf
    elif kind == "nan":
        g[i, 1, 2] = math.nan
    elif kind == "one-loose-row":  # loose in this layer only
        a[i, 0] *= 1e15
        g[i, 1] *= 1e-10


#: (N, T, D, P, dtype, trained bias) per layer: groups of one shape beside other shapes and T
SPECS = [(4, 2, 8, 8, torch.float32, False), (4, 5, 8, 16, torch.float32, True),
         (4, 2, 8, 8, torch.bfloat16, True), (4, 5, 16, 8, torch.float32, False),
         (4, 2, 8, 8, torch.float32, True), (4, 2, 8, 8, torch.bfloat16, False),
         (4, 5, 8, 16, torch.float32, True), (4, 2, 8, 8, torch.float32, False)]


@pytest.mark.parametrize("chunks", ["default", "one-layer-per-chunk"])
@pytest.mark.parametrize("kind", ["cancel", "huge", "huge-g", "tiny", "subnormal", "inf", "nan",
                                  "one-loose-row"])
def test_stacked_bounds_are_the_per_layer_certificates(kind, chunks, monkeypatch):
    """Every second layer's operands crafted (a different sample in each), the others honest, all
    handed to one stack: each layer's stacked bound is its per-layer certificate (to 1e-10, finite
    in the same samples) and above its float64 per-sample norm²."""
    if chunks != "default":
        monkeypatch.setattr(ghost_stack, "BOUND_ELEMENTS", 1)
        monkeypatch.setattr(ghost_stack, "STACK_ELEMENTS", 40)
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    rule, stack, ops = LinearRule(), GhostBoundStack(), []
    for n, (N, T, D, P, dtype, bias) in enumerate(SPECS):
        a, g = torch.randn(N, T, D, generator=gen), torch.randn(N, T, P, generator=gen)
        if n % 2 == 0:
            craft(a, g, kind, n % N)
        a, g = a.to(dtype), g.to(dtype)
        m = nn.Linear(D, P, bias=bias)
        assert rule.defer_ghost_norm_sq(m, [(a, g)], stack)
        ops.append((m, a, g, bias))
    stack.take()
    assert len(stack) == 0 and len(stack.rows) == len(ops)
    for row, (m, a, g, bias) in zip(stack.rows, ops):
        own = rule.certified_norm_sq(m, [(a, g)], True)
        true = exact_norm_sq(a, g, bias)
        assert torch.equal(torch.isfinite(row), torch.isfinite(own))
        fin = torch.isfinite(own)
        assert torch.allclose(row[fin], own[fin], rtol=1e-10, atol=0)
        assert bool((row[torch.isfinite(true)] >= true[torch.isfinite(true)]).all())


# -- 2. end to end: many Linears of one shape, batched together -----------------------------------
W = 16  # every layer's width: one operand shape, one batched Gram


def chain(depth: int = 4, seed: int = 0) -> nn.Module:
    """``depth`` Linear(W, W) in a row (no activation: each layer of the crafted sample cancels)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(W, W) for _ in range(depth)])


def cancel_sample(model: nn.Module, M: float = 1e4, eps: float = 1e-5, K: float = 1e3,
                  seed: int = 19, width: int = W):
    """Two positions with inputs ``x, x(1+ε)`` (|x| ~ M) and targets giving output gradients
    ``±2u`` (|u| ~ K): the ghost norm cancels in float32 in every layer the two positions reach."""
    g = torch.Generator().manual_seed(seed)
    x1 = torch.randn(width, generator=g) * M
    x = torch.stack([x1, (x1.double() * (1 + eps)).float()])[None]
    with torch.no_grad():
        y = model(x)
    return x, opposite_targets(y, torch.randn(y.shape[-1], generator=g) * K)


def chain_case(depth: int = 4) -> Case:
    """The chain with 3 honest samples and one cancelling sample."""
    model = chain(depth)
    return Case(model, honest_positions(model, W, W), cancel_sample(model))


#: how the stack is squeezed: name -> {(module, attribute): value}
SQUEEZES = {
    "default": {},
    # every layer in its own chunk of the (L, N, T, T) stack and of the stacked operands
    "chunked": {(ghost_stack, "BOUND_ELEMENTS"): 1, (ghost_stack, "STACK_ELEMENTS"): 2 * B * W},
    # two-pass modes: the held-gradient limit crossed after the first two layers
    "held-limit": {(clipper_module, "HELD_GRADIENTS"): 2 * B * 2 * W + 1},
}


@pytest.mark.parametrize("squeeze", list(SQUEEZES))
@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_cancellation_in_a_stack_of_identical_linears(door, how, squeeze, monkeypatch):
    """Four Linear(16, 16) on two positions (one batched Gram per operand), the crafted sample
    cancelling in each: bounded with the default chunks, one layer per chunk, and the two-pass
    held-gradient limit crossed in the middle of the norm pass."""
    for (module, name), value in SQUEEZES[squeeze].items():
        monkeypatch.setattr(module, name, value)
    case = chain_case()
    assert_large(case)
    assert_bounded(*run_pair(case, door, how), what=f"{door}-{how}-{squeeze}")


class TwoBranches(nn.Module):
    """``head(left(x[..., :W]) + right(x[..., W:]))``: three Linears of one shape; a sample can
    cancel in ``left`` and ``head`` while it is honest in ``right``."""

    def __init__(self):
        super().__init__()
        self.left, self.right, self.head = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x):
        return self.head(self.left(x[..., :W]) + self.right(x[..., W:]))


def branch_case(scale: float) -> Case:
    """The crafted sample's left half cancels (|x| ~ 1e4), its right half is honest, times
    ``scale`` (1e-30: its right-hand rows are tiny, its left-hand rows huge)."""
    torch.manual_seed(0)
    model = TwoBranches()
    honest = honest_positions(model, 2 * W, W)
    x, _ = cancel_sample(model.left, width=W)
    right = torch.randn(1, 2, W, generator=torch.Generator().manual_seed(4)) * 0.1 * scale
    x = torch.cat([x, right], -1)
    with torch.no_grad():
        y = model(x)
    u = torch.randn(W, generator=torch.Generator().manual_seed(5)) * 1e3
    return Case(model, honest, (x, opposite_targets(y, u)))


@pytest.mark.parametrize("scale", [1.0, 1e-30])
@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_sample_loose_in_some_layers_only(door, how, scale):
    """A sample loose (second try) in two layers of a batched group but not in the third."""
    case = branch_case(scale)
    assert_large(case)
    assert_bounded(*run_pair(case, door, how), what=f"{door}-{how}")


class Twice(nn.Module):
    """One Linear applied twice (two calls: its bound is formed at once, never deferred) beside
    a Linear of the same shape called once."""

    def __init__(self):
        super().__init__()
        self.twice, self.once = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x):
        return self.once(self.twice(self.twice(x)))


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_linear_called_twice_beside_a_stacked_one(door, how):
    """The crafted sample cancels through a Linear called twice and the stacked one after it."""
    torch.manual_seed(0)
    model = Twice()
    case = Case(model, honest_positions(model, W, W), cancel_sample(model))
    assert_large(case)
    assert_bounded(*run_pair(case, door, how), what=f"{door}-{how}")


def frozen_chain(which: str) -> nn.Module:
    """The chain with the weights of layers 1 and 3 frozen (their biases trained) or their biases
    only trainable on a bias-free neighbour: trained and partly trained layers of one shape."""
    model = chain()
    for n in (1, 3):
        model[n].weight.requires_grad_(False)
    if which == "bias-only-and-no-bias":
        model[2] = nn.Linear(W, W, bias=False)
    return model


@pytest.mark.parametrize("which", ["frozen-weights", "bias-only-and-no-bias"])
@pytest.mark.parametrize("magnitude", ["cancel", "huge"])
@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_frozen_weights_with_trained_biases_in_a_stack(door, how, magnitude, which):
    """Layers whose weight is frozen (bias trained) between stacked layers of one shape."""
    model = frozen_chain(which)
    if magnitude == "cancel":
        crafted = cancel_sample(model)
    else:
        x = torch.full((1, 2, W), 1e30)
        crafted = (x, torch.full((1, 2, W), -1e30))
    case = Case(model, honest_positions(model, W, W), crafted)
    assert_bounded(*run_pair(case, door, how), may_refuse=False, what=f"{door}-{how}")


# -- 3. what a failed norm pass leaves ------------------------------------------------------------
def engine_for(model: nn.Module, mode: str):
    """A native engine (noise 0, R, batch B) and its capturing SGD on ``model``."""
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=10 * B, max_grad_norm=R,
                              noise_multiplier=0.0, clipping_mode=mode)
    opt = CapturingSGD(model.parameters())
    engine.attach(opt)
    return engine, opt


@pytest.mark.parametrize("mode", [m for m in MODES if m != "per_sample"])
def test_norm_pass_failing_midway_leaves_no_bound_behind(mode, monkeypatch):
    """The norm pass raises at the third Linear, after two were handed to the stack; the next
    step (with the crafted sample) releases what a fresh engine releases, and nothing stays in
    the stacks."""
    case = chain_case()
    x, t = case.with_sample
    model = copy.deepcopy(case.model)
    engine, opt = engine_for(model, mode)
    calls = {"n": 0}
    original = LinearRule.defer_ghost_norm_sq

    def failing(self, module, pairs, stack):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("norm pass interrupted")
        return original(self, module, pairs, stack)

    monkeypatch.setattr(LinearRule, "defer_ghost_norm_sq", failing)
    with pytest.raises(RuntimeError, match="interrupted"):
        opt.step(loss=mse(model(x), t))
    assert opt.steps == 0
    monkeypatch.setattr(LinearRule, "defer_ghost_norm_sq", original)
    clipper = engine.clipper
    assert len(clipper.ghost_bounds) == 0 and len(clipper.norm_grads) == 0
    opt.zero_grad(set_to_none=True)
    opt.step(loss=mse(model(x), t))
    again = released(model, opt)
    fresh = native_release(case.model, x, t, mode)
    assert all(torch.equal(u, v) for u, v in zip(again, fresh))
    assert_bounded(again, native_release(case.model, *case.honest, mode), what=mode)


# -- 4. dtypes ------------------------------------------------------------------------------------
def bf16_chain_case(seed: int = 16) -> Case:
    """The chain under bfloat16 autocast: ordinary magnitudes (|x| ~ 20, ε = 2%) cancel in the
    bfloat16 Grams of every layer (widened to float32 on the CPU)."""
    model = chain()
    x, t = honest_positions(model, W, W)
    g = torch.Generator().manual_seed(seed)
    x1 = bf16(torch.randn(W, generator=g) * 20)
    xc = torch.stack([x1, bf16(x1 * 1.02)])[None]
    with torch.no_grad(), autocast(torch.bfloat16):
        y = model(xc).float()
    return Case(model, (bf16(x), t), (xc, opposite_targets(y, torch.randn(W, generator=g) * 20)))


@pytest.mark.parametrize("squeeze", ["default", "chunked"])
@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_bfloat16_autocast_stack(door, how, squeeze, monkeypatch):
    """Under bfloat16 autocast the stacked operands are bfloat16: bounded (the Opacus door's
    batch-mean hooks loss is refused, its sum loss bounded)."""
    for (module, name), value in SQUEEZES[squeeze].items():
        monkeypatch.setattr(module, name, value)
    case = bf16_chain_case()
    assert_large(case)
    if (door, how) == ("opacus", "hooks"):
        assert_hooks_in_16_bit(case, torch.bfloat16, what=f"{door}-{how}")
        return
    assert_bounded(*run_pair(case, door, how, amp=torch.bfloat16), tol=LOWP_TOL,
                   what=f"{door}-{how}")


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_float64_stack(door, how):
    """A float64 chain (no fast Gram path: never stacked) with a 1e150-sized crafted sample."""
    case = chain_case()
    model = case.model.double()
    crafted = (case.crafted[0].double() * 1e150, case.crafted[1].double() * -1e150)
    honest = tuple(v.double() for v in case.honest)
    case = Case(model, honest, crafted, loss=lambda y, t: ((y - t) ** 2).flatten(1).sum(1))
    assert_bounded(*run_pair(case, door, how), what=f"{door}-{how}")


# -- 5. LayerNorms of one shape, instantiated together ---------------------------------------------
class Blocks(nn.Module):
    """Three ``LayerNorm(W) → Linear(W, W)`` blocks with residuals (a ViT block's norm layout):
    three LayerNorms and three Linears of one shape each."""

    def __init__(self):
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(W) for _ in range(3)])
        self.lins = nn.ModuleList([nn.Linear(W, W) for _ in range(3)])

    def forward(self, x):
        for norm, lin in zip(self.norms, self.lins):
            x = x + lin(norm(x))
        return x


#: the crafted sample's input: name -> f(honest x row) -> (1, 2, W)
LN_SAMPLES = {
    "overflowing-rows": lambda: torch.full((1, 2, W), 1e30) * torch.linspace(-1, 1, W),
    "one-row-huge": lambda: torch.cat([torch.randn(1, 1, W) * 1e19, torch.randn(1, 1, W)], 1),
    "subnormal": lambda: torch.full((1, 2, W), 1e-40) * torch.linspace(-1, 1, W),
    "constant-rows": lambda: torch.full((1, 2, W), 3.0),
    "inf": lambda: torch.full((1, 2, W), math.inf),
}


@pytest.mark.parametrize("sample", list(LN_SAMPLES))
@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_layer_norm_stack_with_hostile_rows(door, how, sample):
    """Rows whose LayerNorm statistics overflow, underflow or vanish, in every block; targets far
    from the outputs (|t| ~ 1e6)."""
    torch.manual_seed(0)
    model = Blocks()
    honest = honest_positions(model, W, W)
    x = LN_SAMPLES[sample]()
    case = Case(model, honest, (x, torch.full((1, 2, W), 1e6)))
    assert_bounded(*run_pair(case, door, how), may_refuse=False, what=f"{door}-{how}")


# -- 6. the clip factors repeated per position ---------------------------------------------------
def test_row_factors_follow_in_place_changes():
    """``C ⊗ 1_T`` is formed again after the factors (or the tensor they view) change in place,
    and for another factors tensor with equal values."""
    base = torch.tensor([1.0, 0.5, 0.25])
    f = base[:]
    assert row_factors(f, 2).tolist() == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    f.mul_(2)
    assert row_factors(f, 2).tolist() == [2.0, 2.0, 1.0, 1.0, 0.5, 0.5]
    base[0] = 0.0  # through the base: the view's version moves too
    assert row_factors(f, 2)[:2].tolist() == [0.0, 0.0]
    g = torch.tensor([7.0, 7.0, 7.0])
    assert row_factors(g, 2).tolist() == [7.0] * 6
    assert row_factors(f, 3).tolist() == [0.0] * 3 + [1.0] * 3 + [0.5] * 3


def narrow_first(seed: int = 0) -> nn.Module:
    """``Linear(8, W) → Linear(W, W)``: the first layer's bias sum runs through ``C ⊗ 1_T``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, W), nn.Linear(W, W))


@pytest.mark.parametrize("mode", MODES)
def test_two_engines_interleaved_share_no_factors(mode):
    """Two engines on two models in one process, steps interleaved (same T, one with the crafted
    sample, one without): each releases what it releases alone."""
    m1, m2 = narrow_first(0), narrow_first(1)
    x1, t1 = cancel_sample(m1, width=8)
    h1 = honest_positions(m1, 8, W)
    batch1 = (torch.cat([h1[0], x1]), torch.cat([h1[1], t1]))
    batch2 = honest_positions(m2, 8, W, n=B, seed=3)
    alone = [native_release(m, *b, mode) for m, b in ((m1, batch1), (m2, batch2))]
    runs = []
    for m in (m1, m2):
        m = copy.deepcopy(m)
        runs.append((m, *engine_for(m, mode)))
    losses = [mse(m(x), t) for (m, _, _), (x, t) in zip(runs, (batch1, batch2))]
    for (m, _, opt), loss in zip(runs, losses):
        opt.step(loss=loss)
    for (m, _, opt), want in zip(runs, alone):
        assert all(torch.equal(u, v) for u, v in zip(released(m, opt), want))


# -- 7. two passes: an activation changed behind autograd between the norm pass and the release --
class MutatedActivation(nn.Module):
    """``l2(a)`` with ``a = l1(x)·1``, and a hook on ``l2``'s output gradient that scales ``a`` by
    ``f`` through its ``.data`` alias (no version bump): the hook fires before ``l2``'s gradient in
    each backward, so the norm pass bounds ``f·a`` and a second pass would release ``f²·a``."""

    def __init__(self, f: float = 1e3):
        super().__init__()
        self.l1, self.l2, self.f = nn.Linear(W, W), nn.Linear(W, W), f

    def forward(self, x):
        a = self.l1(x) * 1.0
        y = self.l2(a)
        if y.requires_grad:
            y.register_hook(lambda g: self.scale(a))
        return y

    def scale(self, a: torch.Tensor) -> None:
        """``a ← f·a`` behind autograd's back."""
        a.data.mul_(self.f)


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_activation_changed_between_the_two_passes(door, how):
    """Two-pass modes released ``f²·a`` with factors computed for ``f·a`` (ratio ~894 in "mixed",
    "ghost" and "per_sample") when only the output gradients were compared between the passes;
    the activations are compared too, and a layer whose operands changed is released with its
    factors lowered to its recomputed bound."""
    torch.manual_seed(0)
    model = MutatedActivation()
    case = Case(model, honest_positions(model, W, W), cancel_sample(model))
    assert_bounded(*run_pair(case, door, how), what=f"{door}-{how}")


class AlternatingActivation(nn.Module):
    """``l2(a)`` with hooks that scale ``a`` through ``.data`` by ``f = 2¹⁰`` just before ``l2``'s
    output gradient arrives (a hook on ``l2(a)·1``) and by ``1/f`` just after (a hook on
    ``l1``'s output), exactly: ``l2``'s bound is deferred when ``a`` is ``f·a₀``, formed at the end
    of the norm pass from ``a₀``, and the second pass writes ``f·a₀`` again."""

    def __init__(self, f: float = 1024.0):
        super().__init__()
        self.l1, self.l2, self.f = nn.Linear(W, W), nn.Linear(W, W), f

    def forward(self, x):
        h = self.l1(x)
        a = h * 1.0
        out = self.l2(a) * 1.0
        if out.requires_grad:
            out.register_hook(lambda g: self.scale(a, self.f))
            h.register_hook(lambda g: self.scale(a, 1 / self.f))
        return out

    @staticmethod
    def scale(a: torch.Tensor, f: float) -> None:
        """``a ← f·a`` behind autograd's back."""
        a.data.mul_(f)


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_activation_restored_between_deferral_and_bound(door, how):
    """A deferred layer's operands were fingerprinted when handed to the stack but bounded at the
    end of the pass: an activation changed in between and changed back for the second pass was
    released with factors for the other value (ratio ~638 in "mixed" and "ghost"). They are
    fingerprinted as the bound sees them."""
    torch.manual_seed(0)
    model = AlternatingActivation()
    case = Case(model, honest_positions(model, W, W), cancel_sample(model))
    assert_bounded(*run_pair(case, door, how), what=f"{door}-{how}")


class MutatedAfterNormed(nn.Module):
    """``l2`` on one position (never deferred: its bound is formed when its gradient arrives),
    and a hook on ``l1``'s output — fired after ``l2`` was normed — scaling ``l2``'s activation by
    ``f`` through ``.data``: book-keeping forms the clipped sum from ``f·a`` at the end of the
    pass."""

    def __init__(self, f: float = 1e3):
        super().__init__()
        self.l1, self.l2, self.f = nn.Linear(W, W), nn.Linear(W, W), f

    def forward(self, x):
        h = self.l1(x)
        a = h * 1.0
        if h.requires_grad:
            h.register_hook(lambda g: self.scale(a))
        return self.l2(a)

    def scale(self, a: torch.Tensor) -> None:
        """``a ← f·a`` behind autograd's back."""
        a.data.mul_(self.f)


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_activation_changed_after_its_layer_was_normed(door, how):
    """Book-keeping summed ``f·a`` with factors for ``a`` (ratio ~1000 in "bk", "bk_mixed",
    "bk_mixopt" and both Opacus flows); a layer normed at once whose kept operands changed by the
    end of the pass now adds its recomputed bound to the per-sample norm."""
    torch.manual_seed(0)
    model = MutatedAfterNormed()
    x = torch.randn(B, W, generator=torch.Generator().manual_seed(2)) * 0.1
    with torch.no_grad():
        t = model.l2(model.l1(x)) + 0.02
    case = Case(model, (x[:3], t[:3]), (x[3:] * 100, t[3:] - 1e3))
    assert_large(case)
    assert_bounded(*run_pair(case, door, how), what=f"{door}-{how}")


# -- 8. factors and bounds across the physical batches of one logical batch ----------------------
def accumulated_release(model: nn.Module, parts, mode: str):
    """One logical batch of B in physical batches ``parts`` (``virtual_step`` for all but the
    last, then ``step``) on a fresh copy of ``model``: what it released."""
    model = copy.deepcopy(model)
    _, opt = engine_for(model, mode)
    for n, (x, t) in enumerate(parts):
        loss = mse(model(x), t)
        (opt.step if n == len(parts) - 1 else opt.virtual_step)(loss=loss)
    assert opt.steps == 1
    return released(model, opt)


@pytest.mark.parametrize("model_of", ["chain", "narrow-first"])
@pytest.mark.parametrize("mode", MODES)
def test_crafted_sample_in_an_accumulated_logical_batch(mode, model_of):
    """Physical batches of 2 and 2 (with the crafted sample) or 2 and 1 (without): the stack and
    the per-position factors of one physical batch never reach the other."""
    model = chain() if model_of == "chain" else narrow_first()
    d = W if model_of == "chain" else 8
    x, t = honest_positions(model, d, W)
    xc, tc = cancel_sample(model, width=d)
    assert_large(Case(model, (x, t), (xc, tc)))
    first = (x[:2], t[:2])
    with_run = accumulated_release(model, [first, (torch.cat([x[2:], xc]),
                                                   torch.cat([t[2:], tc]))], mode)
    without_run = accumulated_release(model, [first, (x[2:], t[2:])], mode)
    assert_bounded(with_run, without_run, what=mode)


#: the crafted sample's input and target in the chain: name -> (x, t), each (1, 2, W)
MAGNITUDES = {
    "huge": (torch.full((1, 2, W), 1e30), torch.full((1, 2, W), -1e30)),
    "huge-one-position": (torch.cat([torch.full((1, 1, W), 1e18), torch.zeros(1, 1, W)], 1),
                          torch.zeros(1, 2, W)),
    "tiny-input-huge-target": (torch.full((1, 2, W), 1e-30), torch.full((1, 2, W), 1e30)),
    "subnormal": (torch.full((1, 2, W), 1e-40), torch.full((1, 2, W), 1e-40)),
    "inf": (torch.full((1, 2, W), math.inf), torch.zeros(1, 2, W)),
    "nan-target": (torch.zeros(1, 2, W), torch.full((1, 2, W), math.nan)),
}


@pytest.mark.parametrize("magnitude", list(MAGNITUDES))
@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_extreme_magnitudes_in_a_stack(door, how, magnitude):
    """Overflowing, underflowing and non-finite samples in the chain of identical Linears."""
    model = chain()
    case = Case(model, honest_positions(model, W, W), MAGNITUDES[magnitude])
    assert_bounded(*run_pair(case, door, how), what=f"{door}-{how}")


class ShiftedAfterNormed(MutatedAfterNormed):
    """As :class:`MutatedAfterNormed`, but the write adds ``d·(e₀ − e₁)`` to every row of ``a``:
    each row's sum, the fingerprint, is unchanged."""

    def scale(self, a: torch.Tensor) -> None:
        """``a[..., 0] += d``, ``a[..., 1] −= d`` behind autograd's back."""
        a.data[..., 0] += self.f
        a.data[..., 1] -= self.f


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_activation_shift_that_keeps_row_sums(door, how):
    """A ``.data`` write after the layer was normed that keeps every row's sum changes the rows'
    bit-pattern sums: it is seen, and the release stays within what the norms certify."""
    torch.manual_seed(0)
    model = ShiftedAfterNormed()
    x = torch.randn(B, W, generator=torch.Generator().manual_seed(2)) * 0.1
    with torch.no_grad():
        t = model.l2(model.l1(x)) + 0.02
    case = Case(model, (x[:3], t[:3]), (x[3:] * 100, t[3:] - 1e3))
    assert_bounded(*run_pair(case, door, how), what=f"{door}-{how}")
