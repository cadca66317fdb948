"""The Opacus door on parameters outside a ruled layer (the parameter-entry tracer and the
torch.func fallback), adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy 2021,
"Differentially Private Learning with Adaptive Clipping") and Opacus' misuse checks.

Clipped sums are checked against the float64 one-sample-at-a-time reference
(``tests/reference.py``) in every mode the door supports; adaptive clipping against Opacus'
``AdaClipDPOptimizer`` run with the same noise generator."""
from __future__ import annotations

import math

import opacus
import pytest
import torch
import torch.nn.functional as F
from compat_cases import mlp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from engine_checks import pick_threshold, ref_abadi
from private_engine import opacus_compat
from private_engine.layers import register_fallback
from reference import assert_close_rel, reference_clipped_sum

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-9


@register_fallback
class RawLinear(nn.Module):
    """``tanh(F.linear(x, w))`` on a raw parameter: clipped by the torch.func fallback."""

    def __init__(self, d: int, o: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(o, d) / d ** 0.5)

    def forward(self, x):
        return torch.tanh(F.linear(x, self.w))


class TracedModel(nn.Module):
    """A class token (cat), a LayerScale-like gamma (mul) and a raw bias (add) for the tracer, a
    fallback module, and ruled Linears."""

    def __init__(self, d=5, classes=3):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.fc1 = nn.Linear(d, d)
        self.gamma = nn.Parameter(torch.randn(d))
        self.shift = nn.Parameter(torch.randn(d))
        self.raw = RawLinear(d, d)
        self.fc2 = nn.Linear(d, classes)

    def forward(self, x):
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1)
        h = self.fc1(h) * self.gamma + self.shift
        h = self.raw(h)
        return self.fc2(h[:, 0] + h.mean(1))


def per_sample_loss(model, x, y):
    return F.cross_entropy(model(x), y, reduction="sum").reshape(1)


def data(n=8, scale_first=None):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 3, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    if scale_first is not None:
        x[0] *= scale_first
    return x, y


def private_step(model, x, y, *, mode="hooks", reduction="mean", R=1.0, clipping="flat",
                 wrap_model=True, loader_data=None):
    """One private SGD step (lr 1, noise 0) on the batch ``(x, y)`` through make_private (its
    data loader over ``loader_data``, by default ``(x, y)`` in one batch: the expected batch
    size); returns the update θ' − θ and the returned module."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    criterion = nn.CrossEntropyLoss(reduction=reduction)
    loader_data = loader_data or (x, y)
    loader = DataLoader(TensorDataset(*loader_data), batch_size=len(loader_data[1]))
    out = opacus_compat.PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=0.0, max_grad_norm=R,
        loss_reduction=reduction, poisson_sampling=False, grad_sample_mode=mode,
        criterion=criterion, clipping=clipping, wrap_model=wrap_model)
    if len(out) == 4:
        module, optimizer, criterion, _ = out
    else:
        module, optimizer, _ = out
    run = module if wrap_model else model
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    criterion(run(x), y).backward()
    optimizer.step()
    return [p.detach() - b for p, b in zip(model.parameters(), before)], module


def reference_per_layer(model, x, y, thresholds):
    """Float64 reference of per-layer clipping: ``Σ_i C_{i,k} g_i^k`` with
    ``C_{i,k} = min(1, R_k / (‖g_i^k‖ + 1e-6))``, one sample at a time."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(y)):
        grads = torch.autograd.grad(per_sample_loss(model, x[i:i + 1], y[i:i + 1]).sum(), params)
        for t, g, r in zip(total, grads, thresholds):
            t.add_(min(1.0, r / (g.norm().item() + 1e-6)) * g)
    return total


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_traced_and_fallback_parameters_match_the_reference(mode, reduction):
    torch.manual_seed(0)
    model = TracedModel().double()
    x, y = data()
    _, norms = reference_clipped_sum(model, [x, y], per_sample_loss, 1.0, ref_abadi)
    R = pick_threshold(norms)
    expected, ref_norms = reference_clipped_sum(model, [x, y], per_sample_loss, R, ref_abadi)
    with pytest.warns(UserWarning, match="raw"):  # the fallback module is named
        delta, module = private_step(model, x, y, mode=mode, reduction=reduction, R=R)
    B = len(y) if reduction == "mean" else 1
    names = [n for n, _ in model.named_parameters()]
    assert_close_rel([-d * B for d in delta], expected, RTOL, names)
    assert_close_rel([module.last_norms], [ref_norms], RTOL, ["per-sample norms"])
    assert ((norms > R).sum() > 0) and ((norms < R).sum() > 0)  # some clipped, some not


def test_traced_and_fallback_wrap_model_false_and_per_layer():
    torch.manual_seed(0)
    model = TracedModel().double()
    x, y = data()
    _, norms = reference_clipped_sum(model, [x, y], per_sample_loss, 1.0, ref_abadi)
    R = pick_threshold(norms)
    expected, _ = reference_clipped_sum(model, [x, y], per_sample_loss, R, ref_abadi)
    delta, hooks = private_step(model, x, y, R=R, wrap_model=False)
    assert_close_rel([-d * len(y) for d in delta], expected, RTOL)
    hooks.cleanup()
    # per-layer: one threshold per parameter tensor, traced and fallback ones included
    torch.manual_seed(0)
    model = TracedModel().double()
    thresholds = [0.3 + 0.1 * k for k in range(len(list(model.parameters())))]
    expected = reference_per_layer(model, x, y, thresholds)
    delta, _ = private_step(model, x, y, R=thresholds, clipping="per_layer")
    assert_close_rel([-d * len(y) for d in delta], expected, RTOL)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_crafted_huge_sample_moves_the_update_by_at_most_R(mode, clipping):
    """Neighbouring batches (with and without a sample scaled by 1e6), noise 0, SGD lr 1: the
    updates differ by at most R / B (B the expected batch size); the huge sample's gradient
    reaches the traced and fallback parameters too."""
    if clipping == "per_layer" and mode == "ghost":
        pytest.skip("per-layer clipping runs with grad_sample_mode='hooks' (as in Opacus)")
    x, y = data(scale_first=1e6)
    R_flat = 0.5
    n_params = len(list(TracedModel().parameters()))
    R = R_flat if clipping == "flat" else [R_flat / math.sqrt(n_params)] * n_params
    deltas = []
    for xs, ys in ((x, y), (x[1:], y[1:])):
        torch.manual_seed(0)
        deltas.append(private_step(TracedModel().double(), xs, ys, mode=mode, R=R,
                                   clipping=clipping, loader_data=(x, y))[0])
    diff = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(*deltas))).item()
    assert len(y) * diff / R_flat <= 1.0 + 1e-9
    assert len(y) * diff / R_flat > 0.5  # the huge sample is clipped, not dropped


def test_parameter_the_tracer_cannot_clip_is_refused_at_the_first_forward_by_name():
    class Matmul(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 5)
            self.w = nn.Parameter(torch.randn(5, 3))

        def forward(self, x):
            return torch.einsum("bi,ij->bj", self.fc(x).mean(1), self.w)

    x, y = data()
    with pytest.raises(ValueError, match=r"\['w'\](.|\n)*register_fallback"):
        private_step(Matmul().double(), x, y)


# -- misuse: the point where Opacus refuses ----------------------------------------------------
def test_missing_zero_grad_is_refused_at_step_with_valueerror():
    torch.manual_seed(0)
    model = mlp().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    module, optimizer, _ = opacus_compat.PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0,
        max_grad_norm=1.0, poisson_sampling=False)
    F.cross_entropy(module(x), y).backward()
    optimizer.step()
    F.cross_entropy(module(x), y).backward()  # Opacus accepts the backward ...
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="zero_grad"):  # ... and refuses the step
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    optimizer.zero_grad()
    F.cross_entropy(module(x), y).backward()
    optimizer.step()
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(AttributeError, match="never materialised"):
        optimizer.grad_samples


# -- adaptive clipping -------------------------------------------------------------------------
ADA = dict(target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0,
           min_clipbound=0.01)


def adaptive_run(engine_cls, *, noise, std, mode="hooks", steps=3, n=24, batch_size=8, R=0.1,
                 poisson=False, ada=None):
    """Opacus' loop with clipping="adaptive"; ``(parameters, [R per step], ε, module)``."""
    torch.manual_seed(0)
    model = mlp().double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    engine = engine_cls(accountant="rdp")
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch_size),
        noise_multiplier=noise, max_grad_norm=R, poisson_sampling=poisson, clipping="adaptive",
        grad_sample_mode=mode, noise_generator=torch.Generator().manual_seed(7),
        unclipped_num_std=std, **(ada or ADA))
    module, optimizer, loader = out[0], out[1], out[-1]
    criterion = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    bounds, seen = [], []
    torch.manual_seed(3)
    for _, (xb, yb) in zip(range(steps), loader):
        optimizer.zero_grad()
        criterion(module(xb), yb).backward()
        seen.append((len(yb), module.last_norms if hasattr(module, "last_norms") else None))
        bounds.append(float(optimizer.max_grad_norm))
        optimizer.step()
    bounds.append(float(optimizer.max_grad_norm))
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    eps = engine.get_epsilon(1e-5) if noise > 0 else 0.0
    return flat, bounds, eps, optimizer, seen


@pytest.mark.parametrize("noise, std", [(1.0, 2.0), (0.0, 0.5)])
def test_adaptive_clipping_gives_opacus_results(noise, std):
    from opacus.optimizers import AdaClipDPOptimizer

    a, bounds_a, eps_a, _, _ = adaptive_run(opacus.PrivacyEngine, noise=noise, std=std)
    b, bounds_b, eps_b, opt, _ = adaptive_run(opacus_compat.PrivacyEngine, noise=noise, std=std)
    assert isinstance(opt, AdaClipDPOptimizer)
    assert (a - b).abs().max().item() < 1e-6
    assert bounds_a[0] == bounds_b[0] and len(set(bounds_b)) == len(bounds_b)  # R moved
    assert_close_rel([torch.tensor(bounds_b)], [torch.tensor(bounds_a)], 1e-6)
    assert eps_a == eps_b  # accounted with the noise multiplier given, as in Opacus
    ghost, bounds_g, _, _, _ = adaptive_run(opacus_compat.PrivacyEngine, noise=noise, std=std,
                                            mode="ghost")
    assert (ghost - b).abs().max().item() < 1e-9 and bounds_g == pytest.approx(bounds_b, 1e-12)


def test_adaptive_clip_bound_update_rule():
    """``R ← clamp(R·exp(−η (b̃ − γ)))`` with ``b̃ = (Σ_i b_i − n/2)/m + 1/2``, m the expected
    batch size: batches of 10, 10, 4 samples with m = 8 (count noise 1e-12, gradient noise 0)."""
    _, bounds, _, opt, seen = adaptive_run(opacus_compat.PrivacyEngine, noise=0.0, std=1e-12,
                                           batch_size=10, R=0.3)
    m = opt.expected_batch_size
    assert m == 8
    for k, (n, norms) in enumerate(seen):
        assert len(norms) == n
        b = ((norms + 1e-6) <= bounds[k]).sum().item()
        frac = (b - n / 2) / m + 0.5
        expected = bounds[k] * math.exp(-ADA["clipbound_learning_rate"]
                                        * (frac - ADA["target_unclipped_quantile"]))
        assert bounds[k + 1] == pytest.approx(min(max(expected, ADA["min_clipbound"]),
                                                  ADA["max_clipbound"]), rel=1e-9)
    # the bound stays within [min_clipbound, max_clipbound]
    _, bounds, _, _, _ = adaptive_run(opacus_compat.PrivacyEngine, noise=0.0, std=1e-12,
                                      ada=dict(ADA, clipbound_learning_rate=50.0))
    assert all(ADA["min_clipbound"] <= r <= ADA["max_clipbound"] for r in bounds[1:])
    assert ADA["min_clipbound"] in bounds or ADA["max_clipbound"] in bounds
    # a learning rate whose exp overflows a float: clamped as Opacus' torch.exp (inf) is
    _, bounds, _, _, _ = adaptive_run(opacus_compat.PrivacyEngine, noise=0.0, std=1e-12,
                                      ada=dict(ADA, clipbound_learning_rate=1e4,
                                               target_unclipped_quantile=0.9))
    assert all(ADA["min_clipbound"] <= r <= ADA["max_clipbound"] for r in bounds[1:])
    assert ADA["max_clipbound"] in bounds


def test_adaptive_clipping_refusals_follow_opacus():
    with pytest.raises(ValueError, match="2 \\* unclipped_num_std"):
        adaptive_run(opacus_compat.PrivacyEngine, noise=1.0, std=0.4)
    with pytest.raises(ValueError, match="max_clipbound"):
        adaptive_run(opacus_compat.PrivacyEngine, noise=1.0, std=2.0,
                     ada=dict(ADA, max_clipbound=0.001))
