"""The privacy budget you can trust: the guard on ε, the sampling-rate check, calibration inputs
that cannot hang, and state changes that either work exactly or are refused before anything is
modified."""
import copy
import math
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from private_engine.accounting import (
    BudgetExceededError,
    PrivacyBudget,
    SamplingRateCheck,
    SamplingRateError,
    epsilon_for,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def poisson_sizes(n, q, count, seed=0):
    """Logical batch sizes of Poisson sampling at rate q from n examples (what the accountant
    assumes; batches of a fixed size are refused after a few steps)."""
    return [int(s) for s in np.random.default_rng(seed).binomial(n, q, size=count)]


def loss_of(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def state(model, engine, opt):
    """Everything a refused step must leave untouched."""
    return {"params": [p.detach().clone() for p in model.parameters()],
            "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            "history": list(engine.accountant.history),
            "samples": engine.sampling_check.samples,
            "accumulated": [None if s.grad_sums is None else [g.clone() for g in s.grad_sums.grads]
                            for s in engine._attached],
            "opt": copy.deepcopy(opt.state_dict())}


def assert_same_state(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert [g is None for g in a["grads"]] == [g is None for g in b["grads"]]
    assert all(x is None or torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
    assert a["history"] == b["history"] and a["samples"] == b["samples"]
    for x, y in zip(a["accumulated"], b["accumulated"]):
        assert (x is None) == (y is None)
        assert x is None or all(torch.equal(u, v) for u, v in zip(x, y))
    assert str(a["opt"]) == str(b["opt"])


# -- the budget guard ---------------------------------------------------------------------------
def test_step_beyond_the_target_epsilon_is_refused_with_nothing_changed():
    model = mlp()
    engine = pe.PrivacyEngine(model, batch_size=8, sample_size=80, max_grad_norm=1.0,
                              target_epsilon=1.0, epochs=1)
    opt = engine.attach(torch.optim.Adam(model.parameters(), lr=0.1))
    assert engine.steps == 10
    limit = engine.budget.max_steps()
    assert limit >= 10
    assert epsilon_for(engine.noise_multiplier, 0.1, limit, engine.target_delta) <= 1.0
    assert epsilon_for(engine.noise_multiplier, 0.1, limit + 1, engine.target_delta) > 1.0
    for k, size in enumerate(poisson_sizes(80, 0.1, limit)):
        opt.step(loss=loss_of(model, *batch(size, k)))
    assert engine.get_epsilon() <= 1.0
    opt.virtual_step(loss=loss_of(model, *batch(4, 100)))  # an accumulation in progress
    before = state(model, engine, opt)
    with pytest.raises(BudgetExceededError, match=r"budget ε=1 .*Nothing was updated"):
        opt.step(loss=loss_of(model, *batch(4, 101)))
    assert_same_state(before, state(model, engine, opt))
    report = engine.privacy_report()
    assert report.steps == limit and report.epsilon_budget == 1.0
    assert report.steps_remaining == 0 and 0 <= report.epsilon_remaining < 0.05
    assert "budget ε=1" in str(report)


def test_allow_overrun_spends_beyond_the_budget_knowingly():
    model = mlp()
    engine = pe.PrivacyEngine(model, batch_size=8, sample_size=80, max_grad_norm=1.0,
                              target_epsilon=1.0, epochs=0.5, allow_overrun=True)
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    for k, size in enumerate(poisson_sizes(80, 0.1, 3 * engine.budget.max_steps())):
        opt.step(loss=loss_of(model, *batch(size, k)))
    report = engine.privacy_report()
    assert report.epsilon > 1.0 and report.epsilon_remaining < 0 and report.steps_remaining < 0


def test_budget_of_a_declared_length_without_target():
    """σ given with epochs: the budget is ε of that length; without a length there is none."""
    model = mlp()
    engine = pe.PrivacyEngine(model, batch_size=8, sample_size=80, max_grad_norm=1.0,
                              noise_multiplier=2.0, steps=5)
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    budget = epsilon_for(2.0, 0.1, 5, engine.target_delta)
    assert engine.privacy_report().epsilon_budget == pytest.approx(budget, rel=1e-12)
    for k in range(5):
        opt.step(loss=loss_of(model, *batch(8, k)))
    with pytest.raises(BudgetExceededError):
        opt.step(loss=loss_of(model, *batch(8, 9)))
    free = pe.PrivacyEngine(mlp(), batch_size=8, sample_size=80, max_grad_norm=1.0,
                            noise_multiplier=2.0)
    report = free.privacy_report()
    assert report.epsilon_budget is None and report.steps_remaining is None
    assert "no budget" in str(report)


def test_budget_search_matches_the_accountant():
    budget = PrivacyBudget(noise_multiplier=0.9, sample_rate=0.02, delta=1e-5, accountant="rdp",
                           target_epsilon=2.0)
    k = budget.max_steps()
    assert budget.epsilon(k) <= 2.0 < budget.epsilon(k + 1)
    budget.check_step(k - 1)
    with pytest.raises(BudgetExceededError):
        budget.check_step(k)


# -- calibration inputs -----------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(epochs=0.01), "fewer than one"),
    (dict(epochs=math.inf), "epochs must be finite"),
    (dict(epochs=math.nan), "give epochs"),
    (dict(steps=2.5), "positive integer"),
    (dict(steps=0), "positive integer"),
])
def test_training_length_that_cannot_be_calibrated_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pe.PrivacyEngine(mlp(), batch_size=8, sample_size=80, max_grad_norm=1.0,
                         target_epsilon=1.0, **kwargs)


# -- the sampling-rate check --------------------------------------------------------------------
def test_batches_larger_than_declared_are_refused_before_the_release():
    """Declaring 8 and stepping 256 would report ε for the wrong q (0.61 where 2.79 is spent)."""
    model = mlp()
    engine = pe.PrivacyEngine(model, batch_size=8, sample_size=800, max_grad_norm=1.0,
                              noise_multiplier=1.0)
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    for k in range(3):  # a logical batch of 256 in physical batches of 64
        opt.virtual_step(loss=loss_of(model, *batch(64, k)))
    before = state(model, engine, opt)
    with pytest.raises(SamplingRateError, match=r"256\.0 per batch.*batch_size=8"):
        opt.step(loss=loss_of(model, *batch(64, 3)))
    assert_same_state(before, state(model, engine, opt))


def test_poisson_batch_sizes_never_raise_a_false_alarm():
    rng = np.random.default_rng(0)
    for n, B in [(50_000, 256), (1_000, 10), (100, 1), (64, 60)]:
        check = SamplingRateCheck(B, n)
        for size in rng.binomial(n, B / n, size=20_000):
            check.check(int(size))
            check.commit(int(size))
    check = SamplingRateCheck(10, 1_000)  # a mean off by 20 % shows within a few hundred steps
    with pytest.raises(SamplingRateError):
        for size in rng.binomial(1_000, 0.012, size=2_000):
            check.check(int(size))
            check.commit(int(size))


# -- state changes --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fn", ["inverse", "nan"])
def test_custom_clipping_fn_with_non_finite_factors_is_refused(dtype, fn):
    """``R / norm`` for a sample whose gradient is zero: its certified norm carries the
    certificate's rounding and underflow slack (never exactly 0, in float32 or float64), so the
    factor is finite and multiplies zero rows (released exactly). A NaN factor is refused."""
    clip = (lambda norms, R: R / norms) if fn == "inverse" else \
        (lambda norms, R: torch.full_like(norms, math.nan))
    model = mlp().to(dtype)
    engine = pe.PrivacyEngine(model, batch_size=4, sample_size=40, max_grad_norm=1.0,
                              noise_multiplier=0.0, clipping_fn=clip)
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batch(4)
    before = state(model, engine, opt)
    losses = loss_of(model, x.to(dtype), y)
    losses = torch.cat([losses[:3], 0.0 * losses[3:]])  # sample 3: zero gradient
    if fn == "inverse":
        opt.step(loss=losses)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        # the underflow slack of the certificate: ~n·2⁻¹²⁶ summed over the float32 operands
        assert 0 < engine.last_norms[3] < 1e-15
        return
    with pytest.raises(ValueError, match="custom clipping_fn"):
        opt.step(loss=losses)
    assert_same_state(before, state(model, engine, opt))


@pytest.mark.parametrize("mode", ["bk_mixed", "mixed"])
def test_parameter_frozen_after_the_engine_is_built_is_left_alone(mode):
    """Exactly the update of an engine built with the parameter frozen (noise 0)."""
    x, y = batch(6)
    updates = []
    for freeze_before in (True, False):
        model = mlp()
        if freeze_before:
            model[0].weight.requires_grad_(False)
        engine = pe.PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=0.5,
                                  noise_multiplier=0.0, clipping_mode=mode)
        opt = engine.attach(torch.optim.SGD([p for p in model.parameters()], lr=1.0))
        model[0].weight.requires_grad_(False)
        before = [p.detach().clone() for p in model.parameters()]
        opt.step(loss=loss_of(model, x, y))
        updates.append([p.detach() - b for p, b in zip(model.parameters(), before)])
        assert model[0].weight.grad is None
    assert torch.equal(updates[1][0], torch.zeros_like(updates[1][0]))
    for a, b in zip(*updates):
        assert torch.allclose(a, b, rtol=0, atol=1e-7)


def test_parameter_unfrozen_or_added_after_the_engine_is_built_is_refused_by_name():
    model = mlp()
    model[0].bias.requires_grad_(False)
    engine = pe.PrivacyEngine(model, batch_size=4, sample_size=40, max_grad_norm=1.0,
                              noise_multiplier=1.0)
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    model[0].bias.requires_grad_(True)
    before = state(model, engine, opt)
    with pytest.raises(ValueError, match=r"\['0\.bias'\].*Nothing was updated"):
        opt.step(loss=loss_of(model, *batch(4)))
    assert_same_state(before, state(model, engine, opt))
    model[0].bias.requires_grad_(False)
    model.append(nn.Linear(3, 3))
    opt.add_param_group({"params": model[3].parameters()})
    with pytest.raises(ValueError, match=r"\['3\.weight', '3\.bias'\]"):
        opt.step(loss=loss_of(model, *batch(4)))


class MHAModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(self.attn(x, x, x)[0].mean(1))


def _vit():
    timm = pytest.importorskip("timm")
    return timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, num_classes=3,
                             depth=1, embed_dim=16, num_heads=2)


@pytest.mark.parametrize("build, shape", [(MHAModel, (5, 4)), (_vit, (3, 16, 16))])
def test_empty_poisson_batch_is_a_noise_only_step(build, shape):
    """Traced parameters (a ViT's cls_token) and torch.func fallback modules (MHA) included."""
    torch.manual_seed(0)
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = pe.PrivacyEngine(model, batch_size=4, sample_size=40, max_grad_norm=1.0,
                                  noise_multiplier=1.0)
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    out = model(torch.randn(0, *shape))
    opt.step(loss=F.cross_entropy(out, torch.zeros(0, dtype=torch.long), reduction="none"))
    assert engine.steps_taken == 1
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))  # noise
    out = model(torch.randn(3, *shape))  # and a real batch after it
    opt.step(loss=F.cross_entropy(out, torch.zeros(3, dtype=torch.long), reduction="none"))
    assert engine.steps_taken == 2


def test_bfloat16_autocast_forward_with_a_fallback_module_steps_outside_the_region():
    torch.manual_seed(0)
    model = MHAModel()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = pe.PrivacyEngine(model, batch_size=4, sample_size=40, max_grad_norm=1.0,
                                  noise_multiplier=0.0)
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(4, 5, 4))
    opt.step(loss=F.cross_entropy(out.float(), torch.zeros(4, dtype=torch.long),
                                  reduction="none"))
    assert engine.steps_taken == 1 and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, pickle.dumps])
def test_copies_and_pickles_of_an_engine_are_refused(how):
    engine = pe.PrivacyEngine(mlp(), batch_size=4, sample_size=40, max_grad_norm=1.0,
                              noise_multiplier=1.0)
    with pytest.raises(TypeError, match="cannot be copied or pickled.*state_dict"):
        how(engine)
