"""Refusals that name their real cause and the fix: reparametrized weights (weight_norm,
torch.nn.utils.parametrize), data-dependent initialisation (ActNorm), parameters handed to a
custom torch.autograd.Function, and activation checkpointing."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import private_engine as pe
from private_engine import PrivacyEngine
from private_engine.guards.state import StateChangedError


def _step(model, x=None):
    x = torch.randn(8, 4) if x is None else x
    y = torch.randint(0, 2, (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, batch_size=8, sample_size=64, epochs=1, max_grad_norm=1.0,
                               noise_multiplier=1.0)
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer.step(loss=F.cross_entropy(model(x), y, reduction="none"))


def _refusal(model, error=ValueError):
    with pytest.raises(error) as info:
        _step(model)
    return str(info.value)


class Symmetric(nn.Module):
    def forward(self, X):
        return (X + X.T) / 2


@pytest.mark.parametrize("make, names, fix", [
    (lambda: nn.utils.parametrize.register_parametrization(nn.Linear(4, 4), "weight",
                                                           Symmetric()),
     "0.parametrizations.weight.original", "register_fallback(type(module))"),
])
def test_reparametrized_linear_with_bias_names_the_parametrization(make, names, fix):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated
        model = nn.Sequential(make(), nn.ReLU(), nn.Linear(4, 2))
    message = _refusal(model)
    assert names in message and "reparametrize the weight of module '0'" in message, message
    assert fix in message, message
    assert "the bias is a trainable parameter" not in message


def test_the_fallback_the_parametrize_refusal_names_trains():
    layer = nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))
    pe.layers.register_fallback(type(layer))
    try:
        _step(nn.Sequential(layer, nn.ReLU(), nn.Linear(4, 2)))
    finally:
        pe.layers.unregister(type(layer))


class ActNorm(nn.Module):
    """Kingma & Dhariwal's ActNorm: per-feature shift and scale set from the first batch."""

    def __init__(self, d):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(d))
        self.scale = nn.Parameter(torch.ones(d))
        self.initialized = False

    def forward(self, x):
        if not self.initialized:
            with torch.no_grad():
                self.loc.data.copy_(-x.mean(0))
                self.scale.data.copy_(1 / (x.std(0) + 1e-6))
            self.initialized = True
        return (x + self.loc) * self.scale


def test_data_dependent_initialisation_is_named_with_its_fix():
    model = nn.Sequential(nn.Linear(4, 4), ActNorm(4), nn.Linear(4, 2))
    message = _refusal(model, StateChangedError)
    assert "1.loc" in message and "data-dependent initialisation" in message, message
    assert "before building the engine, on public data" in message
    # the fix: the first forward on public data, then private training
    model = nn.Sequential(nn.Linear(4, 4), ActNorm(4), nn.Linear(4, 2))
    with torch.no_grad():
        model(torch.randn(16, 4))
    _step(model)


class Scale(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, g * x


class ScaleModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return Scale.apply(x, self.w)


def test_a_parameter_in_a_custom_autograd_function_is_named_with_the_function():
    model = nn.Sequential(nn.Linear(4, 4), ScaleModule(), nn.Linear(4, 2))
    message = _refusal(model)
    assert "custom torch.autograd.Function" in message and "'1.w' into Scale.apply" in message
    assert "register_fallback" in message
    assert "tied weight" not in message and "before the engine was built" not in message
    pe.layers.register_fallback(ScaleModule)   # the fix it names
    try:
        _step(nn.Sequential(nn.Linear(4, 4), ScaleModule(), nn.Linear(4, 2)))
    finally:
        pe.layers.unregister(ScaleModule)


class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.gamma = nn.Parameter(torch.ones(4))   # a LayerScale: clipped by the tracer
        self.reentrant = reentrant

    def block(self, h):
        return torch.relu(self.a(h)) * self.gamma

    def forward(self, x):
        return self.b(checkpoint(self.block, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant, cause", [
    (False, "recomputes the forward of a block that uses a parameter clipped by the "
            "parameter-entry tracer"),
    (True, "pass use_reentrant=False"),
])
def test_activation_checkpointing_is_refused_naming_the_cause(reentrant, cause):
    message = _refusal(Checkpointed(reentrant))
    assert cause in message and "set_grad_checkpointing(False)" in message, message


class RuledBlock(nn.Module):
    def __init__(self, checkpointed):
        super().__init__()
        self.a, self.n, self.c, self.h = (nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 8),
                                          nn.Linear(8, 3))
        self.checkpointed = checkpointed

    def block(self, x):
        return self.c(torch.relu(self.n(self.a(x))))

    def forward(self, x):
        h = (checkpoint(self.block, x, use_reentrant=False) if self.checkpointed
             else self.block(x))
        return self.h(h)


@pytest.mark.parametrize("mode", ["bk_mixed", "ghost"])
def test_the_checkpointing_the_refusal_allows_gives_the_same_update(mode):
    """The fix named above: checkpointing a block of ruled layers (use_reentrant=False) releases
    the same clipped update as without it (noise 0, SGD lr 1)."""
    torch.manual_seed(0)
    plain = RuledBlock(False)
    x, y = torch.randn(16, 6) * 3, torch.randint(0, 3, (16,))
    updated = []
    for checkpointed in (False, True):
        model = RuledBlock(checkpointed)
        model.load_state_dict(plain.state_dict())
        engine = PrivacyEngine(model, batch_size=16, sample_size=64, epochs=1, max_grad_norm=0.5,
                               noise_multiplier=0.0, clipping_mode=mode)
        optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
        optimizer.step(loss=F.cross_entropy(model(x), y, reduction="none"))
        updated.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(updated[0], updated[1], rtol=0, atol=1e-6)


def test_the_opacus_door_names_the_custom_function_too():
    from private_engine.opacus_compat import PrivacyEngine as OpacusDoor

    model = nn.Sequential(nn.Linear(4, 4), ScaleModule(), nn.Linear(4, 2))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))),
        batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, data = OpacusDoor().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=data, noise_multiplier=1.0, max_grad_norm=1.0)
    x, y = next(iter(data))
    with pytest.raises(ValueError, match=r"custom torch.autograd.Function \('1.w' into Scale"):
        F.cross_entropy(model(x), y).backward()
