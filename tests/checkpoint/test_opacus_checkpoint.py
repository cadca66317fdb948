"""Checkpoints of the Opacus-compatible door (private_engine.opacus_compat.PrivacyEngine) under
the same adversary: no default generator state in the file, fresh noise after a resume, and ε
counting the steps a killed run released after its checkpoint (the step ledger, recorded by the
optimizer's accountant hook before each update)."""
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from private_engine import opacus_compat
from private_engine.accounting.ledger import read_ledger

N, D_IN, D_OUT, B, SIGMA, R, LR = 256, 32, 16, 32, 1.0, 1.0, 0.5


def _build(noise_generator=None):
    torch.manual_seed(1)
    model = nn.Linear(D_IN, D_OUT, bias=False)
    gen = torch.Generator().manual_seed(0)
    x = 1e-4 * torch.randn(N, D_IN, generator=gen)  # clipped gradients ~1e-4, noise ~1
    y = torch.randint(0, D_OUT, (N,), generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus: "Secure RNG turned off"
        engine = opacus_compat.PrivacyEngine(accountant="rdp")
        module, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=B), noise_multiplier=SIGMA,
            max_grad_norm=R, noise_generator=noise_generator)
    return engine, module, optimizer, loader


def _train(module, optimizer, loader, steps, seen):
    batches = iter(loader)
    for _ in range(steps):
        x, y = next(batches)
        nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.append(torch.cat([p.detach().flatten() for p in module.parameters()]))


def test_killed_and_resumed_compat_run(tmp_path):
    """Killed run: 3 steps, checkpoint, 3 more. Resumed run: from the checkpoint. The file holds
    no generator state; the first steps after the checkpoint differ by fresh noise; ε after the
    load is the killed run's."""
    path = tmp_path / "ckpt.pt"
    engine, module, optimizer, loader = _build()
    killed = []
    _train(module, optimizer, loader, 3, killed)
    engine.save_checkpoint(path=path, module=module, optimizer=optimizer)
    _train(module, optimizer, loader, 3, killed)
    saved = torch.load(path, weights_only=False)
    assert "noise_generator_state" not in saved
    assert read_ledger(str(path) + ".ledger").steps == 6

    engine2, module2, optimizer2, loader2 = _build()
    engine2.load_checkpoint(path=path, module=module2, optimizer=optimizer2)
    assert engine2.accountant.history == engine.accountant.history
    assert engine2.get_epsilon(1e-5) == engine.get_epsilon(1e-5) > 0
    resumed = []
    _train(module2, optimizer2, loader2, 1, resumed)
    diff = killed[3] - resumed[0]
    ratio = float(diff.square().mean().sqrt()) / (math.sqrt(2) * LR * SIGMA * R / B)
    assert 0.85 < ratio < 1.15, ratio
    assert read_ledger(str(path) + ".ledger").steps == 7  # the resumed run records too


def test_compat_missing_ledger_is_refused_and_given_generator_kept(tmp_path):
    path = tmp_path / "ckpt.pt"
    engine, module, optimizer, loader = _build(noise_generator=torch.Generator().manual_seed(3))
    _train(module, optimizer, loader, 2, [])
    engine.save_checkpoint(path=path, module=module, optimizer=optimizer)
    assert "noise_generator_state" in torch.load(path, weights_only=False)
    (tmp_path / "ckpt.pt.ledger").unlink()
    engine2, module2, optimizer2, _ = _build(noise_generator=torch.Generator().manual_seed(4))
    before = [p.detach().clone() for p in module2.parameters()]
    with pytest.raises(ValueError, match="ledger of this checkpoint is missing"):
        engine2.load_checkpoint(path=path, module=module2, optimizer=optimizer2)
    assert all(torch.equal(p, q) for p, q in zip(before, module2.parameters()))
    engine2.load_checkpoint(path=path, module=module2, optimizer=optimizer2, ledger=False)
    assert engine2.accountant.history == engine.accountant.history
    assert torch.equal(optimizer2.generator.get_state(), optimizer.generator.get_state())
