"""Attacks on the private training of ``torch.compile``'d models (docs/compile.md).

Each attack hides cross-sample mixing, or state, where ``torch.compile`` could take it out of
the batch flow's sight: a compiled submodule, a compiled loss or step function, a graph compiled
earlier and cached, a backend whose kernels bypass the dispatcher (as Inductor's do), a forward
without grad inside the training forward, a buffer written by a compiled forward, an exception
inside a compiled call, another thread. The contract: a model or loss that mixes samples is
refused (``BatchMixingError`` or the engine's ``ValueError``) before any parameter changes, and
an honest step releases what the uncompiled step releases.
"""
from __future__ import annotations

import copy
import math
import threading

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

import private_engine as pe

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

R = 1.0
B = 4


def hidden(gm, example_inputs):
    """A backend whose kernels run out of the dispatch modes' sight, as Inductor's do."""
    def run(*args):
        with _disable_current_modes():
            return gm.forward(*args)
    return run


BACKENDS = ["aot_eager", hidden]
BACKEND_IDS = ["aot_eager", "hidden"]


def mse(y, t):
    """Per-sample squared error, ``(n,)``."""
    return ((y - t) ** 2).sum(1)


def data(n: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 3, generator=g)


def private(model: nn.Module):
    """The native door (noise 0, R, SGD lr 1): returns the wrapped optimizer."""
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=10 * B, max_grad_norm=R,
                              noise_multiplier=0.0)
    return engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))


def refused_unchanged(model: nn.Module, run, match: str = "mixes samples") -> None:
    """``run()`` raises a refusal (a ``ValueError``) and no parameter of ``model`` moved."""
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        run()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


class Centre(nn.Module):
    """``h − mean over the batch of h``."""

    def forward(self, h):
        return h - h.mean(0)


class CompiledCentre(nn.Module):
    """Mixes samples inside a compiled submodule, with or without grad."""

    def __init__(self, backend, no_grad: bool):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 3)
        self.centre = torch.compile(Centre(), backend=backend)
        self.no_grad = no_grad

    def forward(self, x):
        h = self.fc1(x)
        if self.no_grad:  # a statistic computed without grad, then used
            with torch.no_grad():
                shift = self.centre(h) - h
            return self.fc2(h + shift)
        return self.fc2(self.centre(h))


@pytest.mark.parametrize("no_grad", [False, True], ids=["grad", "no_grad"])
@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_mixing_in_a_compiled_submodule_is_refused_even_with_a_cached_graph(backend, no_grad):
    torch.manual_seed(0)
    model = CompiledCentre(backend, no_grad)
    x, t = data()
    with torch.no_grad():
        model(x)  # the submodule's graph is compiled and cached for this shape
    opt = private(model)
    refused_unchanged(model, lambda: opt.step(loss=mse(model(x), t)))


class ClampedMax(nn.Module):
    """A batch-wide maximum behind a clamp that never binds: no gradient shows the mixing."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.minimum(h, h.detach().abs().max() + 1e6))


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_a_gradient_free_batch_maximum_in_a_compiled_model_is_refused(backend):
    torch.manual_seed(0)
    model = ClampedMax()
    opt = private(model)
    compiled = torch.compile(model, backend=backend)
    x, t = data()
    with torch.no_grad():
        compiled(x)
    compiled(x[:1])  # a batch of one with grad: compiled, no region
    refused_unchanged(model, lambda: opt.step(loss=mse(compiled(x), t)))


def batch_weights(y):
    """Per-sample weights scaled by the batch's largest: mixes samples."""
    s = y.abs().sum(1)
    return s / s.max()


@pytest.mark.parametrize("warm", ["cold", "grad", "no_grad"])
@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_a_cached_compiled_loss_weighting_does_not_run_unseen(backend, warm):
    # the weights are detached: had a cached graph run out of sight, they would enter the loss
    # as per-sample data from outside the step
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    opt = private(model)
    weights = torch.compile(batch_weights, backend=backend)
    if warm == "grad":
        weights(torch.randn(4, 3))
    elif warm == "no_grad":
        with torch.no_grad():
            weights(torch.randn(4, 3))
    x, t = data()

    def run():
        y = model(x)
        opt.step(loss=mse(y, t) * weights(y.detach()))
    refused_unchanged(model, run)


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_a_compiled_training_step_function_that_mixes_in_the_loss_is_refused(backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    opt = private(model)

    def losses(a, b):
        y = model(a)
        return mse(y - y.mean(0), b)
    compiled = torch.compile(losses, backend=backend)
    x, t = data()
    with torch.no_grad():
        compiled(x, t)
    refused_unchanged(model, lambda: opt.step(loss=compiled(x, t)))


class RunningCentre(nn.Module):
    """Writes the batch mean into a buffer in its forwards without grad; subtracts it always."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 3)
        self.register_buffer("mu", torch.zeros(8))

    def forward(self, x):
        h = self.fc1(x)
        if not torch.is_grad_enabled():
            self.mu.copy_(h.mean(0))
        return self.fc2(h - self.mu)


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_a_buffer_a_compiled_forward_wrote_from_the_batch_is_refused(backend):
    torch.manual_seed(0)
    model = RunningCentre()
    opt = private(model)
    compiled = torch.compile(model, backend=backend)
    x, t = data()

    def run():
        with torch.no_grad():
            compiled(x)  # mu := this batch's mean, written by a compiled graph
        opt.step(loss=mse(compiled(x), t))
    refused_unchanged(model, run, match="modified in place")


class Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 3)
        self.boom = False

    def forward(self, x):
        h = self.fc1(x)
        if self.boom:
            raise RuntimeError("boom")
        return self.fc2(h)


def test_an_exception_inside_a_compiled_forward_leaves_the_next_step_guarded():
    torch.manual_seed(0)
    model = Raises()
    opt = private(model)
    compiled = torch.compile(model, backend="aot_eager")
    x, t = data()
    model.boom = True
    with pytest.raises(RuntimeError, match="boom"):
        compiled(x)
    # nothing left behind: no mode on the stack, Dynamo's callback back off
    assert _get_current_dispatch_mode_stack() == []
    assert not torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.Python)
    assert torch._C._dynamo.eval_frame.get_eval_frame_callback() is None
    model.boom = False

    def run():
        y = compiled(x)
        opt.step(loss=mse(y - y.mean(0), t))
    refused_unchanged(model, run)
    opt.step(loss=mse(compiled(x), t))  # an honest step then trains
    assert _get_current_dispatch_mode_stack() == []


def test_an_exception_in_a_compiled_step_function_after_the_forward_leaves_it_guarded():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    opt = private(model)

    def losses(a, b, fail: bool):
        y = model(a)
        if fail:
            raise RuntimeError("loss failed")
        return mse(y - y.mean(0), b)
    compiled = torch.compile(losses, backend="aot_eager")
    x, t = data()
    with pytest.raises(RuntimeError, match="loss failed"):
        compiled(x, t, True)
    refused_unchanged(model, lambda: opt.step(loss=compiled(x, t, False)))


@pytest.mark.parametrize("where", ["forward_in_thread", "loss_in_thread"])
def test_a_compiled_step_split_across_threads_is_refused(where):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    opt = private(model)
    compiled = torch.compile(model, backend="aot_eager")
    x, t = data()
    box = {}

    def run():
        if where == "forward_in_thread":
            th = threading.Thread(target=lambda: box.update(y=compiled(x)))
            th.start()
            th.join()
            y = box["y"]
            opt.step(loss=mse(y - y.mean(0), t))
        else:
            y = compiled(x)
            th = threading.Thread(target=lambda: box.update(l=mse(y - y.mean(0), t)))
            th.start()
            th.join()
            opt.step(loss=box["l"])
    refused_unchanged(model, run, match="could not follow the step|mixes samples")


class Dropping(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 3)

    def forward(self, x):
        return self.fc2(self.drop(self.fc1(x)))


def test_compiled_dropout_is_not_replayed_by_the_public_seed():
    # two runs from the same torch.manual_seed: the secret generator draws other masks
    torch.manual_seed(0)
    base = Dropping()
    x, t = data()
    released = []
    for _ in range(2):
        model = copy.deepcopy(base)
        opt = private(model)
        compiled = torch.compile(model, backend="aot_eager")
        torch.manual_seed(123)
        opt.step(loss=mse(compiled(x), t))
        released.append([p.detach().clone() for p in model.parameters()])
    assert any(not torch.equal(a, b) for a, b in zip(*released))


class CentresFirst(nn.Module):
    """Centres its input over the batch before its first layer."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        x = x - x.mean(0)
        return self.fc2(self.fc1(x))


def released_update(model, x, t, call) -> list:
    """One step (noise 0, SGD lr 1) of a copy of ``model`` through ``call(copy)``; the change
    of every parameter, or None if the step was refused."""
    model = copy.deepcopy(model)
    opt = private(model)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step(loss=mse(call(model)(x), t))
    except ValueError:
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        return None
    return [p.detach() - a for p, a in zip(model.parameters(), before)]


@pytest.mark.parametrize("call", [
    lambda m: m.forward,
    lambda m: torch.compile(m.forward, backend="aot_eager"),
    lambda m: torch.compile(lambda a: m.forward(a), backend="aot_eager"),
], ids=["forward", "compiled_forward", "compiled_lambda_forward"])
def test_a_model_forward_called_directly_cannot_hide_mixing(call):
    # model.forward(x) skips the model's forward hooks: the region would open at its first
    # layer, after the centring, which would pass as the batch's data
    torch.manual_seed(0)
    model = CentresFirst()
    x, t = data(3)
    xc, tc = torch.cat([x, torch.full((1, 8), 1e3)]), torch.cat([t, torch.zeros(1, 3)])
    with_sample = released_update(model, xc, tc, call)
    without = released_update(model, x, t, call)
    if with_sample is None or without is None:
        assert with_sample is None and without is None  # refused whatever the data
        return
    sq = sum(float((a - b).pow(2).sum()) for a, b in zip(with_sample, without))
    assert B * math.sqrt(sq) / R <= 1 + 1e-6


def test_a_direct_forward_call_is_refused_saying_what_to_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    opt = private(model)
    x, t = data()
    compiled = torch.compile(model.forward, backend="aot_eager")
    refused_unchanged(model, lambda: opt.step(loss=mse(compiled(x), t)),
                      match=r"called directly.*Call the model itself")
    opt.step(loss=mse(torch.compile(model, backend="aot_eager")(x), t))  # model(x) trains


def opacus_step(model: nn.Module, x, t, flow: str, *, compile_handle: bool, centre_loss: bool):
    """One step of the Opacus door (noise 0, R, SGD lr 1): ``flow="hooks"`` backpropagates
    ``mse(y, t).mean()``, ``flow="ghost"`` the returned criterion (``nn.MSELoss`` per sample,
    times the outputs per sample). ``centre_loss`` centres the outputs over the batch first."""
    from torch.utils.data import DataLoader, TensorDataset

    from private_engine import opacus_compat

    engine = opacus_compat.PrivacyEngine(accountant="rdp")
    loader = DataLoader(TensorDataset(torch.zeros(10 * B, 1)), batch_size=B)
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=loader, noise_multiplier=0.0, max_grad_norm=R, poisson_sampling=False,
        grad_sample_mode=flow, criterion=nn.MSELoss())
    handle, optimizer = out[0], out[1]
    run = torch.compile(handle, backend="aot_eager") if compile_handle else handle
    y = run(x)
    if centre_loss:
        y = y - y.mean(0)
    if flow == "ghost":
        n, k = y.shape
        objective = out[2](y.reshape(-1), t.reshape(-1), shape=(n, k)) * k
    else:
        objective = mse(y, t).mean()
    objective.backward()
    optimizer.step()


@pytest.mark.parametrize("flow", ["hooks", "ghost"])
@pytest.mark.parametrize("attack", ["compiled_submodule", "compiled_handle_centred_loss"])
def test_the_opacus_door_refuses_mixing_hidden_by_compile(attack, flow):
    torch.manual_seed(0)
    x, t = data()
    if attack == "compiled_submodule":
        model = CompiledCentre(hidden, no_grad=True)
        with torch.no_grad():
            model(x)  # cached graph of the submodule
        refused_unchanged(model, lambda: opacus_step(model, x, t, flow, compile_handle=False,
                                                     centre_loss=False))
    else:
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
        refused_unchanged(model, lambda: opacus_step(model, x, t, flow, compile_handle=True,
                                                     centre_loss=True))


@pytest.mark.slow
def test_the_default_backend_hides_no_mixing():
    # Inductor's kernels bypass the dispatcher: its cached graphs must not run inside a step
    torch.manual_seed(0)
    model = CompiledCentre("inductor", no_grad=True)
    x, t = data()
    with torch.no_grad():
        model(x)
    opt = private(model)
    compiled = torch.compile(model)
    with torch.no_grad():
        compiled(x)
    refused_unchanged(model, lambda: opt.step(loss=mse(compiled(x), t)))


class DisabledCentre(nn.Module):
    """Mixes samples in a ``torch.compiler.disable`` region of a compiled model."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 3)

    @torch.compiler.disable
    def centre(self, h):
        return h - h.mean(0)

    def forward(self, x):
        return self.fc2(self.centre(self.fc1(x)))


@pytest.mark.parametrize("how", ["torch_compile", "module_compile"])
def test_mixing_in_a_compiler_disable_region_of_a_compiled_model_is_refused(how):
    torch.manual_seed(0)
    model = DisabledCentre()
    opt = private(model)
    if how == "module_compile":
        model.compile(backend=hidden)
        run = model
    else:
        run = torch.compile(model, backend=hidden)
    x, t = data()
    with torch.no_grad():
        run(x)
    refused_unchanged(model, lambda: opt.step(loss=mse(run(x), t)))
