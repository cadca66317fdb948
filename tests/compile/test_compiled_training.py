"""Private training of a ``torch.compile``'d model (docs/compile.md).

The training forward of a compiled model runs eagerly under the batch flow (Dynamo compiles no
frame while its dispatch mode is on the stack), so a private step releases exactly what the
uncompiled model's step releases, with every per-step guard: the update equals the eager one,
crafted samples move it by at most R/B, a model that mixes samples is refused naming the op,
at every batch shape. Forwards under ``torch.no_grad()`` stay compiled.

The Aot-eager backend stands in for Inductor (same Dynamo frames and graph breaks, no C++
compilation); one slow test uses the default backend.
"""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from private_engine.guards.batch_flow import CompiledStepWarning

pytestmark = pytest.mark.usefixtures("one_thread")

R = 1.0
B = 4  # declared batch size: 3 honest samples + the crafted one


class CapturingSGD(torch.optim.SGD):
    """``SGD(lr=1)`` keeping a float64 copy of the gradients of its last step (what it
    released); ``steps`` counts the steps taken."""

    def __init__(self, params):
        super().__init__(params, lr=1.0)
        self.steps = 0
        self.consumed: list = []

    def step(self, closure=None):
        """Record the gradients, then step."""
        self.steps += 1
        self.consumed = [torch.zeros_like(p, dtype=torch.float64) if p.grad is None
                         else p.grad.detach().double().clone()
                         for g in self.param_groups for p in g["params"]]
        return super().step(closure)


class SmallViT(nn.Module):
    """Patch embedding, one pre-norm attention block and MLP with residuals, a linear head."""

    def __init__(self, dim: int = 16, patches: int = 4, heads: int = 2):
        super().__init__()
        self.embed = nn.Linear(12, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(dim, 3)
        self.patches = patches

    def forward(self, x):
        h = self.embed(x.reshape(x.shape[0], self.patches, 12))
        a = self.norm1(h)
        h = h + self.attn(a, a, a, need_weights=False)[0]
        h = h + self.fc2(self.drop(F.gelu(self.fc1(self.norm2(h)))))
        return self.head(h.mean(1))


class SmallResNet(nn.Module):
    """Conv → GroupNorm → ReLU with a residual block, pooled into a linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.gn1 = nn.GroupNorm(2, 8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.gn2 = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = F.relu(self.gn1(self.stem(x.reshape(x.shape[0], 3, 4, 4))))
        h = F.relu(h + self.gn2(self.conv(h)))
        return self.head(h.mean((2, 3)))


class BatchCentred(nn.Module):
    """``fc2(h − mean over the batch of h)``: mixes samples."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(48, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h - h.mean(0))


def mse(y, t):
    """Per-sample squared error, ``(n,)``."""
    return ((y - t) ** 2).sum(1)


def private_sgd(model: nn.Module, mode: str = "bk_mixed") -> CapturingSGD:
    """A :class:`CapturingSGD` over ``model``'s parameters, attached to a private engine (noise 0,
    R, expected batch B, clipping ``mode``)."""
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=10 * B, max_grad_norm=R,
                              noise_multiplier=0.0, clipping_mode=mode)
    opt = CapturingSGD(model.parameters())
    engine.attach(opt)
    return opt


def step(model: nn.Module, x, t, *, compiled: bool, steps: int = 1, mode: str = "bk_mixed",
         backend: str = "aot_eager"):
    """``steps`` private steps (noise 0, R, SGD lr 1) of a fresh copy of ``model``, compiled or
    not, on ``(x, t)``. Returns (released gradients of the last step, parameters after, the
    optimizer)."""
    model = copy.deepcopy(model)
    opt = private_sgd(model, mode)
    run = torch.compile(model, backend=backend) if compiled else model
    for _ in range(steps):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CompiledStepWarning)
            opt.step(loss=mse(run(x), t))
    return opt.consumed, [p.detach().clone() for p in model.parameters()], opt


def data(n: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 48, generator=g), torch.randn(n, 3, generator=g)


@pytest.mark.parametrize("mode", ["bk_mixed", "ghost"])
@pytest.mark.parametrize("model_cls", [SmallViT, SmallResNet], ids=["vit", "resnet_gn"])
def test_compiled_update_equals_the_eager_update(model_cls, mode):
    torch.manual_seed(0)
    model = model_cls().eval()  # dropout off: the two runs draw different secret masks
    x, t = data(4)
    _, eager, _ = step(model, x, t, compiled=False, steps=2, mode=mode)
    _, compiled, opt = step(model, x, t, compiled=True, steps=2, mode=mode)
    assert opt.steps == 2
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any((a - p).abs().max() > 1e-4 for a, p in zip(eager, model.parameters()))


def test_a_compiled_step_warns_that_it_runs_eagerly():
    torch.manual_seed(0)
    model = SmallViT().eval()
    opt = private_sgd(model)
    x, t = data(4)
    with pytest.warns(CompiledStepWarning, match="runs eagerly during private steps"):
        opt.step(loss=mse(torch.compile(model, backend="aot_eager")(x), t))
    assert opt.steps == 1


CRAFTED = {
    "huge": torch.full((1, 48), 1e30),
    "tiny": torch.full((1, 48), 1e-30),
    "subnormal": torch.full((1, 48), 1e-42),
    # equal and opposite halves: the patch sums cancel
    "cancelling": torch.cat([torch.full((1, 24), 3e4), torch.full((1, 24), -3e4)], 1),
}


@pytest.mark.parametrize("crafted", list(CRAFTED))
@pytest.mark.parametrize("model_cls", [SmallViT, SmallResNet], ids=["vit", "resnet_gn"])
def test_one_crafted_sample_moves_a_compiled_step_by_at_most_r(model_cls, crafted):
    torch.manual_seed(0)
    model = model_cls().eval()
    x, t = data(3)
    xc = torch.cat([x, CRAFTED[crafted]])
    tc = torch.cat([t, torch.full((1, 3), 1e4)])
    with_sample, _, _ = step(model, xc, tc, compiled=True)
    without, _, _ = step(model, x, t, compiled=True)
    sq = sum(float((a - b).pow(2).sum()) for a, b in zip(with_sample, without))
    assert math.isfinite(sq)
    assert B * math.sqrt(sq) / R <= 1 + 1e-5


def test_a_compiled_model_that_mixes_samples_is_refused_naming_the_op():
    torch.manual_seed(0)
    x, t = data(4)
    with pytest.raises(pe.BatchMixingError, match=r"mixes samples.*mean over the batch"):
        step(BatchCentred(), x, t, compiled=True)


class CentredFromSix(BatchCentred):
    """Mixes samples only for batches of six or more rows (a branch on the shape: Dynamo
    recompiles for the new shape)."""

    def forward(self, x):
        h = self.fc1(x)
        if x.shape[0] >= 6:
            h = h - h.mean(0)
        return self.fc2(h)


def test_a_new_batch_shape_is_checked_again():
    torch.manual_seed(0)
    model = CentredFromSix()
    opt = private_sgd(model)
    compiled = torch.compile(model, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompiledStepWarning)
        for n in (4, 5):
            x, t = data(n)
            with torch.no_grad():
                compiled(x)  # compiled for this shape
            opt.step(loss=mse(compiled(x), t))
        assert opt.steps == 2
        x, t = data(6)
        with torch.no_grad():
            compiled(x)
        with pytest.raises(pe.BatchMixingError, match=r"mean over the batch"):
            opt.step(loss=mse(compiled(x), t))
    assert opt.steps == 2


def test_forwards_without_grad_stay_compiled():
    calls = {"graphs": 0, "runs": 0}

    def counting(gm, example_inputs):
        calls["graphs"] += 1

        def run(*args):
            calls["runs"] += 1
            return gm.forward(*args)
        return run

    torch.manual_seed(0)
    model = SmallResNet()
    opt = private_sgd(model)
    compiled = torch.compile(model, backend=counting)
    x, t = data(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompiledStepWarning)
        opt.step(loss=mse(compiled(x), t))
    assert opt.steps == 1
    with torch.no_grad():
        before = calls["runs"]
        out = compiled(x)
        assert calls["runs"] > before  # the model's forward ran as a compiled graph
    torch.testing.assert_close(out, model(x).detach())


def test_dropout_of_a_compiled_step_is_drawn_from_the_secret_generator():
    torch.manual_seed(0)
    model = SmallViT().train()
    x, t = data(4)
    torch.manual_seed(123)
    public = model(x).detach()  # the masks a public seed gives
    opt = private_sgd(model)
    torch.manual_seed(123)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompiledStepWarning)
        y = torch.compile(model, backend="aot_eager")(x)
    assert not torch.allclose(y.detach(), public)
    opt.step(loss=mse(y, t))
    assert opt.steps == 1
    after = torch.rand(3)  # the user's generator continues as if the step drew nothing
    torch.manual_seed(123)
    torch.testing.assert_close(after, torch.rand(3))


@pytest.mark.parametrize("n", [1, 4], ids=["one_sample", "four_samples"])
def test_a_timm_vit_compiled_trains_as_the_eager_one(n):
    # a batch of one sample opens no batch-flow region: the forward still runs eagerly
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3,
                              img_size=16, patch_size=8, depth=1, embed_dim=24, num_heads=2)
    model.eval()  # the same dropout (none) in both runs
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(n, 3, 16, 16, generator=g), torch.randn(n, 3, generator=g)
    _, eager, _ = step(model, x, t, compiled=False)
    _, compiled, opt = step(model, x, t, compiled=True)
    assert opt.steps == 1
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_default_backend_trains_as_the_eager_model():
    # torch.compile(model) as users write it: Inductor compiles the forwards without grad
    torch.manual_seed(0)
    model = SmallResNet()
    x, t = data(4)
    _, eager, _ = step(model, x, t, compiled=False, steps=2)
    _, compiled, opt = step(model, x, t, compiled=True, steps=2, backend="inductor")
    assert opt.steps == 2
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_compiled_loss_function_around_the_compiled_model_trains_exactly():
    torch.manual_seed(0)
    model = SmallResNet()
    x, t = data(4)
    _, eager, _ = step(model, x, t, compiled=False, steps=2)
    model = copy.deepcopy(model)
    opt = private_sgd(model)
    inner = torch.compile(model, backend="aot_eager")
    losses = torch.compile(lambda a, b: mse(inner(a), b), backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompiledStepWarning)
        for _ in range(2):
            opt.step(loss=losses(x, t))
    assert opt.steps == 2
    for a, b in zip(eager, model.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


def opacus_private(model: nn.Module, opt: torch.optim.Optimizer):
    """The Opacus door's ``make_private`` on ``model`` (noise 0, R, no Poisson sampling, expected
    batch size B): the wrapped module and the DP optimizer."""
    from torch.utils.data import DataLoader, TensorDataset

    from private_engine import opacus_compat

    loader = DataLoader(TensorDataset(torch.zeros(10 * B, 1)), batch_size=B)
    handle, optimizer, _ = opacus_compat.PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=0.0,
        max_grad_norm=R, poisson_sampling=False)
    return handle, optimizer

def test_the_opacus_door_sees_a_loss_that_mixes_samples_after_a_compiled_forward():
    # the loss is computed after the compiled call returns: the batch flow must still see it
    torch.manual_seed(0)
    model = SmallResNet()
    x, t = data(4)
    opt = CapturingSGD(model.parameters())
    handle, optimizer = opacus_private(model, opt)
    compiled = torch.compile(handle, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompiledStepWarning)
        y = compiled(x)
        centred = y - y.mean(0)  # couples every sample's loss to the others'
        with pytest.raises(ValueError, match="mixes samples"):
            mse(centred, t).mean().backward()
            optimizer.step()
    assert opt.steps == 0


def test_a_loss_after_nested_compiled_calls_is_followed():
    # a compiled function returns a compiled model's output; the loss is computed after both
    # calls returned
    torch.manual_seed(0)
    model = SmallResNet()
    x, t = data(4)
    _, eager, _ = step(model, x, t, compiled=False, steps=2)

    def nested(centre: bool):
        m = copy.deepcopy(model)
        opt = private_sgd(m)
        inner = torch.compile(m, backend="aot_eager")
        outer = torch.compile(lambda a: inner(a) * 1.0, backend="aot_eager")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CompiledStepWarning)
            for _ in range(2):
                y = outer(x)
                opt.step(loss=mse(y - y.mean(0) if centre else y, t))
        return m, opt

    m, opt = nested(centre=False)
    assert opt.steps == 2
    for a, b in zip(eager, m.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(pe.BatchMixingError, match=r"mixes samples.*mean over the batch"):
        nested(centre=True)


def test_the_opacus_door_sees_a_loss_after_nested_compiled_calls():
    torch.manual_seed(0)
    model = SmallResNet()
    x, t = data(4)
    opt = CapturingSGD(model.parameters())
    handle, optimizer = opacus_private(model, opt)
    inner = torch.compile(handle, backend="aot_eager")
    outer = torch.compile(lambda a: inner(a) * 1.0, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompiledStepWarning)
        y = outer(x)
        with pytest.raises(ValueError, match="mixes samples"):
            mse(y - y.mean(0), t).mean().backward()
            optimizer.step()
    assert opt.steps == 0


class SeesDynamo(SmallResNet):
    """Records whether TorchDynamo inspects the frames of its forward (its frame callback)."""

    def forward(self, x):
        self.callback = torch._C._dynamo.eval_frame.get_eval_frame_callback()
        return super().forward(x)


def test_dynamo_leaves_the_frames_of_a_step_alone():
    # the step's forward runs eagerly: Dynamo's frame callback, which would only inspect each
    # frame to skip it, is off until the compiled call returns
    torch.manual_seed(0)
    model = SeesDynamo()
    opt = private_sgd(model)
    compiled = torch.compile(model, backend="aot_eager")
    x, t = data(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompiledStepWarning)
        opt.step(loss=mse(compiled(x), t))
    assert model.callback is None
    with torch.no_grad():
        compiled(x)
    assert model.callback is not None  # traced by Dynamo
    assert torch._C._dynamo.eval_frame.get_eval_frame_callback() is None


def test_module_compile_trains_as_the_eager_model():
    # nn.Module.compile compiles the module in place: model(x) is the compiled call
    torch.manual_seed(0)
    model = SmallResNet()
    x, t = data(4)
    _, eager, _ = step(model, x, t, compiled=False, steps=2)
    model = copy.deepcopy(model)
    opt = private_sgd(model)
    model.compile(backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompiledStepWarning)
        for _ in range(2):
            opt.step(loss=mse(model(x), t))
    assert opt.steps == 2
    for a, b in zip(eager, model.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
