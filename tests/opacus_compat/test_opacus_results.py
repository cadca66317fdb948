"""Drop-in for Opacus: the same training script run with ``opacus.PrivacyEngine`` and with
``private_engine.PrivacyEngine`` (same seeds, a shared noise generator seed, secure_mode=False)
gives the same parameters (to 1e-5; float64 models) and the same ε.

Covered: MLP, CNN with GroupNorm, Embedding + DPLSTM text model, a small timm ViT
(cls_token/pos_embed frozen); plain ``loss.backward()`` (grad_sample_mode="hooks") and the
wrapped criterion ("ghost"); loss_reduction mean/sum; noise 0 and > 0; per-layer clipping;
Poisson sampling with an empty batch; BatchMemoryManager; checkpoint → reload → continue. The
plain and criterion flows are also checked against the float64 one-sample-at-a-time reference.

Opacus' DP layers: test_opacus_dp_layers.py; the API surface and refusals: test_opacus_api.py.
"""
from __future__ import annotations

import opacus
import pytest
import torch
from compat_cases import MODELS, TOL, assert_same_run, data_for, mlp, train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import private_engine as pe
from private_engine import opacus_compat
from reference import reference_clipped_sum

pytestmark = pytest.mark.filterwarnings("ignore")


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


@pytest.mark.slow
def test_per_layer_clipping():
    assert_same_run("mlp", mode="hooks", clipping="per_layer", noise=1.0)
    assert_same_run("lstm", mode="hooks", clipping="per_layer", noise=0.0, reduction="sum")


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_poisson_sampling_with_an_empty_batch(mode):
    sizes = assert_same_run("mlp", mode=mode, poisson=True, batch_size=2, steps=12, noise=1.0)
    assert 0 in sizes, sizes  # the fixed seed draws an empty batch


def test_poisson_rand_on_empty():
    assert_same_run("mlp", mode="hooks", poisson=True, batch_size=2, steps=12, noise=1.0,
                    rand_on_empty=True)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_batch_memory_manager(mode):
    sizes = assert_same_run("mlp", mode=mode, poisson=True, batch_size=8, physical=3, noise=1.0)
    assert max(sizes) <= 3


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_wrap_model_false(mode):
    assert_same_run("cnn_gn", mode=mode, wrap_model=False)


def test_ghost_mode_plain_backward_without_the_wrapped_criterion():
    """A plain loss.backward() is clipped in ghost mode too (book-keeping), never left unclipped."""
    ref = train(opacus.PrivacyEngine, "cnn_gn", mode="hooks", momentum=0.5)[0]
    got = train(opacus_compat.PrivacyEngine, "cnn_gn", mode="ghost", momentum=0.5,
                own_criterion=True)[0]
    assert (ref - got).abs().max().item() < TOL


@pytest.mark.parametrize("mode", sorted(set(pe.opacus_compat.GRAD_SAMPLE_MODES)
                                        - {"ghost_fsdp", "hooks", "ghost"}))
def test_every_opacus_grad_sample_mode_gives_the_same_result(mode):
    ref = train(opacus_compat.PrivacyEngine, "mlp", mode="hooks")[0]
    got = train(opacus_compat.PrivacyEngine, "mlp", mode=mode)[0]
    assert torch.equal(ref, got)


def test_make_private_with_epsilon_same_noise_as_opacus():
    x, y = data_for("mlp")
    sigmas = []
    for cls in (opacus.PrivacyEngine, opacus_compat.PrivacyEngine):
        model = mlp()
        _, opt, _ = cls(accountant="rdp").make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=4), target_epsilon=3.0,
            target_delta=1e-5, epochs=2, max_grad_norm=1.0)
        sigmas.append(opt.noise_multiplier)
    assert sigmas[0] == sigmas[1] > 0


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
    """``criterion(logits.view(-1, V), y.view(-1), shape=logits.shape)`` and ``2 * loss + 1`` as in
    Opacus."""
    results = []
    for cls in (opacus.PrivacyEngine, opacus_compat.PrivacyEngine):
        torch.manual_seed(0)
        model = TokenModel().double()
        g = torch.Generator().manual_seed(2)
        x = torch.randint(0, 12, (12, 5), generator=g)
        y = torch.randint(0, 12, (12, 5), generator=g)
        module, optimizer, criterion, loader = cls(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=4), noise_multiplier=0.5,
            max_grad_norm=0.1, criterion=nn.CrossEntropyLoss(reduction=reduction),
            loss_reduction=reduction, poisson_sampling=False, grad_sample_mode="ghost",
            noise_generator=torch.Generator().manual_seed(5))
        for xb, yb in loader:
            logits = module(xb)
            loss = criterion(logits.reshape(-1, 12), yb.reshape(-1), shape=logits.shape)
            (2 * loss + 1).backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert (results[0] - results[1]).abs().max().item() < TOL


@pytest.mark.slow
def test_dropin_example_gives_opacus_results(monkeypatch):
    """examples/opacus_dropin.py, run as is and with the import switched back to opacus. Ours
    draws its noise and Poisson batches from generators seeded from OS entropy where Opacus uses
    torch's global generator: given that one instead, the results are Opacus' own."""
    import importlib.util
    from pathlib import Path

    import private_engine.opacus_compat.engine as compat_engine
    path = Path(__file__).resolve().parents[2] / "examples" / "opacus_dropin.py"
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


# -- exactness against the float64 sample-by-sample reference --------------------------------------
def ref_abadi(norms, R):
    return torch.clamp(R / (norms + 1e-6), max=1.0)


@pytest.mark.parametrize("name", ["lstm", "gru", "mha", "cnn_gn", "seq_first", "seq_first_bias_kv",
                                  "mha_bias_kv"])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_clipped_sum_matches_reference(name, mode, reduction):
    """One step, noise 0, SGD lr=1: θ_before − θ_after = (Σ_i C_i g_i) / B (mean) or Σ_i C_i g_i
    (sum)."""
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
                              data_loader=DataLoader(TensorDataset(x, y), batch_size=6),
                              noise_multiplier=0.0, max_grad_norm=R, loss_reduction=reduction,
                              poisson_sampling=False, grad_sample_mode=mode,
                              criterion=nn.CrossEntropyLoss(reduction=reduction),
                              batch_first=not name.startswith("seq_first"))
    module, optimizer, criterion = out[0], out[1], (
        out[2] if len(out) == 4 else nn.CrossEntropyLoss(reduction=reduction))
    criterion(module(x), y).backward()
    torch.testing.assert_close(module.last_norms, norms, rtol=1e-9, atol=0)
    optimizer.step()
    scale = 6 if reduction == "mean" else 1
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    for got, want in zip([(b - a) * scale for b, a in zip(before, after)], expected):
        # atol: MHA's key bias has zero gradient
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


# -- checkpoints -----------------------------------------------------------------------------------
def _run_with_checkpoint(tmp_path, split, total, mode):
    def build():
        torch.manual_seed(0)
        model = mlp().double()
        x, y = data_for("mlp")
        engine = opacus_compat.PrivacyEngine(accountant="prv")
        out = engine.make_private(module=model,
                                  optimizer=torch.optim.SGD(model.parameters(), lr=0.3,
                                                            momentum=0.9),
                                  data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
                                  noise_multiplier=1.0, max_grad_norm=0.1, poisson_sampling=False,
                                  grad_sample_mode=mode,
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
