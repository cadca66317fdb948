"""The Opacus-compatible API surface: what ``make_private`` returns, bad arguments and
unsupported models refused with errors that say what to do, no hooks or records left behind, and
gradients the module did not clip never released (Opacus raises in each case too)."""
from __future__ import annotations

import opacus
import pytest
import torch
from compat_cases import TinyMHA, data_for, make_compat, mlp
from opacus.layers import DPMultiheadAttention
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import private_engine as pe
from private_engine import opacus_compat
from private_engine.opacus_compat import PrivateModule

pytestmark = pytest.mark.filterwarnings("ignore")


def test_returns_like_opacus():
    engine = opacus_compat.PrivacyEngine(accountant="gdp", secure_mode=False)
    assert isinstance(engine, opacus.PrivacyEngine) and engine.accountant.mechanism() == "gdp"
    model = mlp().double()
    module, optimizer, loader = make_compat(model)
    assert isinstance(module, PrivateModule) and module._module is model
    assert isinstance(optimizer, opacus.optimizers.DPOptimizer)
    assert isinstance(loader, opacus.data_loader.DPDataLoader)
    assert set(module.state_dict()) == {"_module." + k for k in model.state_dict()}
    assert len(make_compat(grad_sample_mode="ghost")) == 4
    # the native form is untouched
    native = pe.PrivacyEngine(mlp(), batch_size=4, sample_size=8, max_grad_norm=1.0,
                              noise_multiplier=1.0)
    assert type(native) is pe.PrivacyEngine


MODULE_FOR_PARTIAL_OPT = mlp()
PARTIAL_OPT = torch.optim.SGD(MODULE_FOR_PARTIAL_OPT[0].parameters(), lr=0.1)


@pytest.mark.parametrize("kw, exc, words", [
    (dict(grad_sample_mode="bogus"), ValueError, "grad_sample_mode"),
    (dict(clipping="per_layer"), ValueError, "one per"),
    (dict(clipping="per_layer", max_grad_norm=[1.0]), ValueError, "one max_grad_norm per"),
    (dict(clipping="per_layer", grad_sample_mode="ghost", max_grad_norm=[1.0] * 4), ValueError,
     "hooks"),
    (dict(clipping="bogus"), ValueError, "adaptive"),
    (dict(clipping="adaptive", max_grad_norm=[1.0]), ValueError, "positive number"),
    (dict(max_grad_norm=-1.0), ValueError, "positive"),
    (dict(loss_reduction="avg"), ValueError, "mean"),
    (dict(optimizer="sgd"), TypeError, "Optimizer"),
    (dict(module=MODULE_FOR_PARTIAL_OPT, optimizer=PARTIAL_OPT), ValueError,
     "not updated by the optimizer"),
    (dict(optimizer=torch.optim.SGD(mlp().parameters(), lr=0.1)), ValueError, "module.parameters"),
    (dict(noise_generator=torch.Generator(), grad_sample_mode="ghost_fsdp"), ValueError, "ghost"),
])
def test_bad_arguments(kw, exc, words):
    with pytest.raises(exc, match=words):
        make_compat(**kw)


def test_failed_make_private_leaves_no_hooks():
    model = mlp().double()
    # raised once the optimizer is known
    with pytest.raises(ValueError, match="one max_grad_norm per"):
        make_compat(model, clipping="per_layer", max_grad_norm=[1.0])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not any(p._backward_hooks for p in model.parameters())


def test_unsupported_layers_fail_at_make_private():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.s

    # a raw parameter: clipped by the parameter-entry tracer, batch-first only
    with pytest.raises(ValueError, match=r"1\.s(.|\n)*batch_first"):
        make_compat(nn.Sequential(nn.Linear(6, 3), Scale()).double(), batch_first=False)
    with pytest.raises(ValueError, match="LSTM"):  # Opacus' own validator: use DPLSTM
        make_compat(nn.Sequential(nn.LSTM(6, 3)).double())
    with pytest.raises(ValueError, match="batch_first=True"):
        # seq-first attention, batch-first engine
        make_compat(nn.Sequential(DPMultiheadAttention(6, 2)).double())
    # native engine: SequenceBias layout unknown
    with pytest.raises(ValueError, match="Opacus-compatible API only"):
        pe.PrivacyEngine(TinyMHA(add_bias_kv=True), batch_size=2, sample_size=4, max_grad_norm=1.0,
                         noise_multiplier=1.0)


def test_plain_backward_rejects_accumulation_under_poisson():
    module, optimizer, loader = make_compat(poisson_sampling=True)
    x, y = data_for("mlp", n=4)
    nn.functional.cross_entropy(module(x), y).backward()
    with pytest.raises(ValueError, match="Poisson"):
        nn.functional.cross_entropy(module(x), y).backward()


def test_native_engine_refuses_copies():
    """A copy would share the original's hooks and budget (tests/accounting/test_budget.py)."""
    import copy
    native = pe.PrivacyEngine(mlp(), batch_size=4, sample_size=8, max_grad_norm=1.0,
                              noise_multiplier=1.0)
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.copy(native)


def test_tied_weight_fails_at_the_first_forward():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            return nn.functional.linear(self.proj(self.emb(x)).mean(1), self.emb.weight)

    for wrap in (True, False):
        model = Tied().double()
        module, _, _ = make_compat(model, wrap_model=wrap)
        with pytest.raises(ValueError, match=r"emb\.weight"):
            (module if wrap else model)(torch.randint(0, 10, (3, 5)))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_no_records_kept_between_steps(mode):
    """After each backward every recorded activation/gradient is dropped (no growth step after
    step)."""
    out = make_compat(grad_sample_mode=mode, poisson_sampling=False)
    module, optimizer, criterion = out[0], out[1], (out[2] if len(out) == 4
                                                    else nn.CrossEntropyLoss())
    x, y = data_for("mlp", n=8)
    for _ in range(3):
        criterion(module(x), y).backward()
        assert all(not layer.calls for layer in module.recorder.layers)
        assert module.plain_backward.stored == [] and not module.plain_backward.started
        clipper = module.clipper
        assert not (clipper._kept_pairs or clipper._kept_grads or clipper._kept_groups
                    or clipper._norm_terms)
        optimizer.step()
        optimizer.zero_grad()


def test_eval_forward_with_grad_is_not_recorded():
    """Evaluation in eval mode without torch.no_grad() keeps nothing (Opacus records train mode
    only), and a training step after it is still exact."""
    module, optimizer, _ = make_compat(poisson_sampling=False)
    x, y = data_for("mlp", n=8)
    module.eval()
    for _ in range(3):
        module(x)
    assert all(not layer.calls for layer in module.recorder.layers)
    module.train()
    nn.functional.cross_entropy(module(x), y).backward()
    assert module.last_norms is not None and module.last_norms.shape == (8,)


def test_traced_and_fallback_parameters_need_batch_first_naming_them():
    """The tracer and the torch.func fallback slice samples along dim 0: with
    ``batch_first=False`` make_private names the parameters and refuses (exactness)."""
    import timm

    vit = timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=4, depth=1,
                            num_classes=3)
    with pytest.raises(ValueError, match=r"cls_token(.|\n)*pos_embed(.|\n)*batch_first"):
        make_compat(vit, batch_first=False)
    assert not any(m._forward_hooks for m in vit.modules())  # left without our hooks
    make_compat(vit)  # batch-first: clipped by the tracer (test_opacus_traced_adaptive.py)


def test_opacus_door_is_opacus_class_in_every_class_level_respect():
    """The name Opacus users import behaves as ``opacus.PrivacyEngine``: static methods,
    ``isinstance``, subclassing, pickling; the native name always needs a model."""
    import pickle

    cls = opacus_compat.PrivacyEngine
    assert issubclass(cls, opacus.PrivacyEngine) and isinstance(cls(), cls)
    assert cls().is_compatible(module=mlp(), optimizer=None, data_loader=None)
    assert isinstance(cls.get_compatible_module(mlp()), nn.Module)

    class MyEngine(cls):
        pass

    mine = MyEngine(accountant="rdp")
    assert isinstance(mine, cls) and mine.accountant.mechanism() == "rdp"
    assert type(pickle.loads(pickle.dumps(cls(accountant="gdp")))) is cls
    with pytest.raises(TypeError, match="private_engine.opacus_compat.PrivacyEngine"):
        pe.PrivacyEngine()
    with pytest.raises(TypeError, match="private_engine.opacus_compat.PrivacyEngine"):
        pe.PrivacyEngine(accountant="rdp")


# -- gradients the module did not clip are never released (Opacus raises in each case too)
def _mlp_private(cls, *, freeze_first=False, optimize_last_only=False, mode="hooks", poisson=False):
    """MLP through ``cls(...).make_private``: (model, module, optimizer, criterion, x, y) for one
    batch of 4."""
    torch.manual_seed(0)
    model = mlp().double()
    if freeze_first:
        model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[2].parameters() if optimize_last_only else model.parameters(),
                          lr=0.1)
    x, y = data_for("mlp", n=8)
    out = cls(accountant="rdp").make_private(
        module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=poisson, grad_sample_mode=mode)
    criterion = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    return model, out[0], out[1], criterion, x[:4], y[:4]


@pytest.mark.parametrize("when", ["before_backward", "after_backward", "add_param_group"])
@pytest.mark.parametrize("cls, mode",
                         [(opacus.PrivacyEngine, "hooks"), (opacus_compat.PrivacyEngine, "hooks"),
                                       (opacus_compat.PrivacyEngine, "ghost")])
def test_parameter_made_trainable_after_make_private_is_refused(cls, mode, when):
    """Opacus' optimizer recomputes its trainable parameters each step (and finds no grad_sample for
    a new one); ours must not release the raw gradient of a parameter it does not clip."""
    model, module, optimizer, criterion, x, y = _mlp_private(
        cls, freeze_first=True, mode=mode, optimize_last_only=when == "add_param_group")
    before = model[0].weight.detach().clone()

    def unfreeze():
        model[0].requires_grad_(True)
        if when == "add_param_group":
            optimizer.add_param_group({"params": list(model[0].parameters())})

    ours = cls is opacus_compat.PrivacyEngine
    match = "became trainable after make_private" if ours else None
    if when != "after_backward":
        unfreeze()
        # our backward already refuses (the new parameter has no hook discarding its raw gradient)
        if ours:
            with pytest.raises(ValueError, match=match):
                criterion(module(x), y).backward()
    else:
        criterion(module(x), y).backward()
        unfreeze()
    with pytest.raises(ValueError, match=match):  # Opacus: no grad_sample for it; ours: not clipped
        if not ours and when != "after_backward":
            criterion(module(x), y).backward()
        optimizer.step()
    assert torch.equal(model[0].weight, before)


@pytest.mark.parametrize("cls", [opacus.PrivacyEngine, opacus_compat.PrivacyEngine])
def test_step_after_a_backward_with_hooks_disabled_is_refused(cls):
    model, module, optimizer, criterion, x, y = _mlp_private(cls)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    module.disable_hooks()
    criterion(module(x), y).backward()
    with pytest.raises(ValueError,
                       match="unclipped" if cls is opacus_compat.PrivacyEngine else None):
        optimizer.step()
    assert torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), before)
    optimizer.zero_grad()  # the unclipped gradients are gone: private steps work again
    module.enable_hooks()
    criterion(module(x), y).backward()
    optimizer.step()


def test_ghost_criterion_backward_keeps_hooks_the_user_disabled():
    model, module, optimizer, criterion, x, y = _mlp_private(opacus_compat.PrivacyEngine,
                                                             mode="ghost")
    module.disable_hooks()
    criterion(module(x), y).backward()  # the wrapped criterion clips regardless
    optimizer.step()
    optimizer.zero_grad()
    assert not module._hooks_enabled and not module.recorder.capturing
    nn.functional.cross_entropy(module(x), y).backward()  # a plain backward: still unclipped
    with pytest.raises(ValueError, match="unclipped"):
        optimizer.step()


@pytest.mark.parametrize("how", ["backward_twice", "grad_then_backward", "eval_mode"])
@pytest.mark.parametrize("cls", [opacus.PrivacyEngine, opacus_compat.PrivacyEngine])
def test_backward_without_fresh_records_is_refused(cls, how):
    """A backward through records already used (retained graph, autograd.grad first) or never made
    (eval mode) is not a new batch: it must not count as an accumulated pass (mean over 2B, doubled
    sampling rate)."""
    model, module, optimizer, criterion, x, y = _mlp_private(cls)
    x = x.clone().requires_grad_(True)
    if how == "eval_mode":
        module.eval()
    loss = nn.functional.cross_entropy(module(x), y)
    if how == "backward_twice":
        loss.backward(retain_graph=True)
    elif how == "grad_then_backward":
        torch.autograd.grad(loss, x, retain_graph=True)
    ours = cls is opacus_compat.PrivacyEngine
    with pytest.raises(ValueError if ours else (ValueError, IndexError),
                       match="no recorded layer call" if ours else None):
        loss.backward()
        optimizer.step()
    if ours:
        assert module.backward_passes == (0 if how == "eval_mode" else 1)
        assert all(not layer.calls for layer in module.recorder.layers)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_refused_backward_releases_its_records(mode):
    """A backward refused at its start (here: accumulation under Poisson sampling) drops every
    record, also those of calls it did not reach."""
    model, module, optimizer, criterion, x, y = _mlp_private(opacus_compat.PrivacyEngine, mode=mode,
                                                             poisson=True)
    criterion(module(x), y).backward()
    out = module(x)
    module(x)  # a second forward, not used by the next loss
    with pytest.raises(ValueError, match="Poisson"):
        criterion(out, y).backward()
    assert all(not layer.calls for layer in module.recorder.layers)


def test_fixed_size_loader_warns_and_prv_epsilon_does_not():
    """``poisson_sampling=False`` keeps Opacus' accounting of the loader's batches as Poisson
    sampling, with a warning that this ε is no guarantee for fixed-size batches; the default PRV
    accountant's ε is Opacus' without its domain sizing's "Optimal order" warning."""
    import warnings

    from opacus.accountants import PRVAccountant

    def make(poisson):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        loader = DataLoader(TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,))),
                            batch_size=8, shuffle=True)
        engine = opacus_compat.PrivacyEngine()
        return engine, engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling=poisson)

    with pytest.warns(UserWarning, match="poisson_sampling=False.*not a guarantee"):
        make(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, _ = make(True)
        engine.accountant.history = [(1.0, 0.2, 10)]
        eps = engine.get_epsilon(1e-5)
    assert not [w for w in caught if "poisson_sampling" in str(w.message)
                or "Optimal order" in str(w.message)], [str(w.message) for w in caught]
    reference = PRVAccountant()
    reference.history = [(1.0, 0.2, 10)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert eps == reference.get_epsilon(1e-5)
