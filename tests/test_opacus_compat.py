"""Drop-in for Opacus: the same training script run with ``opacus.PrivacyEngine`` and with
``private_engine.PrivacyEngine`` (same seeds, a shared noise generator seed, secure_mode=False)
gives the same parameters (to 1e-5; float64 models) and the same ε.

Covered: MLP, CNN with GroupNorm, Embedding + DPLSTM text model, a small timm ViT
(cls_token/pos_embed frozen); plain ``loss.backward()`` (grad_sample_mode="hooks") and the
wrapped criterion ("ghost"); loss_reduction mean/sum; noise 0 and > 0; per-layer clipping;
Poisson sampling with an empty batch; BatchMemoryManager; checkpoint → reload → continue. The
plain and criterion flows are also checked against the float64 one-sample-at-a-time reference.
"""
from __future__ import annotations


import opacus
import pytest
import torch
from opacus.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import private_engine as pe
from private_engine import opacus_compat
from private_engine.opacus_compat import PrivateModule
from reference import reference_clipped_sum

pytestmark = pytest.mark.filterwarnings("ignore")
TOL = 1e-5


# -- models (float64, tiny) ------------------------------------------------------------------------
class TextLSTM(nn.Module):
    def __init__(self, vocab=20, emb=6, hidden=5, classes=3, rnn=DPLSTM):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.lstm = rnn(emb, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, x):
        h, _ = self.lstm(self.emb(x))
        return self.fc(h[:, -1])


class TinyMHA(nn.Module):
    def __init__(self, dim=8, classes=3, add_bias_kv=False):
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.attn = DPMultiheadAttention(dim, 2, batch_first=True, add_bias_kv=add_bias_kv)
        self.fc = nn.Linear(dim, classes)

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.attn(h, h, h)
        return self.fc(a.mean(1))


class SeqFirstText(nn.Module):
    """Every layer but the LSTM's per-step linear maps sees (T, B, ·): for make_private(batch_first=False)."""

    def __init__(self, vocab=20, emb=6, hidden=5, classes=3, add_bias_kv=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.lstm = DPLSTM(emb, hidden, batch_first=False)
        self.attn = DPMultiheadAttention(hidden, 1, batch_first=False, add_bias_kv=add_bias_kv)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, x):  # x: (B, T) from the loader
        h, _ = self.lstm(self.emb(x.t()))
        h, _ = self.attn(h, h, h)
        return self.fc(h)[-1]


def mlp():
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def cnn_gn():
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2),
                         nn.Flatten(), nn.Linear(4 * 2 * 2, 3))


def vit():
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=4, depth=1, embed_dim=8, num_heads=2,
                              num_classes=3)
    model.cls_token.requires_grad_(False)  # rules for these come from another branch
    model.pos_embed.requires_grad_(False)
    return model


def data_for(name, n=24):
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 3, (n,), generator=g)
    if name == "mlp":
        x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    elif name == "cnn_gn":
        x = torch.randn(n, 2, 6, 6, generator=g, dtype=torch.float64)
    elif name in ("lstm", "gru", "rnn", "seq_first", "seq_first_bias_kv"):
        x = torch.randint(0, 20, (n, 5), generator=g)
    elif name == "vit":
        x = torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64)
    else:  # mha, mha_bias_kv
        x = torch.randn(n, 4, 4, generator=g, dtype=torch.float64)
    return x, y


MODELS = {"mlp": mlp, "cnn_gn": cnn_gn, "lstm": TextLSTM, "vit": vit, "mha": TinyMHA,
          "gru": lambda: TextLSTM(rnn=DPGRU), "rnn": lambda: TextLSTM(rnn=DPRNN), "seq_first": SeqFirstText,
          "seq_first_bias_kv": lambda: SeqFirstText(add_bias_kv=True), "mha_bias_kv": lambda: TinyMHA(add_bias_kv=True)}


def train(engine_cls, name, *, mode="hooks", reduction="mean", noise=1.0, clipping="flat", steps=3, batch_size=8,
          poisson=False, momentum=0.0, physical=None, R=None, own_criterion=False, dtype=torch.float64,
          wrap_model=True, batch_first=True, clip_gamma=None, rand_on_empty=False):
    """Run the Opacus loop; return (flat parameters, ε at δ=1e-5, engine)."""
    torch.manual_seed(0)
    model = MODELS[name]().to(dtype)
    x, y = data_for(name)
    x = x.to(dtype) if x.is_floating_point() else x
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=momentum)
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    if R is None:
        R = 0.1 if clipping == "flat" else [0.05] * n_params
    engine = engine_cls(accountant="rdp")
    criterion = nn.CrossEntropyLoss(reduction=reduction)
    out = engine.make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=noise,
                              max_grad_norm=R, loss_reduction=reduction, poisson_sampling=poisson,
                              grad_sample_mode=mode, criterion=criterion, clipping=clipping,
                              noise_generator=torch.Generator().manual_seed(7), wrap_model=wrap_model,
                              batch_first=batch_first, rand_on_empty=rand_on_empty)
    if len(out) == 4:
        module, optimizer, wrapped, loader = out
        criterion = criterion if own_criterion else wrapped
    else:
        module, optimizer, loader = out
    if not wrap_model:
        module = model  # the returned object only holds the hooks
    scheduler = None
    if clip_gamma is not None:  # Opacus' grad-clip scheduler changes optimizer.max_grad_norm every step
        from opacus.schedulers import ExponentialGradClip
        scheduler = ExponentialGradClip(optimizer, gamma=clip_gamma)
    torch.manual_seed(3)  # Poisson sampling draws from the global generator
    done, sizes = 0, []
    while done < steps:
        if physical:
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical,
                                    optimizer=optimizer) as mem_loader:
                for xb, yb in mem_loader:
                    sizes.append(len(yb))
                    loss = criterion(module(xb), yb)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
            done = steps
            continue
        for xb, yb in loader:
            if done >= steps:
                break
            sizes.append(len(yb))
            loss = criterion(module(xb), yb)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
            done += 1
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    eps = engine.get_epsilon(1e-5) if noise > 0 else 0.0
    return flat, eps, engine, sizes


def assert_same_run(name, **kw):
    a, eps_a, _, sizes_a = train(opacus.PrivacyEngine, name, **kw)
    b, eps_b, engine, sizes_b = train(opacus_compat.PrivacyEngine, name, **kw)
    assert isinstance(engine, opacus_compat.PrivacyEngine)
    assert sizes_a == sizes_b
    diff = (a - b).abs().max().item()
    assert diff < TOL, f"{name} {kw}: parameters differ by {diff:.2e}"
    assert eps_a == eps_b
    torch.manual_seed(0)
    start = torch.cat([p.detach().flatten() for p in MODELS[name]().to(kw.get("dtype", torch.float64)).parameters()])
    assert (b - start).abs().max().item() > 100 * TOL  # training moved the parameters
    return sizes_b


@pytest.mark.parametrize("name", ["mlp", "cnn_gn", "lstm", "vit"])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_same_parameters_and_epsilon_as_opacus(name, mode):
    assert_same_run(name, mode=mode, reduction="mean", noise=1.0)


@pytest.mark.parametrize("name", ["lstm", "vit"])
def test_float32_models(name):
    assert_same_run(name, mode="hooks", noise=1.0, dtype=torch.float32)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_reductions_and_noise(mode, reduction, noise):
    assert_same_run("cnn_gn", mode=mode, reduction=reduction, noise=noise)


@pytest.mark.parametrize("name", ["lstm", "gru", "rnn", "mha"])
def test_opacus_dp_layers_sum_reduction(name):
    assert_same_run(name, mode="hooks", reduction="sum", noise=0.5)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_grad_clip_scheduler(mode):
    """Opacus' ExponentialGradClip changes optimizer.max_grad_norm: our clipping follows it in both
    flows, as Opacus "hooks" does (Opacus "ghost" keeps clipping at the initial R while the noise
    follows the schedule, so both are compared with Opacus "hooks")."""
    theirs = train(opacus.PrivacyEngine, "mlp", mode="hooks", clip_gamma=0.5)
    ours = train(opacus_compat.PrivacyEngine, "mlp", mode=mode, clip_gamma=0.5)
    fixed = train(opacus_compat.PrivacyEngine, "mlp", mode=mode)
    assert (theirs[0] - ours[0]).abs().max().item() < TOL
    assert (fixed[0] - ours[0]).abs().max().item() > 100 * TOL  # the schedule mattered


def test_per_layer_clipping():
    assert_same_run("mlp", mode="hooks", clipping="per_layer", noise=1.0)
    assert_same_run("lstm", mode="hooks", clipping="per_layer", noise=0.0, reduction="sum")


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_poisson_sampling_with_an_empty_batch(mode):
    sizes = assert_same_run("mlp", mode=mode, poisson=True, batch_size=2, steps=12, noise=1.0)
    assert 0 in sizes, sizes  # the fixed seed draws an empty batch


def test_poisson_rand_on_empty():
    assert_same_run("mlp", mode="hooks", poisson=True, batch_size=2, steps=12, noise=1.0, rand_on_empty=True)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_batch_memory_manager(mode):
    sizes = assert_same_run("mlp", mode=mode, poisson=True, batch_size=8, physical=3, noise=1.0)
    assert max(sizes) <= 3


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_batch_first_false(mode, reduction):
    assert_same_run("seq_first", mode=mode, reduction=reduction, batch_first=False)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_sequence_bias_add_bias_kv(mode):
    assert_same_run("seq_first_bias_kv", mode=mode, batch_first=False)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_wrap_model_false(mode):
    assert_same_run("cnn_gn", mode=mode, wrap_model=False)


def test_ghost_mode_plain_backward_without_the_wrapped_criterion():
    """A plain loss.backward() is clipped in ghost mode too (book-keeping), never left unclipped."""
    ref = train(opacus.PrivacyEngine, "cnn_gn", mode="hooks", momentum=0.5)[0]
    got = train(opacus_compat.PrivacyEngine, "cnn_gn", mode="ghost", momentum=0.5, own_criterion=True)[0]
    assert (ref - got).abs().max().item() < TOL


@pytest.mark.parametrize("mode", sorted(set(pe.opacus_compat.GRAD_SAMPLE_MODES) - {"ghost_fsdp", "hooks", "ghost"}))
def test_every_opacus_grad_sample_mode_gives_the_same_result(mode):
    ref = train(opacus_compat.PrivacyEngine, "mlp", mode="hooks")[0]
    got = train(opacus_compat.PrivacyEngine, "mlp", mode=mode)[0]
    assert torch.equal(ref, got)


# -- exactness against the float64 sample-by-sample reference ---------------------------------------
def ref_abadi(norms, R):
    return torch.clamp(R / (norms + 1e-6), max=1.0)


@pytest.mark.parametrize("name", ["lstm", "gru", "mha", "cnn_gn", "seq_first", "seq_first_bias_kv", "mha_bias_kv"])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_clipped_sum_matches_reference(name, mode, reduction):
    """One step, noise 0, SGD lr=1: θ_before − θ_after = (Σ_i C_i g_i) / B (mean) or Σ_i C_i g_i (sum)."""
    torch.manual_seed(0)
    model = MODELS[name]().double()
    x, y = data_for(name, n=6)
    def loss_fn(m, xi, yi):
        return nn.functional.cross_entropy(m(xi), yi, reduction="none")
    _, norms = reference_clipped_sum(model, [x, y], loss_fn, 1.0, ref_abadi)
    R = norms.median().item()
    expected, _ = reference_clipped_sum(model, [x, y], loss_fn, R, ref_abadi)
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    engine = opacus_compat.PrivacyEngine()
    out = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                              data_loader=DataLoader(TensorDataset(x, y), batch_size=6), noise_multiplier=0.0,
                              max_grad_norm=R, loss_reduction=reduction, poisson_sampling=False,
                              grad_sample_mode=mode, criterion=nn.CrossEntropyLoss(reduction=reduction),
                              batch_first=not name.startswith("seq_first"))
    module, optimizer, criterion = out[0], out[1], (out[2] if len(out) == 4 else nn.CrossEntropyLoss(reduction=reduction))
    criterion(module(x), y).backward()
    torch.testing.assert_close(module.last_norms, norms, rtol=1e-9, atol=0)
    optimizer.step()
    scale = 6 if reduction == "mean" else 1
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    for got, want in zip([(b - a) * scale for b, a in zip(before, after)], expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)  # atol: MHA's key bias has zero gradient


# -- checkpoints -------------------------------------------------------------------------------------
def _run_with_checkpoint(tmp_path, split, total, mode):
    def build():
        torch.manual_seed(0)
        model = mlp().double()
        x, y = data_for("mlp")
        engine = opacus_compat.PrivacyEngine(accountant="prv")
        out = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9),
                                  data_loader=DataLoader(TensorDataset(x, y), batch_size=4), noise_multiplier=1.0,
                                  max_grad_norm=0.1, poisson_sampling=False, grad_sample_mode=mode,
                                  noise_generator=torch.Generator().manual_seed(11))
        return engine, out

    engine, out = build()
    module, optimizer, loader = out[0], out[1], out[-1]
    criterion = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    batches = list(loader)
    for step in range(total):
        if step == split:
            path = tmp_path / "ckpt.pt"
            engine.save_checkpoint(path=path, module=module, optimizer=optimizer)
            engine, out = build()  # a fresh process would start here
            module, optimizer = out[0], out[1]
            criterion = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(1.0)  # garbage, overwritten by the checkpoint
            engine.load_checkpoint(path=path, module=module, optimizer=optimizer)
        xb, yb = batches[step % len(batches)]
        criterion(module(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in module.parameters()]), engine.get_epsilon(1e-5)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_checkpoint_reload_continue(tmp_path, mode):
    straight, eps_straight = _run_with_checkpoint(tmp_path, split=-1, total=5, mode=mode)
    resumed, eps_resumed = _run_with_checkpoint(tmp_path, split=2, total=5, mode=mode)
    assert torch.equal(straight, resumed)
    assert eps_straight == eps_resumed > 0


# -- API surface and bad input ------------------------------------------------------------------------
def _make(model=None, **kw):
    model = model if model is not None else mlp().double()
    x, y = data_for("mlp", n=8)
    args = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=DataLoader(TensorDataset(x, y), batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0)
    args.update(kw)
    return opacus_compat.PrivacyEngine().make_private(**args)


def test_returns_like_opacus():
    engine = opacus_compat.PrivacyEngine(accountant="gdp", secure_mode=False)
    assert isinstance(engine, opacus.PrivacyEngine) and engine.accountant.mechanism() == "gdp"
    model = mlp().double()
    module, optimizer, loader = _make(model)
    assert isinstance(module, PrivateModule) and module._module is model
    assert isinstance(optimizer, opacus.optimizers.DPOptimizer)
    assert isinstance(loader, opacus.data_loader.DPDataLoader)
    assert set(module.state_dict()) == {"_module." + k for k in model.state_dict()}
    assert len(_make(grad_sample_mode="ghost")) == 4
    # the native form is untouched
    native = pe.PrivacyEngine(mlp(), batch_size=4, sample_size=8, max_grad_norm=1.0, noise_multiplier=1.0)
    assert type(native) is pe.PrivacyEngine


def test_make_private_with_epsilon_same_noise_as_opacus():
    x, y = data_for("mlp")
    sigmas = []
    for cls in (opacus.PrivacyEngine, opacus_compat.PrivacyEngine):
        model = mlp()
        _, opt, _ = cls(accountant="rdp").make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=4), target_epsilon=3.0, target_delta=1e-5,
            epochs=2, max_grad_norm=1.0)
        sigmas.append(opt.noise_multiplier)
    assert sigmas[0] == sigmas[1] > 0


MODULE_FOR_PARTIAL_OPT = mlp()
PARTIAL_OPT = torch.optim.SGD(MODULE_FOR_PARTIAL_OPT[0].parameters(), lr=0.1)


@pytest.mark.parametrize("kw, exc, words", [
    (dict(grad_sample_mode="bogus"), ValueError, "grad_sample_mode"),
    (dict(clipping="per_layer"), ValueError, "one per"),
    (dict(clipping="per_layer", max_grad_norm=[1.0]), ValueError, "one max_grad_norm per"),
    (dict(clipping="per_layer", grad_sample_mode="ghost", max_grad_norm=[1.0] * 4), ValueError, "hooks"),
    (dict(clipping="adaptive"), ValueError, "flat"),
    (dict(max_grad_norm=-1.0), ValueError, "positive"),
    (dict(loss_reduction="avg"), ValueError, "mean"),
    (dict(optimizer="sgd"), TypeError, "Optimizer"),
    (dict(module=MODULE_FOR_PARTIAL_OPT, optimizer=PARTIAL_OPT), ValueError, "not updated by the optimizer"),
    (dict(optimizer=torch.optim.SGD(mlp().parameters(), lr=0.1)), ValueError, "module.parameters"),
    (dict(noise_generator=torch.Generator(), grad_sample_mode="ghost_fsdp"), ValueError, "ghost"),
])
def test_bad_arguments(kw, exc, words):
    with pytest.raises(exc, match=words):
        _make(**kw)


def test_failed_make_private_leaves_no_hooks():
    model = mlp().double()
    with pytest.raises(ValueError, match="one max_grad_norm per"):  # raised once the optimizer is known
        _make(model, clipping="per_layer", max_grad_norm=[1.0])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not any(p._backward_hooks for p in model.parameters())


def test_unsupported_trainable_layer_fails_at_make_private():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.s

    with pytest.raises(ValueError, match=r"Scale: 1\.s(.|\n)*native API"):
        _make(nn.Sequential(nn.Linear(6, 3), Scale()).double())
    with pytest.raises(ValueError, match="LSTM"):  # Opacus' own validator: use DPLSTM
        _make(nn.Sequential(nn.LSTM(6, 3)).double())
    with pytest.raises(ValueError, match="batch_first=True"):
        _make(nn.Sequential(DPMultiheadAttention(6, 2)).double())  # seq-first attention, batch-first engine
    with pytest.raises(ValueError, match="Opacus-compatible API only"):  # native engine: SequenceBias layout unknown
        pe.PrivacyEngine(TinyMHA(add_bias_kv=True), batch_size=2, sample_size=4, max_grad_norm=1.0,
                         noise_multiplier=1.0)


def test_plain_backward_rejects_accumulation_under_poisson():
    module, optimizer, loader = _make(poisson_sampling=True)
    x, y = data_for("mlp", n=4)
    nn.functional.cross_entropy(module(x), y).backward()
    with pytest.raises(ValueError, match="Poisson"):
        nn.functional.cross_entropy(module(x), y).backward()


def test_dropin_example_gives_opacus_results(monkeypatch):
    """examples/opacus_dropin.py, run as is and with the import switched back to opacus. Ours
    draws its noise and Poisson batches from generators seeded from OS entropy where Opacus uses
    torch's global generator: given that one instead, the results are Opacus' own."""
    import importlib.util
    from pathlib import Path

    import private_engine.opacus_compat.engine as compat_engine
    path = Path(__file__).resolve().parents[1] / "examples" / "opacus_dropin.py"
    spec = importlib.util.spec_from_file_location("opacus_dropin", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.PrivacyEngine is opacus_compat.PrivacyEngine
    secret = example.main(["--epochs", "1", "--samples", "192", "--accountant", "rdp"])
    monkeypatch.setattr(compat_engine, "entropy_seeded_generator",
                        lambda device="cpu": torch.default_generator)
    ours = example.main(["--epochs", "1", "--samples", "192", "--accountant", "rdp"])
    monkeypatch.undo()
    monkeypatch.setattr(example, "PrivacyEngine", opacus.PrivacyEngine)
    theirs = example.main(["--epochs", "1", "--samples", "192", "--accountant", "rdp"])
    assert secret[1] == ours[1] == theirs[1] > 0
    assert abs(ours[0] - theirs[0]) < 1e-6


def test_packed_sequence_is_rejected_clearly():
    model = TextLSTM().double()
    module, _, _ = _make(model)
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(3, 4, 6, dtype=torch.float64), [4, 2, 1],
                                               batch_first=True)
    with pytest.raises(TypeError, match="pad_packed_sequence"):
        model.lstm(packed)


def test_native_engine_survives_copy():
    import copy
    native = pe.PrivacyEngine(mlp(), batch_size=4, sample_size=8, max_grad_norm=1.0, noise_multiplier=1.0)
    assert type(copy.copy(native)) is pe.PrivacyEngine


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
        module, _, _ = _make(model, wrap_model=wrap)
        with pytest.raises(ValueError, match=r"emb\.weight"):
            (module if wrap else model)(torch.randint(0, 10, (3, 5)))


class TokenModel(nn.Module):
    """Per-token logits (B, T, V) for the criterion's ``shape=`` argument (generative models)."""

    def __init__(self, vocab=12, dim=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x):
        return self.out(torch.tanh(self.emb(x)))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ghost_criterion_shape_argument_and_loss_arithmetic(reduction):
    """``criterion(logits.view(-1, V), y.view(-1), shape=logits.shape)`` and ``2 * loss + 1`` as in Opacus."""
    results = []
    for cls in (opacus.PrivacyEngine, opacus_compat.PrivacyEngine):
        torch.manual_seed(0)
        model = TokenModel().double()
        g = torch.Generator().manual_seed(2)
        x = torch.randint(0, 12, (12, 5), generator=g)
        y = torch.randint(0, 12, (12, 5), generator=g)
        module, optimizer, criterion, loader = cls(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=4), noise_multiplier=0.5, max_grad_norm=0.1,
            criterion=nn.CrossEntropyLoss(reduction=reduction), loss_reduction=reduction, poisson_sampling=False,
            grad_sample_mode="ghost", noise_generator=torch.Generator().manual_seed(5))
        for xb, yb in loader:
            logits = module(xb)
            loss = criterion(logits.reshape(-1, 12), yb.reshape(-1), shape=logits.shape)
            (2 * loss + 1).backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert (results[0] - results[1]).abs().max().item() < TOL


@pytest.mark.parametrize("name", ["lstm", "gru", "rnn", "mha"])
@pytest.mark.parametrize("mode", ["mixed", "ghost", "per_sample"])
def test_native_engine_with_opacus_dp_layers(name, mode):
    """Opacus' DP layers through the native API (``PrivacyEngine(model, ...)``) against the reference."""
    from engine_checks import check_against_reference
    torch.manual_seed(0)
    model = MODELS[name]().double()
    if name == "mha":  # softmax is shift-invariant: the key bias has an exactly zero gradient (relative error undefined)
        model.attn.klinear.bias.requires_grad_(False)
    x, y = data_for(name, n=5)
    check_against_reference(model, [x, y], lambda m, xi, yi: nn.functional.cross_entropy(m(xi), yi, reduction="none"),
                            mode=mode, clip="abadi")


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_no_records_kept_between_steps(mode):
    """After each backward every recorded activation/gradient is dropped (no growth step after step)."""
    out = _make(grad_sample_mode=mode, poisson_sampling=False)
    module, optimizer, criterion = out[0], out[1], (out[2] if len(out) == 4 else nn.CrossEntropyLoss())
    x, y = data_for("mlp", n=8)
    for _ in range(3):
        criterion(module(x), y).backward()
        assert all(not layer.calls for layer in module.recorder.layers)
        assert module._stored == [] and not module._started
        clipper = module.clipper
        assert not (clipper._kept_pairs or clipper._kept_grads or clipper._kept_groups
                    or clipper._norm_terms)
        optimizer.step()
        optimizer.zero_grad()


def test_eval_forward_with_grad_is_not_recorded():
    """Evaluation in eval mode without torch.no_grad() keeps nothing (Opacus records train mode only),
    and a training step after it is still exact."""
    module, optimizer, _ = _make(poisson_sampling=False)
    x, y = data_for("mlp", n=8)
    module.eval()
    for _ in range(3):
        module(x)
    assert all(not layer.calls for layer in module.recorder.layers)
    module.train()
    nn.functional.cross_entropy(module(x), y).backward()
    assert module.last_norms is not None and module.last_norms.shape == (8,)


def test_make_private_refuses_parameters_that_need_the_tracer_naming_them():
    import timm

    vit = timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=4, depth=1, num_classes=3)
    with pytest.raises(ValueError, match=r"cls_token(.|\n)*pos_embed(.|\n)*native API"):
        _make(vit)
    from timm.layers import LayerNorm2d  # overrides LayerNorm's forward: torch.func fallback in the native engine

    cnn = nn.Sequential(nn.Conv2d(1, 4, 3), LayerNorm2d(4), nn.Flatten(), nn.LazyLinear(3))
    cnn(torch.zeros(1, 1, 6, 6))
    with pytest.raises(ValueError, match=r"LayerNorm2d: 1 \(torch.func fallback\)(.|\n)*native API"):
        _make(cnn)


# -- gradients the module did not clip are never released (Opacus raises in each case too) ----------------------
def _mlp_private(cls, *, freeze_first=False, optimize_last_only=False, mode="hooks", poisson=False):
    """MLP through ``cls(...).make_private``: (model, module, optimizer, criterion, x, y) for one batch of 4."""
    torch.manual_seed(0)
    model = mlp().double()
    if freeze_first:
        model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[2].parameters() if optimize_last_only else model.parameters(), lr=0.1)
    x, y = data_for("mlp", n=8)
    out = cls(accountant="rdp").make_private(
        module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=poisson, grad_sample_mode=mode)
    criterion = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    return model, out[0], out[1], criterion, x[:4], y[:4]


@pytest.mark.parametrize("when", ["before_backward", "after_backward", "add_param_group"])
@pytest.mark.parametrize("cls, mode", [(opacus.PrivacyEngine, "hooks"), (opacus_compat.PrivacyEngine, "hooks"),
                                       (opacus_compat.PrivacyEngine, "ghost")])
def test_parameter_made_trainable_after_make_private_is_refused(cls, mode, when):
    """Opacus' optimizer recomputes its trainable parameters each step (and finds no grad_sample for a new one);
    ours must not release the raw gradient of a parameter it does not clip."""
    model, module, optimizer, criterion, x, y = _mlp_private(cls, freeze_first=True, mode=mode,
                                                             optimize_last_only=when == "add_param_group")
    before = model[0].weight.detach().clone()

    def unfreeze():
        model[0].requires_grad_(True)
        if when == "add_param_group":
            optimizer.add_param_group({"params": list(model[0].parameters())})

    ours = cls is opacus_compat.PrivacyEngine
    match = "became trainable after make_private" if ours else None
    if when != "after_backward":
        unfreeze()
        if ours:  # our backward already refuses (the new parameter has no hook discarding its raw gradient)
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
    with pytest.raises(ValueError, match="unclipped" if cls is opacus_compat.PrivacyEngine else None):
        optimizer.step()
    assert torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), before)
    optimizer.zero_grad()  # the unclipped gradients are gone: private steps work again
    module.enable_hooks()
    criterion(module(x), y).backward()
    optimizer.step()


def test_ghost_criterion_backward_keeps_hooks_the_user_disabled():
    model, module, optimizer, criterion, x, y = _mlp_private(opacus_compat.PrivacyEngine, mode="ghost")
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
    """A backward through records already used (retained graph, autograd.grad first) or never made (eval mode)
    is not a new batch: it must not count as an accumulated pass (mean over 2B, doubled sampling rate)."""
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
    with pytest.raises(ValueError if ours else (ValueError, IndexError), match="no recorded layer call" if ours else None):
        loss.backward()
        optimizer.step()
    if ours:
        assert module.backward_passes == (0 if how == "eval_mode" else 1)
        assert all(not layer.calls for layer in module.recorder.layers)


def test_make_private_leaves_no_mark_on_sequence_bias():
    """The mark that lets SequenceBiasRule accept a module exists during make_private's check only: the native
    engine (which does not move SequenceBias' tensors to batch-first) still refuses the model afterwards."""
    from opacus.layers.dp_multihead_attention import SequenceBias
    from private_engine.layers.sequence_bias import PREPARED

    model = TinyMHA(add_bias_kv=True).double()
    biases = [m for m in model.modules() if isinstance(m, SequenceBias)]
    with pytest.raises(ValueError, match="batch_first"):  # fails after the layer validation
        _make(model, batch_first=False)
    assert biases and not any(hasattr(m, PREPARED) for m in biases)
    module, _, _ = _make(model)
    assert not any(hasattr(m, PREPARED) for m in biases)
    module.remove_hooks()
    with pytest.raises(ValueError, match="Opacus-compatible API only"):
        pe.PrivacyEngine(model, batch_size=2, sample_size=4, max_grad_norm=1.0, noise_multiplier=1.0)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_refused_backward_releases_its_records(mode):
    """A backward refused at its start (here: accumulation under Poisson sampling) drops every record, also
    those of calls it did not reach."""
    model, module, optimizer, criterion, x, y = _mlp_private(opacus_compat.PrivacyEngine, mode=mode, poisson=True)
    criterion(module(x), y).backward()
    out = module(x)
    module(x)  # a second forward, not used by the next loss
    with pytest.raises(ValueError, match="Poisson"):
        criterion(out, y).backward()
    assert all(not layer.calls for layer in module.recorder.layers)


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
