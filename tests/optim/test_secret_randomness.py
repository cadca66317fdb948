"""The randomness that differential privacy needs secret — Gaussian noise and Poisson batch
membership (privacy amplification by subsampling assumes the batches are unknown) — does not come
from torch's global generator, which scripts seed publicly with ``torch.manual_seed``: two runs of
the same publicly seeded script draw different noise and different batches. An explicit seeded
generator still reproduces them (tests, debugging).

Covered: ``private_engine.data.poisson_loader``, ``private_engine.heads.warmup_finetune`` (centres'
noise, Poisson batches, DP-SGD noise) and the Opacus-compatible ``make_private`` (noise and
``DPDataLoader`` sampling).
"""
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import private_engine.data
from private_engine import opacus_compat
from private_engine.data import poisson_loader
from private_engine.heads.warmup import warmup_finetune
from private_engine.optim.noise import ReproducibleNoiseWarning

pytestmark = pytest.mark.usefixtures("one_thread")

N = 64



def _members(loader, batches: int = 6):
    """The dataset indices (the first tensor holds ``arange``) of the first ``batches`` batches."""
    out = []
    for batch in loader:
        out.append(sorted(int(i) for i in batch[0].flatten()))
        if len(out) == batches:
            break
    return out


# -- poisson_loader ------------------------------------------------------------------------------
def test_poisson_loader_batches_are_secret_unless_a_generator_is_given():
    dataset = TensorDataset(torch.arange(N))
    runs = []
    for _ in range(2):
        torch.manual_seed(0)  # the public seed of a typical script
        runs.append(_members(poisson_loader(dataset, 8)))
    assert runs[0] != runs[1]
    seeded = [_members(poisson_loader(dataset, 8, generator=torch.Generator().manual_seed(5)))
              for _ in range(2)]
    assert seeded[0] == seeded[1]


# -- warmup_finetune -----------------------------------------------------------------------------
class _Recording:
    """A loader that records the inputs of the batches it yields (Poisson membership)."""

    def __init__(self, loader):
        self.loader, self.batches = loader, []

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            self.batches.append(sorted(batch[0][:, 0].tolist()))
            yield batch


def _warmup_run(monkeypatch, **kw):
    """One warm-up epoch on 60 examples: (centres, batches, trained parameters)."""
    recorded = []

    def recording_loader(*args, **kwargs):
        recorded.append(_Recording(real_loader(*args, **kwargs)))
        return recorded[-1]

    real_loader = private_engine.data.poisson_loader
    monkeypatch.setattr(private_engine.data, "poisson_loader", recording_loader)
    torch.manual_seed(0)  # public: the model's initialisation and the data
    X = torch.cat([torch.arange(60.0)[:, None], torch.randn(60, 3)], 1)  # column 0: index
    y = torch.arange(60) % 3
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)
        warnings.filterwarnings("ignore", "Optimal order is the largest alpha")
        res = warmup_finetune(model, X, y, epsilon_centres=1.0, delta_centres=1e-5,
                              epsilon_train=2.0, delta_train=1e-5, epochs=1, batch_size=15,
                              lr=1e-2, progress=False, **kw)
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    monkeypatch.undo()
    return res.centres.centers_.clone(), recorded[0].batches, params


def test_warmup_noise_and_batches_are_secret_unless_a_generator_is_given(monkeypatch):
    a, b = _warmup_run(monkeypatch), _warmup_run(monkeypatch)
    assert not torch.equal(a[0], b[0])  # the centres' Gaussian noise
    assert a[1] != b[1]  # the Poisson batches
    assert not torch.equal(a[2], b[2])  # DP-SGD (noise and batches)
    c = _warmup_run(monkeypatch, generator=torch.Generator().manual_seed(3))
    d = _warmup_run(monkeypatch, generator=torch.Generator().manual_seed(3))
    assert torch.equal(c[0], d[0]) and c[1] == d[1] and torch.equal(c[2], d[2])


def test_warmup_seed_is_deprecated_and_seeds_nothing(monkeypatch):
    with pytest.warns(DeprecationWarning, match="generator="):
        a = _warmup_run(monkeypatch, seed=0)
    with pytest.warns(DeprecationWarning):
        b = _warmup_run(monkeypatch, seed=0)
    assert not torch.equal(a[0], b[0]) and a[1] != b[1]


# -- the Opacus-compatible make_private ----------------------------------------------------------
def _opacus_run(noise_generator=None, loader_generator=None):
    """make_private on a linear model with Poisson sampling, then one step on a fixed batch.

    Returns (the first batches of the returned loader, the parameter update of that step): the
    batch of the step is the same in every run, so the update differs only by the noise."""
    torch.manual_seed(0)  # public: the model's initialisation
    model = nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.arange(8) % 3
    loader = DataLoader(TensorDataset(torch.arange(N), torch.zeros(N)), batch_size=8,
                        generator=loader_generator)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Opacus: "Secure RNG turned off"
        module, optimizer, dp_loader = opacus_compat.PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            noise_generator=noise_generator)
    members = _members(dp_loader)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    nn.functional.cross_entropy(module(x), y).backward()
    optimizer.step()
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    return members, after - before


def test_make_private_noise_and_batches_are_secret_by_default():
    (batches_a, update_a), (batches_b, update_b) = _opacus_run(), _opacus_run()
    assert batches_a != batches_b
    assert not torch.equal(update_a, update_b)


def test_make_private_with_generators_is_reproducible_as_in_opacus():
    # a seeded noise_generator: Opacus' reproducible run (noise from it, sampling from torch's
    # global generator); a loader with its own generator: its batches, the noise stays secret
    a = _opacus_run(noise_generator=torch.Generator().manual_seed(7))
    b = _opacus_run(noise_generator=torch.Generator().manual_seed(7))
    assert a[0] == b[0] and torch.equal(a[1], b[1])
    c = _opacus_run(loader_generator=torch.Generator().manual_seed(2))
    d = _opacus_run(loader_generator=torch.Generator().manual_seed(2))
    assert c[0] == d[0] and not torch.equal(c[1], d[1])


def test_checkpoint_keeps_the_state_of_a_given_generator_only(tmp_path):
    """A checkpoint holding the default (entropy) generator's state would let its reader regenerate
    every noise draw of the run: only a user-given (already public) generator's state is saved, for
    a reproducible resume."""
    for k, given in enumerate((None, torch.Generator().manual_seed(3))):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        engine = opacus_compat.PrivacyEngine(accountant="rdp")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            module, optimizer, _ = engine.make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                data_loader=DataLoader(TensorDataset(torch.randn(N, 4)), batch_size=8),
                noise_multiplier=1.0, max_grad_norm=1.0, noise_generator=given)
        path = tmp_path / f"ckpt{k}.pt"  # two runs: each its own checkpoint and step ledger
        engine.save_checkpoint(path=path, module=module, optimizer=optimizer)
        saved = torch.load(path, weights_only=False)
        assert ("noise_generator_state" in saved) == (given is not None)
