"""One assembly of the clipping core for both doors (:mod:`private_engine.clipping.assembly`):
the native engine and the Opacus door hold the same pieces (capture, clipper, guards), installed
in one order, and the recorder's layer-ready slot has one owner set once at assembly: a pass that
needs the finished layers elsewhere (the second backward of the two-pass modes, the Opacus
door's criterion flow) diverts the route, which comes back however that pass ends."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import private_engine as pe
from private_engine import opacus_compat
from private_engine.capture.setup import LayerRoute
from private_engine.clipping.assembly import ClippingCore

pytestmark = pytest.mark.filterwarnings("ignore")

#: the guards whose forward hooks both doors install on the model
GUARDS = {"BufferGuard", "SeparabilityProbe", "BatchFlow", "SecretModelRandomness",
          "StepStateGuard"}


class TracedMLP(nn.Module):
    """Two ruled Linears, a gain used outside them (the parameter-entry tracer's) and a buffer
    on the root (the buffer guard hooks it)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.gain = nn.Parameter(torch.ones(8))
        self.fc2 = nn.Linear(8, 3)
        self.register_buffer("shift", torch.zeros(8))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) * self.gain + self.shift)


def _data(n=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _native(mode="bk_mixed"):
    torch.manual_seed(0)
    model = TracedMLP()
    engine = pe.PrivacyEngine(model, batch_size=8, sample_size=64, max_grad_norm=1.0,
                              noise_multiplier=0.0, clipping_mode=mode)
    return model, engine, engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))


def _door(grad_sample_mode="hooks"):
    torch.manual_seed(0)
    model = TracedMLP()
    x, y = _data()
    out = opacus_compat.PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=0.0,
        max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode=grad_sample_mode,
        criterion=nn.CrossEntropyLoss())
    return model, out


def _owner(hook) -> str:
    owner = getattr(hook, "__self__", None)
    return type(owner).__name__ if owner is not None else hook.__qualname__.split(".")[0]


def _guard_order(model: nn.Module):
    """The guards' forward pre-hooks and forward hooks on the model's root, in running order."""
    return ([o for o in map(_owner, model._forward_pre_hooks.values()) if o in GUARDS],
            [o for o in map(_owner, model._forward_hooks.values()) if o in GUARDS])


def test_both_doors_install_the_guards_in_one_order():
    native_model, _, _ = _native()
    door_model, _ = _door()
    pre, post = _guard_order(native_model)
    assert pre == ["StepStateGuard", "SecretModelRandomness", "BatchFlow", "SeparabilityProbe",
                   "BufferGuard"]
    assert post == ["BufferGuard", "BatchFlow", "SecretModelRandomness"]
    assert _guard_order(door_model) == (pre, post)


def test_one_clipping_core_for_both_doors():
    _, engine, _ = _native()
    _, (module, _, _) = _door()
    for core in (engine.core, module.core):
        assert isinstance(core, ClippingCore)
        assert core.clipper.recorder is core.recorder and core.tracer is core.clipper.tracer
        assert core.tracer is not None and [n for n, _ in core.tracer.tracked.values()] == ["gain"]
        assert core.recorder.batch_flow is core.batch_flow
        assert core.recorder.on_layer_ready is core.route
    # who runs the probe and the batch flow: the native clipper, the Opacus door itself
    assert engine.clipper.probe is engine.core.probe and engine.core.clipper_runs_checks
    assert engine.clipper.batch_flow is engine.core.batch_flow
    assert module.clipper.probe is None and module.clipper.batch_flow is None
    assert module.probe is module.core.probe and module.batch_flow is module.core.batch_flow
    assert (engine.buffer_guard, engine.state_guard, engine.model_randomness) == (
        engine.core.buffer_guard, engine.core.state_guard, engine.core.model_randomness)


def test_the_layer_route_has_one_owner_native_two_pass(monkeypatch):
    """The second backward of a two-pass mode diverts the route; it comes back after the step,
    and after a step that raised inside the diversion. (No operand held to the end of the norm
    pass: every layer is left to the second backward.)"""
    from private_engine.clipping import clipper, two_pass

    monkeypatch.setattr(clipper, "HELD_GRADIENTS", 0)
    monkeypatch.setattr(two_pass, "HELD_LOWEST", 0)
    _, engine, optimizer = _native(mode="ghost")
    core = engine.core
    handler = core.route.handler
    x, y = _data()
    model = engine.model
    optimizer.step(loss=nn.functional.cross_entropy(model(x), y, reduction="none"))
    assert core.recorder.on_layer_ready is core.route and core.route.handler is handler

    def broken(layer):
        raise RuntimeError("second pass broke")

    monkeypatch.setattr(engine.clipper.strategy, "_on_layer_released", broken)
    with pytest.raises(RuntimeError, match="second pass broke"):
        optimizer.step(loss=nn.functional.cross_entropy(model(x), y, reduction="none"))
    assert core.recorder.on_layer_ready is core.route and core.route.handler is handler


def test_the_layer_route_has_one_owner_opacus_door(monkeypatch):
    """The Opacus door connects its plain-backward flow once; its criterion flow diverts the
    route for its backward only, however that backward ends."""
    model, (module, optimizer, criterion, _) = _door(grad_sample_mode="ghost")
    core = module.core
    handler = core.route.handler
    assert handler == module._on_layer_ready_plain
    x, y = _data()
    criterion(module(x), y).backward()  # the criterion flow
    optimizer.step()
    optimizer.zero_grad()
    nn.functional.cross_entropy(module(x), y).backward()  # a plain backward
    optimizer.step()
    optimizer.zero_grad()
    assert core.recorder.on_layer_ready is core.route and core.route.handler is handler

    def broken(layer):
        raise RuntimeError("norm pass broke")

    monkeypatch.setattr(module.clipper, "on_layer_ready", broken)
    with pytest.raises(RuntimeError, match="norm pass broke"):
        criterion(module(x), y).backward()
    assert core.recorder.on_layer_ready is core.route and core.route.handler is handler


def test_layer_route_connects_once_and_diversions_end():
    route = LayerRoute()
    with pytest.raises(RuntimeError, match="before the clipping core"):
        route(None)
    seen = []
    route.connect(lambda layer: seen.append(("connected", layer)))
    with pytest.raises(RuntimeError, match="already connected"):
        route.connect(print)
    with pytest.raises(KeyError):
        with route.diverted(lambda layer: seen.append(("diverted", layer))):
            route(1)
            raise KeyError
    route(2)
    assert seen == [("diverted", 1), ("connected", 2)]


def test_a_refused_assembly_leaves_no_hook():
    """A piece that refuses (here the clipper, on an unknown clipping function) after others
    were installed: every hook installed so far is removed before the error propagates."""
    from private_engine.clipping.assembly import assemble_clipping_core
    from private_engine.guards.model_check import clipped_layers, scan_model

    model = TracedMLP()
    scan = scan_model(model)
    layers = clipped_layers(model, strict=True, scan=scan)
    with pytest.raises(ValueError, match="clipping_fn"):
        assemble_clipping_core(model, layers, list(model.parameters()), traced=scan.traced,
                               fallbacks=scan.fallbacks, clipping_fn="clamp")
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_core_remove_and_install_keep_the_assembly_order():
    model, engine, _ = _native()
    order = _guard_order(model)
    engine.core.remove()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    engine.core.install()
    assert _guard_order(model) == order
    assert all(layer.module._forward_hooks for layer in engine.core.recorder.layers)
