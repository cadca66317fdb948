"""Buffers updated from the data in training mode are releases without noise: refused.

Static (engine construction, both doors): InstanceNorm with running statistics, timm's
batch-statistic EvoNorms. Dynamic (``private_engine.guards.buffers.BufferGuard``): any module whose
training-mode forward modifies or re-assigns a buffer; evaluation and constant buffers (timm's
position tables) raise nothing. ``fix_batchnorm`` turns InstanceNorm's tracking off.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import private_engine as pe
from private_engine import opacus_compat
from private_engine.guards.buffers import BufferGuard, drop_running_stats, running_stats_modules

timm = pytest.importorskip("timm")


def conv_in(**norm_kwargs):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, **norm_kwargs), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 2))


def native(model):
    return pe.PrivacyEngine(model, batch_size=2, sample_size=8, max_grad_norm=1.0,
                            noise_multiplier=0.0)


def opacus_door(model):
    data = TensorDataset(torch.randn(8, 3, 8, 8), torch.randint(0, 2, (8,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' secure-RNG warning
        return opacus_compat.PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=2), noise_multiplier=0.0, max_grad_norm=1.0)


def opacus_fixed_instancenorm():
    """Opacus' ModuleValidator.fix turns the flag off but keeps the running buffers, which
    F.instance_norm still updates from every batch."""
    from opacus.validators import ModuleValidator

    model = ModuleValidator.fix(conv_in(track_running_stats=True, affine=True))
    assert not model[1].track_running_stats and model[1].running_mean is not None
    before = model[1].running_mean.clone()
    model(torch.randn(2, 3, 8, 8))
    assert not torch.equal(before, model[1].running_mean)  # the leak this refuses
    return model


def frozen(model):
    """The affine InstanceNorm frozen: its statistics are buffers, not parameters, all the same."""
    model[1].requires_grad_(False)
    return model


# -- static check ----------------------------------------------------------------------------

BUILDS = {
    "affine_false": lambda: conv_in(track_running_stats=True),
    "affine_true": lambda: conv_in(track_running_stats=True, affine=True),
    "frozen": lambda: frozen(conv_in(track_running_stats=True, affine=True)),
    "opacus_fixed": opacus_fixed_instancenorm,
}


# Opacus' own validator (run first by make_private) refuses a *trainable* tracking InstanceNorm
# with its message; the three others it lets through.
@pytest.mark.parametrize("door, build", [(native, b) for b in BUILDS] + [
    (opacus_door, b) for b in ("affine_false", "frozen", "opacus_fixed")])
def test_instancenorm_with_running_stats_refused(door, build):
    model = BUILDS[build]()
    with pytest.raises(ValueError) as err:
        door(model)
    msg = str(err.value)
    assert "1 (InstanceNorm2d)" in msg and "track running statistics" in msg
    assert "state_dict" in msg and "without noise" in msg
    assert "track_running_stats=False" in msg and "GroupNorm" in msg and "fix_batchnorm" in msg


def lazy_in():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.LazyInstanceNorm2d(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 2))  # LazyInstanceNorm tracks by default


def test_lazy_instancenorm_refused_and_fixed():
    model = lazy_in()
    assert running_stats_modules(model) == ["1"]
    model(torch.randn(1, 3, 8, 8))  # materialised: it becomes an InstanceNorm2d
    with pytest.raises(ValueError, match=r"1 \(InstanceNorm2d\)"):
        native(model)
    model = lazy_in()
    assert drop_running_stats(model) == ["1"]  # before materialisation
    model(torch.randn(1, 3, 8, 8))
    assert running_stats_modules(model) == [] and model[1].running_mean is None
    native(model)


def test_timm_batch_statistics_evonorm_refused():
    from timm.layers.evo_norm import EvoNorm2dB0, EvoNorm2dS0

    ok = nn.Sequential(nn.Conv2d(3, 4, 3), EvoNorm2dS0(4, group_size=2))
    assert running_stats_modules(ok) == []
    model = nn.Sequential(nn.Conv2d(3, 4, 3), EvoNorm2dB0(4), nn.Flatten(), nn.Linear(144, 2))
    with pytest.raises(ValueError, match="batch statistics") as err:
        native(model)
    assert "(1)" in str(err.value) and "EvoNorm2dS" in str(err.value)


def test_batchnorm_keeps_its_message():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.InstanceNorm2d(
        4, track_running_stats=True), nn.Flatten(), nn.Linear(144, 2))
    with pytest.raises(ValueError, match="BatchNorm layers") as err:
        native(model)
    assert "fix_batchnorm" in str(err.value)
    model = pe.fix_batchnorm(model, num_groups=2)  # both fixed
    assert running_stats_modules(model) == []
    native(model)


def test_fix_batchnorm_drops_instancenorm_running_stats():
    model = conv_in(track_running_stats=True, affine=True)
    x = torch.randn(3, 3, 8, 8)
    model.train()
    expected = model(x).detach()  # training mode: each sample's own statistics
    fixed = pe.fix_batchnorm(model)
    norm = fixed[1]
    assert isinstance(norm, nn.InstanceNorm2d) and not norm.track_running_stats
    assert norm.running_mean is None and norm.running_var is None
    assert not any("running" in k or "num_batches" in k for k in fixed.state_dict())
    torch.testing.assert_close(fixed(x), expected)  # training unchanged
    native(fixed)  # accepted
    assert drop_running_stats(fixed) == []


# -- dynamic guard ---------------------------------------------------------------------------

class EMA(nn.Module):
    """An exponential moving average of its activations, kept in a float buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("avg", torch.zeros(3))

    def forward(self, x):
        y = self.lin(x)
        if self.training:
            self.avg.mul_(0.9).add_(0.1 * y.detach().mean(0))
        return y


class Counter(nn.Module):
    """Counts the samples it has seen (an integer buffer, not persistent)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.long), persistent=False)

    def forward(self, x):
        self.seen += x.shape[0]
        return x


class LastMean(nn.Module):
    """Re-assigns its buffer with the batch mean (no in-place operation)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", None)

    def forward(self, x):
        self.mean = x.detach().mean(0)
        return x


class ShapeCache(nn.Module):
    """Builds a cache buffer from the input's shape only (as rotary-embedding caches do)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.zeros(0), persistent=False)

    def forward(self, x):
        if self.table.shape[0] != x.shape[-1]:
            self.table = torch.arange(x.shape[-1], dtype=x.dtype)
        return x + self.table


class MovesItsBuffer(nn.Module):
    """``self.pe = self.pe.to(x.dtype)``: a new tensor with the same values."""

    def __init__(self):
        super().__init__()
        self.register_buffer("pe", torch.arange(3.0))

    def forward(self, x):
        self.pe = self.pe.to(x.dtype)
        return x + self.pe


def guarded(*modules, allow=()):
    model = nn.Sequential(nn.Linear(3, 3), *modules)
    return model, BufferGuard(model, allow=allow).install()


@pytest.mark.parametrize("module, name, what", [
    (EMA(), "1.avg", "modified in place"),
    (Counter(), "1.seen", "modified in place"),
    (LastMean(), "1.mean", "assigned"),
    (ShapeCache(), "1.table", "re-assigned"),
])
def test_guard_catches_buffer_updated_in_training_forward(module, name, what):
    model, guard = guarded(module)
    with pytest.raises(ValueError) as err:
        model(torch.randn(4, 3))
    msg = str(err.value)
    assert f"buffer {name} of {type(module).__name__} was {what}" in msg
    assert "training-mode forward" in msg and "without noise" in msg and "allow=" in msg
    guard.remove()
    model(torch.randn(4, 3))  # hooks gone


def test_guard_names_the_root_module():
    model = Counter()
    with BufferGuard(model), pytest.raises(ValueError, match=r"buffer Counter\.seen of Counter"):
        model(torch.randn(2, 3))
    model(torch.randn(2, 3))  # the context manager removed the hooks


def test_guard_ignores_eval_mode_and_no_grad():
    model, guard = guarded(EMA(), Counter())
    model.eval()
    model(torch.randn(4, 3))  # EMA does not update in eval; Counter does, in evaluation
    model.train()
    with torch.no_grad():
        model(torch.randn(4, 3))
    with torch.inference_mode():
        model(torch.randn(4, 3))
    assert int(model[2].seen) == 12
    with pytest.raises(ValueError, match=r"1\.avg"):
        model(torch.randn(4, 3))


def test_guard_allow_list():
    model = nn.Sequential(nn.Linear(3, 3), ShapeCache())
    with BufferGuard(model, allow=["*.table"]) as guard:
        assert guard._handles == []  # the only buffer is allowed: nothing to hook
        model(torch.randn(4, 3))
    model[1].table = torch.zeros(0)
    with BufferGuard(model), pytest.raises(ValueError, match=r"buffer 1\.table"):
        model(torch.randn(4, 3))


def test_guard_accepts_a_buffer_moved_with_equal_values():
    model = MovesItsBuffer()
    with BufferGuard(model):
        model(torch.randn(4, 3, dtype=torch.float64))
    assert model.pe.dtype == torch.float64


def test_guard_runs_with_the_engine_and_the_fallback():
    """Engine hooks, a torch.func fallback module (replayed per sample) with a constant buffer,
    and a step: no false alarm; a buffer update still raises, before the step."""

    @pe.layers.register_fallback
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 3))
            self.register_buffer("scale", torch.tensor(2.0))
            self.update = False

        def forward(self, x):
            out = torch.tanh(x @ self.w) * self.scale
            if self.update:
                self.scale.add_(out.detach().mean())
            return out

    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), Scaled(), nn.Linear(3, 2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = pe.PrivacyEngine(model, batch_size=4, sample_size=16, max_grad_norm=1.0,
                                      noise_multiplier=0.0)
        opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        guard = BufferGuard(model).install()
        for _ in range(2):
            opt.step(loss=(model(torch.randn(4, 4)) ** 2).sum(1))
        model[1].update = True
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=r"buffer 1\.scale"):
            opt.step(loss=(model(torch.randn(4, 4)) ** 2).sum(1))
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        guard.remove()
        engine.detach()
    finally:
        pe.layers.unregister(Scaled)


S = dict(img_size=32, num_classes=3, drop_path_rate=0.0)
TIMM = {
    "vit": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=4), 32),
    "resnet18": ("resnet18", {}, 32),
    "swin": ("swin_tiny_patch4_window7_224", dict(S, patch_size=4, window_size=4, embed_dim=16,
                                                  depths=(2, 1), num_heads=(2, 2)), 32),
    "swinv2": ("swinv2_tiny_window8_256", dict(S, patch_size=4, window_size=4, embed_dim=16,
                                               depths=(2, 1), num_heads=(2, 2)), 32),
    "beit": ("beit_base_patch16_224", dict(S, patch_size=8, embed_dim=16, depth=1, num_heads=2),
             32),
    "eva": ("eva02_tiny_patch14_224", dict(S, img_size=28, patch_size=14, embed_dim=16, depth=1,
                                           num_heads=2), 28),  # RoPE tables as buffers
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(TIMM))
def test_timm_models_raise_no_false_alarm(family):
    name, kwargs, size = TIMM[family]
    torch.manual_seed(0)
    model = pe.fix_batchnorm(timm.create_model(name, pretrained=False, **kwargs), num_groups=4)
    assert running_stats_modules(model) == []
    model.train()
    guard = BufferGuard(model).install()
    watched = sum(1 for m in model.modules() if m._buffers)
    assert len(guard._handles) == 2 * watched
    for _ in range(2):
        model(torch.randn(2, 3, size, size)).sum().backward()
    with warnings.catch_warnings():  # and with the engine's hooks and tracer, through a step
        warnings.simplefilter("ignore")
        engine = native(model)
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    y = torch.tensor([0, 1])
    opt.step(loss=F.cross_entropy(model(torch.randn(2, 3, size, size)), y, reduction="none"))
    engine.detach()
    guard.remove()
